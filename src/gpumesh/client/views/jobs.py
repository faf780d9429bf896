"""View structs of one job's operations (run, logs, cancel): where a job stands,
and the events of a followed job.

``gpumesh run``, ``logs`` and ``cancel`` print text, not JSON; these are the
shapes the control API returns for the same results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gpumesh.protocol.states import JobRole, JobState

if TYPE_CHECKING:
    from gpumesh.client.jobs import JobResult

__all__ = [
    "JOB_EVENTS",
    "Dropped",
    "JobEventView",
    "JobResultView",
    "Moved",
    "Output",
    "Reconnecting",
    "Status",
]


class JobResultView(msgspec.Struct):
    job_id: str
    peer: str
    """The provider (a submitted job) or the submitter (a hosted one)."""
    role: JobRole
    state: JobState
    final: bool
    exit_code: int | None
    attempt: int
    message: str
    gpus: list[str]
    output_dropped: int
    """Bytes of the job's oldest output its provider dropped, as far as known."""

    @classmethod
    def of(cls, result: JobResult) -> JobResultView:
        return cls(
            job_id=result.job_id,
            peer=result.peer,
            role=result.role,
            state=JobState(result.state),
            final=result.final,
            exit_code=result.exit_code,
            attempt=result.attempt,
            message=result.message,
            gpus=list(result.gpus),
            output_dropped=result.output_dropped,
        )


class JobEventView(msgspec.Struct, tag_field="kind", tag=str.lower):
    """One event of a followed job, as the control API streams it; the ``kind``
    field says which of the structs below it is."""

    seq: int
    """The event's sequence number: resume after it (0: not numbered)."""


class Output(JobEventView, tag="output"):
    """Bytes the job wrote."""

    stream: str
    """``stdout`` or ``stderr``."""
    data: str
    """The bytes, base64: output need not be text."""
    text: str
    """The bytes as UTF-8, invalid sequences replaced."""


class Status(JobEventView, tag="status"):
    """The job entered a state (or began an attempt)."""

    state: JobState
    attempt: int
    exit_code: int | None
    message: str
    exited: bool
    """The program exited on its own (``message`` only repeats its code)."""


class Dropped(JobEventView, tag="dropped"):
    """Bytes of output the provider dropped just before the next output."""

    count: int


class Reconnecting(JobEventView, tag="reconnecting"):
    """The link to the provider dropped; the follow redials and resumes."""

    code: str
    message: str


class Moved(JobEventView, tag="moved"):
    """The job left a provider and runs on another now (between two hops)."""

    left: str
    to: str
    attempt: int
    """Its first start on ``to``, counting every start of the job."""
    reason: str
    """How the hop ended and why."""
    unread: str
    """Why the left hop's output could not all be read (empty: it was)."""


JOB_EVENTS: dict[str, type] = {
    "output": Output,
    "status": Status,
    "dropped": Dropped,
    "reconnecting": Reconnecting,
    "moved": Moved,
    "end": JobResultView,
}
"""A followed job's Server-Sent Events (``GET /api/v1/jobs/{id}/events``): each
name's struct; ``end`` is the job's result."""
