"""View structs of one job's operations (run, logs, cancel): where a job stands.

``gpumesh run``, ``logs`` and ``cancel`` print text, not JSON; this is the shape
the control API returns for the same results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gpumesh.protocol.states import JobRole, JobState

if TYPE_CHECKING:
    from gpumesh.client.jobs import JobResult

__all__ = ["JobResultView"]


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
