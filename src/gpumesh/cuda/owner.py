"""What the owner sees of this node's CUDA sessions.

The running agent's open CUDA sessions come from what it says of itself
(:meth:`Home.agent_info`); ``status`` and ``cuda doctor`` read them here. What
one session is (:class:`~gpumesh.client.owner.OwnerSession`) and who the workers
run as (:func:`~gpumesh.client.owner.worker_user`) are the owner's view of the
node (:mod:`gpumesh.client.owner`), which ``doctor`` reads too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumesh.client.owner import OwnerSession, sessions_of

if TYPE_CHECKING:
    from gpumesh.store.home import Home

__all__ = ["open_sessions"]


def open_sessions(home: Home) -> list[OwnerSession]:
    """The running agent's CUDA sessions (none when it does not run)."""
    agent = home.agent_info()
    return [] if agent is None else sessions_of(agent)
