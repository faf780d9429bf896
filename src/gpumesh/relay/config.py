"""The relay's settings: limits and access, from flags and a TOML file.

Everything the relay decides with is resolved here, once, at startup: the
allowlist and token files are read into :class:`RelayConfig`, so the core
never touches a file. Access is private by default; a config that names no
allowed node, no token and not ``open`` is refused with the one line the
operator needs.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumesh.errors import ConfigError
from gpumesh.identity.keys import NodeId
from gpumesh.protocol.relaycore import RelayRules
from gpumesh.units import parse_duration, parse_size

__all__ = [
    "DURATION_KEYS",
    "INT_KEYS",
    "PRIVATE_BY_DEFAULT",
    "SIZE_KEYS",
    "RelayConfig",
    "check_node_ids",
    "load_config_file",
    "parse_listen",
    "parse_tcp",
    "read_allow_file",
    "read_token_file",
]

DEFAULT_RELAY_PORT = 4799
"""Same as :data:`gpumesh.protocol.relay.DEFAULT_RELAY_PORT` (a test holds them equal);
not imported from there so ``gpumesh-relay --help`` does not load the codec."""
DEFAULT_TCP_PORT = 443
"""The relay's TCP port when ``--tcp`` names a host alone: HTTPS's, which networks that
block UDP still let out."""

PRIVATE_BY_DEFAULT = (
    "the relay is private by default: give --allow NODE_ID, --allow-file FILE or "
    "--token-file FILE (or --open to serve anyone)"
)


@dataclass(frozen=True)
class RelayConfig(RelayRules):
    """What one relay process serves, to whom, and within which limits: the rules
    (:class:`~gpumesh.protocol.relaycore.RelayRules`) and where it listens."""

    host: str = "0.0.0.0"
    """Address the UDP socket binds to."""
    port: int = DEFAULT_RELAY_PORT
    """UDP port; 0 picks a free one (tests)."""
    queue: int = 256
    """Packets queued per destination while the socket would block; more are dropped.
    A TCP connection holds about as many bytes (``queue`` full-size packets) unsent."""
    tcp_host: str = "0.0.0.0"
    """Address the TCP (TLS) listener binds to, when ``tcp_port`` is set."""
    tcp_port: int | None = None
    """TCP port to serve relayed sessions on over TLS as well; None: UDP only; 0 picks a
    free one (tests)."""
    tls_cert: Path | None = None
    """PEM certificate (chain) the TCP listener presents; None: a self-signed one made at
    start. Nodes do not check it (what they say is authenticated inside)."""
    tls_key: Path | None = None
    """PEM private key of ``tls_cert``; given with it or not at all."""
    stats_file: Path | None = None
    """JSON file rewritten (atomically) with counters, at most once a second."""
    log_level: str = "info"
    """Log level of the stderr log."""

    def access_summary(self) -> str:
        """``open``, or what private access rests on: ``private: 2 allowed nodes, token``."""
        if self.open:
            return "open: any node may register"
        parts = []
        if self.allow:
            count = len(self.allow)
            parts.append(f"{count} allowed node{'s' if count != 1 else ''}")
        if self.tokens:
            parts.append("token" if len(self.tokens) == 1 else f"{len(self.tokens)} tokens")
        return "private: " + ", ".join(parts or ["nobody allowed"])

    def check(self) -> RelayConfig:
        """Return self if it can run, else raise ConfigError saying what to fix."""
        if not self.open and not self.allow and not self.tokens:
            raise ConfigError(PRIVATE_BY_DEFAULT)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"invalid port {self.port}: use 0-65535")
        if self.tcp_port is not None and not 0 <= self.tcp_port <= 65535:
            raise ConfigError(f"invalid tcp port {self.tcp_port}: use 0-65535")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(
                "give both the TLS certificate and its key (--tls-cert and --tls-key), "
                "or neither for a self-signed certificate made at start"
            )
        if self.tls_cert is not None and self.tcp_port is None:
            raise ConfigError("--tls-cert and --tls-key are for the TCP listener: give --tcp too")
        for name in INT_KEYS:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.max_sessions_per_pair >= self.max_sessions:
            raise ConfigError(
                f"max_sessions_per_pair ({self.max_sessions_per_pair}) must be below "
                f"max_sessions ({self.max_sessions}), or one node could take all of another "
                "node's relayed sessions"
            )
        for name in (*SIZE_KEYS, *DURATION_KEYS):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative")
        if self.stats_file is not None and not self.stats_file.parent.is_dir():
            raise ConfigError(
                f"the stats file's folder {self.stats_file.parent} does not exist; create it first"
            )
        if self.registration_timeout <= self.keepalive:
            raise ConfigError(
                f"registration_timeout ({self.registration_timeout:g}s) must be longer than "
                f"keepalive ({self.keepalive:g}s), or every node would expire between keep-alives"
            )
        return self


# --- parsers shared by flags and file ---------------------------------------------------------


def parse_listen(text: str, default_port: int = DEFAULT_RELAY_PORT) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, ``:port`` or ``host`` (``default_port``)."""
    cleaned = text.strip()
    host, port_text = cleaned, ""
    if cleaned.startswith("["):
        end = cleaned.find("]")
        if end < 0:
            raise ConfigError(f"invalid listen address {text!r}: missing ']'")
        host, rest = cleaned[1:end], cleaned[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ConfigError(f"invalid listen address {text!r}: use [ADDRESS]:PORT")
        port_text = rest[1:]
    elif cleaned.count(":") == 1:
        host, port_text = cleaned.split(":")
    if not port_text:
        port = default_port
    elif port_text.isdigit() and int(port_text) <= 65535:
        port = int(port_text)
    else:
        raise ConfigError(f"invalid listen address {text!r}: the port must be 0-65535")
    return host or "0.0.0.0", port


def parse_tcp(text: str) -> tuple[str, int]:
    """``--tcp``'s address: as :func:`parse_listen`, port 443 when none is given."""
    try:
        return parse_listen(text, DEFAULT_TCP_PORT)
    except ConfigError as exc:
        raise ConfigError(f"--tcp: {exc.message}") from None


def _lines(path: Path, what: str) -> list[tuple[int, str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot read {what} {path}: {reason}") from None
    lines = enumerate((raw.split("#", 1)[0].strip() for raw in text.splitlines()), start=1)
    return [(number, line) for number, line in lines if line]


def read_allow_file(path: Path) -> frozenset[str]:
    """Node ids, one per line; ``#`` starts a comment. A malformed id names its line."""

    ids = set()
    for number, line in _lines(path, "allow file"):
        if not NodeId.is_well_formed(line):
            raise ConfigError(f"{path}:{number}: {line!r} is not a node id (26 characters)")
        ids.add(line)
    return frozenset(ids)


def read_token_file(path: Path) -> tuple[str, ...]:
    """Shared tokens, one per line (several allow rotation); ``#`` starts a comment."""
    tokens = tuple(line for _, line in _lines(path, "token file"))
    if not tokens:
        raise ConfigError(f"token file {path} holds no token")
    return tokens


def check_node_ids(ids: list[str] | tuple[str, ...], where: str) -> frozenset[str]:
    for node_id in ids:
        if not isinstance(node_id, str) or not NodeId.is_well_formed(node_id.strip()):
            raise ConfigError(f"{where}: {node_id!r} is not a node id (26 characters)")
    return frozenset(node_id.strip() for node_id in ids)


# --- the TOML file ----------------------------------------------------------------------------

SIZE_KEYS = ("session_bytes", "session_rate")
DURATION_KEYS = (
    "keepalive",
    "registration_timeout",
    "connect_timeout",
    "session_seconds",
    "session_idle",
)
INT_KEYS = (
    "max_registrations",
    "max_per_ip",
    "max_sessions",
    "max_sessions_initiated",
    "max_sessions_per_pair",
    "queue",
)
_PATH_KEYS = ("allow_file", "token_file", "stats_file", "tls_cert", "tls_key")
FILE_KEYS = frozenset(
    {
        "listen",
        "tcp",
        "allow",
        "open",
        "log_level",
        *SIZE_KEYS,
        *DURATION_KEYS,
        *INT_KEYS,
        *_PATH_KEYS,
    }
)


def load_config_file(path: Path) -> dict[str, Any]:
    """The settings in a TOML file, typed and checked, keyed like :class:`RelayConfig`.

    Besides RelayConfig's own keys the file may hold ``listen`` and ``tcp``
    ("host:port"), ``allow_file`` and ``token_file`` (read here); relative paths
    (those and ``stats_file``, ``tls_cert``, ``tls_key``) are relative to the
    file. Sizes and durations may be numbers or strings with units.
    Unknown keys are an error, so a typo never silently loosens a limit.
    """

    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(raw) - FILE_KEYS)
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown setting {unknown[0]!r} "
            f"(known: {', '.join(sorted(FILE_KEYS))})"
        )
    out: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"config file {path}: {key}"
        if key == "listen":
            out["host"], out["port"] = parse_listen(_text(value, where))
        elif key == "tcp":
            try:
                out["tcp_host"], out["tcp_port"] = parse_listen(
                    _text(value, where), DEFAULT_TCP_PORT
                )
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc.message}") from None
        elif key == "allow":
            if not isinstance(value, list):
                raise ConfigError(f"{where} must be a list of node ids")
            out["allow"] = check_node_ids(value, where)
        elif key == "open":
            if not isinstance(value, bool):
                raise ConfigError(f"{where} must be true or false")
            out["open"] = value
        elif key == "log_level":
            out["log_level"] = _text(value, where)
        elif key in SIZE_KEYS:
            out[key] = _size(value, where)
        elif key in DURATION_KEYS:
            out[key] = _duration(value, where)
        elif key in INT_KEYS:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{where} must be a whole number")
            out[key] = value
        else:  # a path
            target = Path(_text(value, where)).expanduser()
            out[key] = target if target.is_absolute() else path.parent / target
    return out


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string")
    return value


def _size(value: object, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    raise ConfigError(f"{where} must be a size such as 10GB, or a number of bytes")


def _duration(value: object, where: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    raise ConfigError(f"{where} must be seconds or a duration such as 45s or 2m")
