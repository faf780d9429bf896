"""A moved job's hops: what each copy starts from, how a followed job's events are
numbered across them, and which provider's word counts (the newest hop's).

Pure: no I/O. The node process's keeper (:mod:`gpumesh.client.moves`) moves jobs;
submitting, following and listing them (:mod:`gpumesh.client.jobs`) read this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumesh.protocol.messages import JobStatus

if TYPE_CHECKING:
    from gpumesh.store.jobs import JobRecord

__all__ = ["HOP_SPAN", "NextHop", "status_of", "status_problem"]

HOP_SPAN = 10**12
"""A followed job's event cursor is ``hop * HOP_SPAN + seq``: each hop's provider
numbers its events from 1, and a cursor names the hop as well as the event."""


@dataclass(frozen=True)
class NextHop:
    """What a job's next copy starts from."""

    epoch: int
    """Its fencing epoch (the job's epoch so far, plus one)."""
    attempts_before: int
    """Starts the job made before it."""
    left: frozenset[str]
    """The providers (node ids) the job left: never placed on again."""


def status_problem(job: JobRecord, peer_id: str, status: JobStatus) -> str | None:
    """Why a provider's status of ``job`` is not applied (None: it is): it must come
    from the job's current provider and carry its epoch (0: a provider before
    fencing, which never hosts a moved job's later hops)."""
    if peer_id != job.peer_id:
        return "it came from a provider the job left"
    if status.epoch and status.epoch != job.epoch:
        return f"it carries epoch {status.epoch}, and the job's newest hop is epoch {job.epoch}"
    return None


def status_of(job: JobRecord) -> JobStatus:
    """The job's last state as its record has it, as a provider would say it."""
    return JobStatus(
        job_id=job.job_id,
        seq=0,
        state=job.state,
        attempt=job.attempt,
        exit_code=job.exit_code,
        message=job.message,
        epoch=job.epoch,
    )
