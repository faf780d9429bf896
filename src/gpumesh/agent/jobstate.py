"""The life of a hosted job, without I/O: states, attempts, retries, cancel.

::

    queued -> uploading -> starting -> running -> succeeded
                              ^           |  \\-> failed      (no retries left)
                              |           v
                              +------ retrying              (non-zero exit or infra failure)
    any non-final state --cancel--> cancelled               (never retried)
    any non-final state --preempt-> preempted               (the owner took the machine
                                                             back; never retried here)

The job service feeds outcomes in and acts on the decisions that come out;
time never enters here (backoff delays are returned, not slept).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumesh.protocol.states import FINAL_STATES, JobState

__all__ = ["FINAL_STATES", "MOVED", "REVOKED", "Decision", "JobMachine", "JobState", "backoff"]


REVOKED = "access revoked"
"""Why the jobs of a peer that was denied (or unpaired) were cancelled."""
MOVED = "moved to another provider by its submitter"
"""Why a job was cancelled by a ``JobCancel`` with ``moved``: its submitter runs a
newer copy elsewhere."""


def backoff(attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1, 2, 4, ... capped at 30)."""
    return float(min(30, 2 ** max(0, attempt - 1)))


@dataclass(frozen=True)
class Decision:
    """What to do after an attempt ended."""

    state: JobState
    """RETRYING (then start another attempt after ``delay``) or a final state."""
    delay: float = 0.0
    message: str = ""
    exited: bool = False
    """The attempt's program exited on its own (``message`` only repeats its code)."""


class JobMachine:
    """One job's state; ``attempt`` counts from 1 once the first attempt starts."""

    def __init__(
        self,
        retries: int,
        *,
        state: JobState = JobState.QUEUED,
        attempt: int = 0,
        cancel_requested: bool = False,
        cancel_reason: str = "",
    ) -> None:
        self.retries = retries
        self.state = state
        self.attempt = attempt
        self.cancel_requested = cancel_requested
        self.cancel_reason = cancel_reason or "cancelled"
        """Why it was cancelled: ``cancelled`` (its submitter), ``access revoked``..."""
        self.preempt_reason = ""
        """Why the provider's owner took the machine back (empty: it did not)."""

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def stopping(self) -> bool:
        """A cancel or a preemption was asked: the running attempt is its last."""
        return self.cancel_requested or bool(self.preempt_reason)

    @property
    def attempts_left(self) -> int:
        return self.retries + 1 - self.attempt

    def uploading(self) -> None:
        self._expect(JobState.QUEUED)
        self.state = JobState.UPLOADING

    def start_attempt(self) -> int:
        """Begin the next attempt; returns its number."""
        self._expect(JobState.QUEUED, JobState.UPLOADING, JobState.RETRYING)
        self.attempt += 1
        self.state = JobState.STARTING
        return self.attempt

    def running(self) -> None:
        self._expect(JobState.STARTING)
        self.state = JobState.RUNNING

    def exited(self, exit_code: int) -> Decision:
        """The attempt's container exited with ``exit_code``."""
        self._expect(JobState.STARTING, JobState.RUNNING)
        if self.cancel_requested:
            return self._finish(JobState.CANCELLED, self.cancel_reason)
        if self.preempt_reason:
            return self._finish(JobState.PREEMPTED, self.preempt_reason)
        if exit_code == 0:
            return self._finish(JobState.SUCCEEDED, "exited 0", exited=True)
        return self._failed(f"exited {exit_code}", exited=True)

    def infra_failed(self, message: str) -> Decision:
        """The attempt could not run (engine error, lost container, timeout...)."""
        if self.final:
            return Decision(self.state)
        if self.cancel_requested:
            return self._finish(JobState.CANCELLED, self.cancel_reason)
        if self.preempt_reason:
            return self._finish(JobState.PREEMPTED, self.preempt_reason)
        return self._failed(message)

    def cancel(self, reason: str = "cancelled") -> Decision | None:
        """Ask to cancel, saying why. Returns the final decision when nothing is
        running (the job ends now); None when a running container must be stopped
        first."""
        if self.final:
            return None
        if not self.cancel_requested:
            self.cancel_reason = reason
        self.cancel_requested = True
        if self.state in (JobState.STARTING, JobState.RUNNING):
            return None
        return self._finish(JobState.CANCELLED, self.cancel_reason)

    def preempt(self, reason: str) -> Decision | None:
        """The provider's owner takes the machine back, saying why. As :meth:`cancel`:
        the final decision when nothing is running, None when a running container must
        be stopped first (its end is then ``preempted`` however it exits). A cancel
        asked before wins."""
        if self.final or self.cancel_requested:
            return None
        self.preempt_reason = self.preempt_reason or reason
        if self.state in (JobState.STARTING, JobState.RUNNING):
            return None
        return self._finish(JobState.PREEMPTED, self.preempt_reason)

    def _failed(self, message: str, *, exited: bool = False) -> Decision:
        if self.attempt == 0:  # nothing ever ran: there is no attempt to retry
            return self._finish(JobState.FAILED, message, exited=exited)
        if self.attempts_left > 0:
            self.state = JobState.RETRYING
            delay = backoff(self.attempt)
            return Decision(
                JobState.RETRYING,
                delay,
                f"attempt {self.attempt} {message}; retrying in {delay:.0f}s "
                f"({self.attempts_left} left)",
                exited,
            )
        return self._finish(JobState.FAILED, message, exited=exited)

    def _finish(self, state: JobState, message: str, *, exited: bool = False) -> Decision:
        self.state = state
        return Decision(state, 0.0, message, exited)

    def _expect(self, *states: JobState) -> None:
        if self.state not in states:
            allowed = ", ".join(s.value for s in states)
            raise ValueError(f"job is {self.state.value}, expected one of: {allowed}")
