"""Address hints: the ``host:port`` texts a node hands out, and their one grammar.

A pairing code, a group invite and a signed address record each carry hints
(where the node listens, its relay) that the receiving node stores and later
dials. They come from another machine, so each is read here, once, by one
grammar: the host is an IP literal (IPv6 in brackets, no zone) or an RFC 1123
host name, the port 1-65535 in decimal digits. Anything else is refused with
:class:`ValueError` saying why, before it is stored, shown, or given to a
socket or a QUIC stack (whose own parsers raise their own errors).

Kept on the identity floor because the codes that carry hints are read here;
:mod:`gpumesh.protocol.addresses` builds its address type on it. Pure code:
no socket and no name resolution.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from typing import Final

__all__ = ["MAX_HINT_CHARS", "check_hint", "check_hints", "dial_order", "split_hint"]

MAX_HINT_CHARS: Final = 255
"""Longest hint text: a host name's 253 characters and then some for the port."""
_MAX_NAME_CHARS = 253
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_PORT = re.compile(r"[0-9]{1,5}")


def dial_order(last: str | None, hints: list[str]) -> list[str]:
    """A peer's addresses to try: ``last`` (the one that worked last time, if any)
    first, then its code's hints."""
    return ([last] if last else []) + [hint for hint in hints if hint != last]


def split_hint(text: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` (or, with ``default_port``, the host alone) as
    ``(host, port)``; :class:`ValueError` unless the host is an IP literal or an RFC
    1123 host name and the port is 1-65535."""
    if len(text) > MAX_HINT_CHARS:
        raise ValueError(f"over {MAX_HINT_CHARS} characters")
    bracketed = text.startswith("[")
    if bracketed:
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError("an IPv6 address in brackets must be followed by :port")
        port_text = rest[1:]
        if not port_text and rest:
            raise ValueError("no port after the ':'")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        if not port_text:
            raise ValueError("no port after the ':'")
    else:
        host, port_text = text, ""
    _check_host(host, bracketed=bracketed)
    if not port_text:
        if default_port is None:
            raise ValueError("no port")
        return (host, default_port)
    if not _PORT.fullmatch(port_text) or not 0 < int(port_text) < 65536:
        raise ValueError(f"the port {port_text[:20]!r} is not a number from 1 to 65535")
    return (host, int(port_text))


def check_hint(text: str, *, port_optional: bool = False) -> str:
    """``text`` when :func:`split_hint` takes it (``port_optional``: a host alone too,
    as a relay hint that means the default port); else :class:`ValueError` that
    quotes it (cut short, markup and control characters escaped) and says why."""
    try:
        split_hint(text, 0 if port_optional else None)
    except ValueError as exc:
        raise ValueError(f"{text[:60]!r} is not a host:port ({exc})") from None
    return text


def check_hints(addresses: list[str], relay: str) -> None:
    """A node's addresses and its relay (when not empty) by :func:`check_hint`;
    on the first bad one :class:`ValueError` of two arguments, ``"address"`` or
    ``"relay"``, and why. What codes, invites and the peers a store loads are read by."""
    for text in addresses:
        try:
            check_hint(text)
        except ValueError as exc:
            raise ValueError("address", str(exc)) from None
    if relay:
        try:
            check_hint(relay, port_optional=True)  # the relay's default port
        except ValueError as exc:
            raise ValueError("relay", str(exc)) from None


def _check_host(host: str, *, bracketed: bool) -> None:
    if not host:
        raise ValueError("no host")
    if bracketed or ":" in host:
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError("not an IPv6 address") from None
        if address.scope_id is not None:
            # A zone names an interface of the machine that wrote it, not of this one.
            raise ValueError("an IPv6 zone (%...) means nothing on another machine")
        return
    with contextlib.suppress(ValueError):
        ipaddress.IPv4Address(host)
        return
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    if (
        len(name) > _MAX_NAME_CHARS
        or not all(_LABEL.fullmatch(label) for label in labels)
        # All digits at the end reads as a (mistyped) IPv4 address, never a name.
        or labels[-1].isdigit()
    ):
        raise ValueError("the host is neither an IP address nor a host name")
