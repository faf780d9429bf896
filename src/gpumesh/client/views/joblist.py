"""The shape of ``gpumesh jobs --json``: the jobs this node submitted and hosted."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gpumesh.client.views.outputs import OutputsView

if TYPE_CHECKING:
    from gpumesh.store.jobs import JobRecord

__all__ = ["JobListEntry", "PrunedJob"]


class JobListEntry(msgspec.Struct):
    """One job as this node last knew it."""

    job_id: str
    role: str
    """``submitted`` (sent to a peer) or ``hosted`` (run here for a peer)."""
    peer: str
    state: str
    exit_code: int | None
    attempt: int
    retries: int
    image: str
    command: list[str]
    gpus: list[str]
    gpu_memory: int
    """Bytes of GPU memory asked for."""
    peak_gpu_memory: int
    """Most bytes of GPU memory its processes used at once."""
    created_at: float
    started_at: float | None
    finished_at: float | None
    duration: float | None
    message: str
    output_dropped: int
    confirmed_at: float | None
    """Submitted: when the provider last confirmed its state."""
    unknown_since: float | None
    """When the provider did not answer this time: its last confirmed state's time."""
    unknown_reason: str | None
    """Why the provider did not say where it stands (it may be empty)."""
    provider_forgot: bool
    outputs: OutputsView | None = None
    """Submitted with ``--outputs``: where they come home, and how far they came."""

    @classmethod
    def of(cls, job: JobRecord, unconfirmed: dict[str, str]) -> JobListEntry:
        """``unconfirmed``: the ids of jobs whose providers did not answer, and why."""
        unknown = job.job_id in unconfirmed
        return cls(
            job_id=job.job_id,
            role=job.role,
            peer=job.peer_name,
            state=job.state,
            exit_code=job.exit_code,
            attempt=job.attempt,
            retries=job.retries,
            image=job.image,
            command=job.command,
            gpus=job.gpus,
            gpu_memory=job.gpu_memory,
            peak_gpu_memory=job.peak_gpu_memory,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            duration=job.duration,
            message=job.message,
            output_dropped=job.output_dropped,
            confirmed_at=job.confirmed_at,
            unknown_since=last_confirmed(job) if unknown else None,
            unknown_reason=unconfirmed.get(job.job_id),
            provider_forgot=job.provider_forgot,
            outputs=OutputsView.of(job),
        )


def last_confirmed(job: JobRecord) -> float:
    """When a job's state was last known for sure: confirmed, or else created."""
    return job.confirmed_at if job.confirmed_at is not None else job.created_at


class PrunedJob(msgspec.Struct):
    """A finished job ``prune`` removed (or, with ``dry_run``, would remove)."""

    job_id: str
    role: str
    state: str

    @classmethod
    def of(cls, job: JobRecord) -> PrunedJob:
        return cls(job.job_id, str(job.role), str(job.state))
