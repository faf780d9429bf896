"""View structs of a job's steps before it runs (``POST /api/v1/jobs?stream=true``):
where ``--group`` placed it, the provider's image pull, its acceptance, the
workdir upload. The job's own events follow as :mod:`gpumesh.client.views.jobs`'s,
and, for a job with ``--outputs``, where they came (:class:`OutputsView`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gpumesh.client.views.jobs import JOB_EVENTS
from gpumesh.client.views.outputs import OutputsView

if TYPE_CHECKING:
    pass

__all__ = [
    "RUN_EVENTS",
    "AcceptedView",
    "CandidateView",
    "PlacedView",
    "PullingView",
    "QueuedView",
    "UploadingView",
]


class CandidateView(msgspec.Struct):
    name: str
    eligible: bool
    reason: str
    """Why it was chosen or skipped, for people."""


class PlacedView(msgspec.Struct):
    """Where ``--group`` put the job, and every member's verdict."""

    chosen: CandidateView
    candidates: list[CandidateView]


class PullingView(msgspec.Struct):
    """How the provider's pull of the job's image goes (the engine's figures)."""

    image: str
    layers: int
    layers_done: int
    downloaded: int
    total: int
    done: bool


class AcceptedView(msgspec.Struct):
    """The provider took the job."""

    job_id: str
    provider: str
    gpus: list[str]


class UploadingView(msgspec.Struct):
    """Bytes of the workdir sent so far."""

    sent: int
    total: int


class QueuedView(msgspec.Struct):
    """No provider can take the job now: it waits in the node process's queue
    (``run --wait``); its events follow once one does."""

    job_id: str
    message: str
    """Why it waits: every member's reason."""


StepView = PlacedView | PullingView | AcceptedView | UploadingView | QueuedView

RUN_EVENTS: dict[str, type] = {
    **JOB_EVENTS,
    **{
        cls.__name__.lower(): cls
        for cls in (PlacedView, PullingView, AcceptedView, UploadingView, QueuedView)
    },
    "outputsview": OutputsView,
}
"""A run's Server-Sent Events (``POST /api/v1/jobs?stream=true``): its steps, as the
control API names them (the struct's name), then the job's own; ``end`` is its result."""
