"""View structs of a job's steps before it runs (``POST /api/v1/jobs?stream=true``):
where ``--group`` placed it, the provider's image pull, its acceptance, the
workdir upload. The job's own events follow as :mod:`gpumesh.client.views.jobs`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gpumesh.client.views.jobs import JOB_EVENTS

if TYPE_CHECKING:
    from gpumesh.client.runs import RunEvent

__all__ = [
    "RUN_EVENTS",
    "AcceptedView",
    "CandidateView",
    "PlacedView",
    "PullingView",
    "UploadingView",
    "step_view",
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


StepView = PlacedView | PullingView | AcceptedView | UploadingView

RUN_EVENTS: dict[str, type] = {
    **JOB_EVENTS,
    **{cls.__name__.lower(): cls for cls in (PlacedView, PullingView, AcceptedView, UploadingView)},
}
"""A run's Server-Sent Events (``POST /api/v1/jobs?stream=true``): its steps, as the
control API names them (the struct's name), then the job's own; ``end`` is its result."""


def step_view(event: RunEvent) -> StepView | None:
    """A step before the job runs as its view; None for the job's own events."""
    from gpumesh.client import runs

    if isinstance(event, runs.Placed):
        placement = event.placement
        assert placement.chosen is not None
        candidates = [CandidateView(c.name, c.eligible, c.reason) for c in placement.candidates]
        chosen = placement.chosen
        return PlacedView(CandidateView(chosen.name, chosen.eligible, chosen.reason), candidates)
    if isinstance(event, runs.Pulling):
        pull = event.pull
        return PullingView(
            pull.image, pull.layers, pull.layers_done, pull.downloaded, pull.total, pull.done
        )
    if isinstance(event, runs.Accepted):
        accepted = event.accepted
        return AcceptedView(accepted.job_id, accepted.provider, list(accepted.gpus))
    if isinstance(event, runs.Uploading):
        return UploadingView(event.sent, event.total)
    return None
