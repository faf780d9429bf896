"""A UDP address and its text form, the way every layer passes them.

Defined once, at the floor the punching and admission state machines need it:
the transport, the relay and the agent import it from here. Pure code: no
socket, no name resolution (``parse_address`` reads digits, it looks nothing up).
"""

from __future__ import annotations

__all__ = ["Address", "format_address", "parse_address"]

Address = tuple[str, int]
"""``(host, port)``: an IP address in text and a UDP port."""


def parse_address(text: str, default_port: int | None = None) -> Address:
    """``host:port`` or ``[v6]:port`` into a tuple."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.lstrip(":")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not port_text:
        if default_port is None:
            raise ValueError(f"address {text!r} has no port")
        return (host, default_port)
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range")
    return (host, port)


def format_address(address: Address) -> str:
    """``host:port``, or ``[v6]:port``."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
