"""The shape of ``gpumesh jobs --json``: the jobs this node submitted and hosted."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gpumesh.client.views.outputs import OutputsView

if TYPE_CHECKING:
    from gpumesh.store.jobs import JobRecord

__all__ = ["HopView", "JobListEntry", "PrunedJob"]


class HopView(msgspec.Struct):
    """One provider a job ran on (a hop), oldest first; the last is where it is now."""

    peer: str
    attempt: int
    """The job's last start there, counting every start of the job (0: none yet)."""
    ended: str
    """How the job left it (``preempted``, ``denied``, ``forgot``, ``unreachable``), or
    for the last hop the job's state there."""
    reason: str
    epoch: int
    """The hop's fencing epoch: outputs and states count only from the newest."""

    @classmethod
    def all_of(cls, job: JobRecord) -> list[HopView]:
        left = [
            cls(
                str(h["peer"]),
                int(h["attempt"]),
                str(h["ended"]),
                str(h["reason"]),
                int(h["epoch"]),
            )
            for h in job.hops
        ]
        if job.peer_id:
            attempt = job.attempts_before + job.attempt
            left.append(cls(job.peer_name, attempt, str(job.state), job.message, job.epoch))
        return left


class JobListEntry(msgspec.Struct):
    """One job as this node last knew it."""

    job_id: str
    role: str
    """``submitted`` (sent to a peer) or ``hosted`` (run here for a peer)."""
    peer: str
    """The provider (submitted; empty while none holds the job: queued, or moving)
    or the submitter (hosted)."""
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
    group: str = ""
    """Submitted with ``--group``: the group it runs (and moves) in."""
    hops: list[HopView] = msgspec.field(default_factory=list)
    """Submitted: every provider it ran on, oldest first (the last: where it runs now;
    none while it waits in the queue for its first)."""

    @classmethod
    def of(cls, job: JobRecord, unconfirmed: dict[str, str]) -> JobListEntry:
        """``unconfirmed``: the ids of jobs whose providers did not answer, and why."""
        unknown = job.job_id in unconfirmed
        return cls(
            job_id=job.job_id,
            role=job.role,
            peer=job.peer_name if job.peer_id or job.role == "hosted" else "",
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
            group=job.job_group,
            hops=HopView.all_of(job) if job.role == "submitted" else [],
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
