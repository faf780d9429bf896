"""The owner's view of a providing node: who is connected and what runs here for peers.

Read from this home's store and the running agent's ``agent.json``; no network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumesh.protocol.states import FINAL_STATES, JobRole

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.store.db import JobRecord
    from gpumesh.store.home import AgentInfo

__all__ = ["OwnerView", "owner_view"]


@dataclass(frozen=True)
class OwnerView:
    agent: AgentInfo | None
    """The running `gpumesh share`, or None."""
    hosted: list[JobRecord]
    """The newest jobs run here for peers, newest first."""

    @property
    def running(self) -> list[JobRecord]:
        return [j for j in self.hosted if j.state not in FINAL_STATES]


def owner_view(node: Node, *, limit: int = 50) -> OwnerView:
    """Who uses this machine: the agent's connected peers and the jobs it hosts."""
    store = node.home.store
    return OwnerView(node.home.read_agent_info(), store.jobs(limit=limit, role=JobRole.HOSTED))
