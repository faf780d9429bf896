"""The shapes of a job's forwarded ports (``gpumesh port``, ``run --port``): what the
node process says while it forwards them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from gpumesh.client.ports import ForwardReady
    from gpumesh.protocol.ports import PortSpec

__all__ = [
    "PORT_EVENTS",
    "ForwardedPortView",
    "PortAnswersView",
    "PortRefusedView",
    "PortWarningView",
    "PortsView",
    "local_url",
]


def local_url(local: int) -> str:
    return f"http://127.0.0.1:{local}"


class ForwardedPortView(msgspec.Struct):
    """One forward: ``127.0.0.1:local`` here reaches ``container`` in the job."""

    local: int
    container: int
    url: str
    """``http://127.0.0.1:LOCAL`` (any TCP protocol passes; HTTP is the usual one)."""
    listening: bool
    """Whether something listens on the port in the container already."""


class PortsView(msgspec.Struct):
    """``port --json``: printed once every local port listens."""

    job_id: str
    provider: str
    ports: list[ForwardedPortView]
    owner_checked: bool
    """True: connections from other users' processes here are refused."""

    @classmethod
    def of(cls, ready: ForwardReady) -> PortsView:
        return cls(
            job_id=ready.job_id,
            provider=ready.provider,
            ports=[
                ForwardedPortView(
                    spec.local,
                    spec.container,
                    local_url(spec.local),
                    spec.container in ready.listening,
                )
                for spec in ready.ports
            ],
            owner_checked=ready.owner_checked,
        )


class PortAnswersView(msgspec.Struct):
    """A container port listens now (told once per forward, as soon as it does)."""

    local: int
    container: int
    url: str

    @classmethod
    def of(cls, spec: PortSpec) -> PortAnswersView:
        return cls(spec.local, spec.container, local_url(spec.local))


class PortRefusedView(msgspec.Struct):
    """A local connection refused: another user's process made it."""

    uid: int | None


class PortWarningView(msgspec.Struct):
    """A connection the provider refused while the forward goes on (nothing listens
    on that port in the container yet)."""

    message: str


PORT_EVENTS: dict[str, type] = {
    cls.__name__.lower(): cls
    for cls in (PortsView, PortAnswersView, PortRefusedView, PortWarningView)
}
"""A forward's Server-Sent Events (``POST /api/v1/jobs/{job_id}/ports``), named as the
control API names them: the struct's name."""
