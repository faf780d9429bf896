"""The facts about jobs that every layer shares: a job's states and a node's roles.

Defined once, here, at the floor every other layer may import: the wire carries
the states (``JobStatus.state``), the store keeps them in its ``jobs`` table,
the agent's state machine (``agent/jobstate.py``) moves between them and the
client and CLI show them. Both are ``StrEnum``: a member equals its text, so
the store and the wire keep the same values they always had.
"""

from __future__ import annotations

import enum

from gpumesh.errors import ProtocolError

__all__ = ["FINAL_STATES", "LEGACY_STATES", "OWNER_CANCELLED", "JobRole", "JobState", "job_state"]


class JobState(enum.StrEnum):
    QUEUED = "queued"
    UPLOADING = "uploading"
    STARTING = "starting"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    """Stopped because the provider's owner took the machine back (``gpumesh pause``,
    or a GPU reclaimed for the owner's own process); the message says which."""


FINAL_STATES = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED}
)
"""States a job never leaves."""

LEGACY_STATES: dict[str, JobState] = {JobState.PREEMPTED: JobState.FAILED}
"""What a peer that does not know a state is told instead: a consumer from before
``preempted`` reads ``failed`` (with the same message) rather than a state it would
refuse (see :func:`job_state`)."""


OWNER_CANCELLED = "cancelled by the provider's owner"
"""Why a job the provider's owner cancelled (``gpumesh cancel`` of a hosted job) ended:
written by the owner's command into the store, read by the agent that applies it."""


def job_state(value: str, sender: str = "the provider") -> JobState:
    """A state as a peer wrote it (``JobStatus.state`` is text on the wire, so a
    state added later does not break decoding): a refusal, not a crash, when it is
    none of ours."""
    try:
        return JobState(value)
    except ValueError:
        raise ProtocolError(
            f"{sender} reported a job state this version does not know ({value[:16]!r}); "
            "upgrade gpumesh on this machine"
        ) from None


class JobRole(enum.StrEnum):
    """Which side of a job this node's store records."""

    SUBMITTED = "submitted"
    """This node sent the job to a provider."""
    HOSTED = "hosted"
    """This node runs the job for a peer."""
