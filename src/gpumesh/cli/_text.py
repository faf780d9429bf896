"""Text from peers made safe for one line of a log or a table cell."""

from __future__ import annotations

__all__ = ["escape_controls"]

# Line breaks and terminal controls a peer could put in a name, a path or an error text.
# U+2028 and U+2029 are not controls but end a line for many readers.
_ESCAPES = {code: f"\\x{code:02x}" for code in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
_ESCAPES |= {ord("\n"): "\\n", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def escape_controls(text: str) -> str:
    """``text`` on one line: a newline as ``\\n``, other controls as ``\\xNN``."""
    return text.translate(_ESCAPES)
