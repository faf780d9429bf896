"""The owner's view of a providing node (the control API's ``/owner``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gpumesh.client.views.joblist import JobListEntry

if TYPE_CHECKING:
    from gpumesh.client.owner import OwnerView

__all__ = ["OwnerStatusView"]


class OwnerStatusView(msgspec.Struct):
    """Who uses this machine now."""

    sharing: bool
    agent_pid: int | None
    connections: list[dict[str, str]]
    """The agent's connected peers: ``{"peer": name, "path": "direct"}``."""
    running: int
    """Jobs run here for peers that have not ended."""
    hosted: list[JobListEntry]
    """The newest jobs run here for peers, newest first."""

    @classmethod
    def of(cls, view: OwnerView) -> OwnerStatusView:
        agent = view.agent
        return cls(
            sharing=agent is not None,
            agent_pid=agent.pid if agent else None,
            connections=agent.links if agent else [],
            running=len(view.running),
            hosted=[JobListEntry.of(j, {}) for j in view.hosted],
        )
