"""Human units: sizes like ``8GB`` / ``16GiB`` and durations, both ways.

Decimal suffixes (KB, MB, GB, TB) are powers of 1000 and binary ones (KiB,
MiB, GiB, TiB) powers of 1024, as Docker and most users read them. A bare
number is bytes.
"""

from __future__ import annotations

import re
from decimal import Decimal

from gpumesh.errors import ConfigError

__all__ = ["format_duration", "format_rate", "format_size", "parse_duration", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse ``8GB``, ``16GiB``, ``512m`` or ``1024`` into bytes."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"invalid size {text!r}: use a number with a unit such as 512MB, 8GB or 16GiB"
        )

    return int(Decimal(match.group(1)) * _UNITS[unit])


_NUMBER = r"\d+(?:\.\d+)?"
_DURATION = re.compile(
    rf"(?:(?P<d>{_NUMBER})\s*d)?\s*(?:(?P<h>{_NUMBER})\s*h)?\s*"
    rf"(?:(?P<m>{_NUMBER})\s*m(?!s))?\s*(?:(?P<s>{_NUMBER})\s*s)?\s*"
    rf"(?:(?P<ms>{_NUMBER})\s*ms)?",
    re.IGNORECASE,
)
_SECONDS_PER = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_duration(text: str) -> float:
    """Seconds in ``90`` (a bare number is seconds), ``90s``, ``500ms``, ``30m``,
    ``2h``, ``1h30m`` or ``1d``: every flag and setting that takes a duration."""
    cleaned = text.strip()
    if re.fullmatch(_NUMBER, cleaned):
        return float(cleaned)
    match = _DURATION.fullmatch(cleaned)
    if not cleaned or match is None:
        raise ConfigError(
            f"invalid duration {text!r}: use seconds or a number with a unit, "
            "such as 90s, 30m, 2h or 1h30m"
        )
    return sum(
        float(value) * _SECONDS_PER[unit] for unit, value in match.groupdict().items() if value
    )


def format_size(num_bytes: float) -> str:
    """Format bytes the way users write them: ``8GB``, ``1.5MB``, ``900B``."""
    if abs(num_bytes) < 1000:
        return f"{int(num_bytes)}B"
    value = float(num_bytes)
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1000
        # Round first, so 999,999 bytes reads 1MB rather than 1000KB.
        if abs(round(value, 1)) < 1000 or unit == "TB":
            text = f"{value:.1f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    raise AssertionError("unreachable")


def format_rate(num_bytes: float, seconds: float) -> str:
    """Format a transfer rate in the unit its size calls for: ``15KB/s``, ``2.4GB/s``."""
    if seconds <= 0:
        return "-"
    return f"{format_size(num_bytes / seconds)}/s"


def format_duration(seconds: float) -> str:
    """Format an age or duration: ``850ms``, ``12s``, ``4m``, ``3h``, ``2d``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"
