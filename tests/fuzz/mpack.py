"""A msgpack writer that can lie, for structure-aware fuzzing.

Decoders are fed trees of plain values (``None``, ``bool``, ``int``,
``float``, ``str``, ``bytes``, ``list``, ``dict``) in which any node may be
wrapped to write something a well-behaved encoder never would: a header that
announces another length (:class:`Lie`), the widest header for a short value
(:class:`Wide`, still valid msgpack), a map with a repeated key
(:class:`Pairs`), thousands of nested arrays (:class:`Nest`), an extension
(:class:`Ext`) or raw bytes (:class:`Raw`).

:func:`pack` of a tree without wrappers gives the same bytes as
``msgspec.msgpack.encode`` (a test checks it), so the valid inputs really are
what GPUMesh sends.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["Ext", "Lie", "Nest", "Pairs", "Raw", "Wide", "pack", "plain"]

U32_MAX = 2**32 - 1


@dataclass(frozen=True)
class Lie:
    """A str, bin, array or map whose header announces ``count`` instead of its real size."""

    value: Any
    count: int


@dataclass(frozen=True)
class Wide:
    """``value`` written with the widest header its type has (valid, not the shortest form)."""

    value: Any


@dataclass(frozen=True)
class Pairs:
    """A map written from pairs, so a key may repeat."""

    items: tuple[tuple[Any, Any], ...]


@dataclass(frozen=True)
class Nest:
    """``value`` inside ``depth`` one-element arrays."""

    value: Any
    depth: int


@dataclass(frozen=True)
class Ext:
    """A msgpack extension (code -1 is the timestamp type)."""

    code: int
    data: bytes


@dataclass(frozen=True)
class Raw:
    """Bytes copied into the output as they are."""

    data: bytes


def pack(value: Any) -> bytes:
    out = bytearray()
    _pack(value, out, wide=False, count=None)
    return bytes(out)


def plain(value: Any) -> Any:
    """The tree a decoder should see in ``value``: :class:`Wide` wrappers removed.

    Only meaningful for trees without the other wrappers.
    """
    if isinstance(value, Wide):
        return plain(value.value)
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    return value


# Header bytes: (fix form base, fix form limit, 8-bit, 16-bit, 32-bit); 0 where none exists.
_STR = (0xA0, 32, 0xD9, 0xDA, 0xDB)
_BIN = (0, 0, 0xC4, 0xC5, 0xC6)
_ARRAY = (0x90, 16, 0, 0xDC, 0xDD)
_MAP = (0x80, 16, 0, 0xDE, 0xDF)


def _header(kind: tuple[int, int, int, int, int], n: int, out: bytearray, wide: bool) -> None:
    fix, fix_limit, b8, b16, b32 = kind
    n = min(max(n, 0), U32_MAX)
    if wide:
        out += struct.pack("!BI", b32, n)
    elif n < fix_limit:
        out.append(fix | n)
    elif b8 and n < 0x100:
        out += struct.pack("!BB", b8, n)
    elif n < 0x10000:
        out += struct.pack("!BH", b16, n)
    else:
        out += struct.pack("!BI", b32, n)


def _int(value: int, out: bytearray, wide: bool) -> None:
    if value >= 0:
        if wide:
            out += struct.pack("!BQ", 0xCF, value)
        elif value < 0x80:
            out.append(value)
        elif value < 0x100:
            out += struct.pack("!BB", 0xCC, value)
        elif value < 0x10000:
            out += struct.pack("!BH", 0xCD, value)
        elif value < 0x100000000:
            out += struct.pack("!BI", 0xCE, value)
        else:
            out += struct.pack("!BQ", 0xCF, value)
    elif wide:
        out += struct.pack("!Bq", 0xD3, value)
    elif value >= -32:
        out += struct.pack("!b", value)
    elif value >= -0x80:
        out += struct.pack("!Bb", 0xD0, value)
    elif value >= -0x8000:
        out += struct.pack("!Bh", 0xD1, value)
    elif value >= -0x80000000:
        out += struct.pack("!Bi", 0xD2, value)
    else:
        out += struct.pack("!Bq", 0xD3, value)


def _float(value: float, out: bytearray, wide: bool) -> None:
    # "Wide" for a float means the other width: float32, where that loses nothing.
    if wide:
        try:
            single = struct.pack("!f", value)
        except OverflowError:
            single = b""
        if single and (struct.unpack("!f", single)[0] == value or math.isnan(value)):
            out += b"\xca" + single
            return
    out += b"\xcb" + struct.pack("!d", value)


def _ext(ext: Ext, out: bytearray, wide: bool, count: int | None) -> None:
    n = len(ext.data) if count is None else min(max(count, 0), U32_MAX)
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if n in fixed and not wide:
        out += struct.pack("!Bb", fixed[n], ext.code)
    elif n < 0x100 and not wide:
        out += struct.pack("!BBb", 0xC7, n, ext.code)
    elif n < 0x10000 and not wide:
        out += struct.pack("!BHb", 0xC8, n, ext.code)
    else:
        out += struct.pack("!BIb", 0xC9, n, ext.code)
    out += ext.data


def _pack(value: Any, out: bytearray, wide: bool, count: int | None) -> None:
    if isinstance(value, Wide):
        _pack(value.value, out, True, count)
    elif isinstance(value, Lie):
        _pack(value.value, out, wide, value.count)
    elif isinstance(value, Nest):
        # Written without recursion: the point is depths far past Python's stack.
        out += (b"\xdd\x00\x00\x00\x01" if wide else b"\x91") * value.depth
        _pack(value.value, out, False, None)
    elif isinstance(value, Raw):
        out += value.data
    elif isinstance(value, Ext):
        _ext(value, out, wide, count)
    elif value is None:
        out.append(0xC0)
    elif value is True:
        out.append(0xC3)
    elif value is False:
        out.append(0xC2)
    elif isinstance(value, int):
        _int(value, out, wide)
    elif isinstance(value, float):
        _float(value, out, wide)
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        _header(_STR, len(data) if count is None else count, out, wide)
        out += data
    elif isinstance(value, bytes | bytearray):
        _header(_BIN, len(value) if count is None else count, out, wide)
        out += value
    elif isinstance(value, list | tuple):
        _header(_ARRAY, len(value) if count is None else count, out, wide)
        for item in value:
            _pack(item, out, False, None)
    elif isinstance(value, dict | Pairs):
        items = value.items if isinstance(value, Pairs) else tuple(value.items())
        _header(_MAP, len(items) if count is None else count, out, wide)
        for key, item in items:
            _pack(key, out, False, None)
            _pack(item, out, False, None)
    else:
        raise TypeError(f"cannot pack {type(value).__name__}")
