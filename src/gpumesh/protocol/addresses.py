"""A UDP address and its text form, the way every layer passes them.

Defined once, at the floor the punching and admission state machines need it:
the transport, the relay and the agent import it from here. Pure code: no
socket, no name resolution (``parse_address`` reads text, it looks nothing up).
"""

from __future__ import annotations

from gpumesh.identity.hints import split_hint

__all__ = ["Address", "format_address", "parse_address"]

Address = tuple[str, int]
"""``(host, port)``: an IP address in text and a UDP port."""


def parse_address(text: str, default_port: int | None = None) -> Address:
    """``host:port`` or ``[v6]:port`` into a tuple; :class:`ValueError` unless the host
    is an IP literal or an RFC 1123 host name and the port 1-65535
    (:func:`gpumesh.identity.hints.split_hint`, the one grammar of every hint)."""
    return split_hint(text.strip(), default_port)


def format_address(address: Address) -> str:
    """``host:port``, or ``[v6]:port``."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
