"""A job's forwarded ports as the user names them: ``[LOCAL:]CONTAINER``.

Shared by the CLI (``run --port``, ``gpumesh port``), job.yaml's ``ports:`` and the
node process, which checks them again: one parser, one message per mistake.
Nothing here opens a socket.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumesh.errors import BadRequestError

__all__ = ["PortSpec", "parse_port", "parse_ports"]

MAX_PORTS = 16
"""Most ports one job forwards at once."""


@dataclass(frozen=True)
class PortSpec:
    """``127.0.0.1:local`` here reaches ``container`` in the job's container."""

    local: int
    container: int

    def __str__(self) -> str:
        return f"{self.local}:{self.container}"


def _number(text: str, whole: str) -> int:
    if not text.isdigit():
        raise BadRequestError(f"--port {whole}: {text!r} is not a port number (1-65535)")
    number = int(text)
    if not 1 <= number <= 65535:
        raise BadRequestError(f"--port {whole}: {number} is not a port number (1-65535)")
    return number


def parse_port(text: str | int) -> PortSpec:
    """``8888`` (the same number on both sides) or ``LOCAL:CONTAINER``."""
    whole = str(text).strip()
    local, sep, container = whole.partition(":")
    if not sep:
        number = _number(whole, whole)
        return PortSpec(number, number)
    return PortSpec(_number(local, whole), _number(container, whole))


def parse_ports(texts: list[str] | list[str | int]) -> list[PortSpec]:
    """Each of ``texts``; two forwards may not share a local port."""
    specs = [parse_port(text) for text in texts]
    if len(specs) > MAX_PORTS:
        raise BadRequestError(f"at most {MAX_PORTS} ports per job ({len(specs)} given)")
    seen: set[int] = set()
    for spec in specs:
        if spec.local in seen:
            raise BadRequestError(f"--port: local port {spec.local} is named twice")
        seen.add(spec.local)
    return specs
