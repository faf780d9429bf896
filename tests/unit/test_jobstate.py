"""agent/jobstate: the sans-I/O life of a hosted job.

States, numbered attempts, retries with capped exponential backoff, and cancel
(at once when nothing runs; on the next outcome when a container is running,
and then never retried). Ends with a hypothesis state machine that drives
random call sequences against a small reference model and checks invariants.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from gpumesh.agent.jobstate import FINAL_STATES, Decision, JobMachine, JobState, backoff

S = JobState


def _at(state: JobState, *, retries: int = 2, attempt: int = 1) -> JobMachine:
    """A machine driven (through its public API only) into ``state``."""
    machine = JobMachine(retries)
    if state is S.QUEUED:
        return machine
    if state is S.UPLOADING:
        machine.uploading()
        return machine
    if state is S.CANCELLED:
        assert machine.cancel() == Decision(S.CANCELLED, 0.0, "cancelled")
        return machine
    if state is S.PREEMPTED:
        assert machine.preempt("paused") == Decision(S.PREEMPTED, 0.0, "paused")
        return machine
    for _ in range(attempt - 1):
        machine.start_attempt()
        assert machine.exited(1).state is S.RETRYING
    if state is S.RETRYING:
        machine.start_attempt()
        assert machine.exited(1).state is S.RETRYING
        return machine
    machine.start_attempt()
    if state is S.STARTING:
        return machine
    machine.running()
    if state is S.RUNNING:
        return machine
    if state is S.SUCCEEDED:
        machine.exited(0)
    elif state is S.FAILED:
        while machine.exited(9).state is S.RETRYING:
            machine.start_attempt()
    assert machine.state is state
    return machine


# --- backoff ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "delay"),
    [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 16.0), (6, 30.0), (7, 30.0), (50, 30.0)],
)
def test_backoff_doubles_from_one_second_and_is_capped_at_thirty(
    attempt: int, delay: float
) -> None:
    assert backoff(attempt) == delay
    assert isinstance(backoff(attempt), float)


def test_final_states_are_exactly_succeeded_failed_cancelled_preempted() -> None:
    assert frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.PREEMPTED}) == FINAL_STATES


# --- happy paths -----------------------------------------------------------------------------


def test_happy_path_queued_starting_running_succeeded() -> None:
    machine = JobMachine(retries=3)
    assert machine.state is S.QUEUED
    assert machine.attempt == 0
    assert machine.attempts_left == 4
    assert not machine.final
    assert not machine.cancel_requested

    assert machine.start_attempt() == 1
    assert machine.state is S.STARTING
    assert machine.attempt == 1
    assert machine.attempts_left == 3

    machine.running()
    assert machine.state is S.RUNNING

    decision = machine.exited(0)
    assert decision == Decision(S.SUCCEEDED, 0.0, "exited 0", exited=True)
    assert machine.state is S.SUCCEEDED
    assert machine.final
    assert machine.attempt == 1


def test_uploading_path_then_first_attempt() -> None:
    machine = JobMachine(retries=0)
    machine.uploading()
    assert machine.state is S.UPLOADING
    assert machine.attempt == 0
    assert not machine.final
    assert machine.start_attempt() == 1
    assert machine.state is S.STARTING
    machine.running()
    assert machine.exited(0).state is S.SUCCEEDED


def test_exit_zero_while_still_starting_succeeds() -> None:
    """A container can exit before it was ever seen running."""
    machine = JobMachine(retries=0)
    machine.start_attempt()
    assert machine.exited(0).state is S.SUCCEEDED


def test_states_are_string_valued_for_storage() -> None:
    assert S.RETRYING == "retrying"
    assert S("cancelled") is S.CANCELLED
    assert [s.value for s in S] == [
        "queued",
        "uploading",
        "starting",
        "running",
        "retrying",
        "succeeded",
        "failed",
        "cancelled",
        "preempted",
    ]


# --- retries ---------------------------------------------------------------------------------


def test_non_zero_exit_with_retries_left_retries_with_backoff() -> None:
    machine = JobMachine(retries=2)
    machine.start_attempt()
    machine.running()
    decision = machine.exited(3)
    assert decision.state is S.RETRYING
    assert decision.delay == 1.0
    assert decision.message == "attempt 1 exited 3; retrying in 1s (2 left)"
    assert machine.state is S.RETRYING
    assert not machine.final
    assert machine.attempts_left == 2


def test_attempts_are_numbered_and_backoff_grows_then_caps() -> None:
    retries = 8
    machine = JobMachine(retries=retries)
    delays = []
    for expected_attempt in range(1, retries + 1):
        assert machine.start_attempt() == expected_attempt
        assert machine.attempt == expected_attempt
        machine.running()
        decision = machine.exited(expected_attempt)  # a different code each time
        assert decision.state is S.RETRYING
        assert f"attempt {expected_attempt} exited {expected_attempt};" in decision.message
        assert f"({retries + 1 - expected_attempt} left)" in decision.message
        delays.append(decision.delay)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert machine.start_attempt() == retries + 1
    assert machine.attempts_left == 0


def test_exhausting_retries_fails_with_the_last_exit() -> None:
    machine = JobMachine(retries=2)
    for code in (5, 6):
        machine.start_attempt()
        machine.running()
        assert machine.exited(code).state is S.RETRYING
    assert machine.start_attempt() == 3
    machine.running()
    decision = machine.exited(7)
    assert decision == Decision(S.FAILED, 0.0, "exited 7", exited=True)
    assert machine.state is S.FAILED
    assert machine.final
    assert machine.attempt == 3
    assert machine.attempts_left == 0


def test_no_retries_means_the_first_failure_is_final() -> None:
    machine = JobMachine(retries=0)
    machine.start_attempt()
    machine.running()
    assert machine.exited(137) == Decision(S.FAILED, 0.0, "exited 137", exited=True)


@pytest.mark.parametrize("code", [-1, 1, 2, 126, 127, 137, 255])
def test_any_non_zero_exit_is_a_failure(code: int) -> None:
    machine = JobMachine(retries=0)
    machine.start_attempt()
    machine.running()
    assert machine.exited(code).state is S.FAILED


def test_infra_failure_counts_as_an_attempt() -> None:
    machine = JobMachine(retries=1)
    assert machine.start_attempt() == 1
    decision = machine.infra_failed("engine error")
    assert decision.state is S.RETRYING
    assert decision.delay == 1.0
    assert decision.message == "attempt 1 engine error; retrying in 1s (1 left)"
    assert machine.attempts_left == 1

    assert machine.start_attempt() == 2
    machine.running()
    decision = machine.infra_failed("timed out after 60s")
    assert decision == Decision(S.FAILED, 0.0, "timed out after 60s")
    assert machine.state is S.FAILED
    assert machine.attempt == 2


def test_infra_failures_and_exits_share_one_attempt_budget() -> None:
    machine = JobMachine(retries=2)
    machine.start_attempt()
    assert machine.infra_failed("lost container").delay == 1.0
    machine.start_attempt()
    machine.running()
    assert machine.exited(1).delay == 2.0
    machine.start_attempt()
    assert machine.infra_failed("image missing").state is S.FAILED


@pytest.mark.parametrize("state", [S.QUEUED, S.UPLOADING])
def test_infra_failure_before_any_attempt_never_retries_attempt_zero(state: JobState) -> None:
    """The job service reports e.g. "the provider restarted during the upload" here."""
    machine = _at(state, retries=2)
    decision = machine.infra_failed("the provider restarted during the upload")
    assert "attempt 0" not in decision.message
    assert machine.state is not S.RETRYING or machine.attempt >= 1


def test_restored_machine_continues_from_stored_fields() -> None:
    """The job service rebuilds machines from the database after a restart."""
    machine = JobMachine(2, state=S.RUNNING, attempt=3)
    assert machine.attempts_left == 0
    assert machine.exited(1).state is S.FAILED

    machine = JobMachine(2, state=S.RETRYING, attempt=1)
    assert machine.start_attempt() == 2

    machine = JobMachine(2, state=S.RUNNING, attempt=1, cancel_requested=True)
    assert machine.exited(1).state is S.CANCELLED


# --- cancel ----------------------------------------------------------------------------------


@pytest.mark.parametrize("state", [S.QUEUED, S.UPLOADING, S.RETRYING])
def test_cancel_when_nothing_runs_ends_at_once(state: JobState) -> None:
    machine = _at(state)
    attempt = machine.attempt
    decision = machine.cancel()
    assert decision == Decision(S.CANCELLED, 0.0, "cancelled")
    assert machine.state is S.CANCELLED
    assert machine.final
    assert machine.cancel_requested
    assert machine.attempt == attempt
    with pytest.raises(ValueError, match="job is cancelled"):
        machine.start_attempt()


@pytest.mark.parametrize("state", [S.STARTING, S.RUNNING])
@pytest.mark.parametrize("code", [0, 1, 137])
def test_cancel_while_a_container_runs_waits_for_its_exit(state: JobState, code: int) -> None:
    machine = _at(state, retries=5)
    assert machine.cancel() is None
    assert machine.state is state
    assert machine.cancel_requested
    assert not machine.final
    decision = machine.exited(code)
    assert decision == Decision(S.CANCELLED, 0.0, "cancelled")
    assert machine.state is S.CANCELLED


@pytest.mark.parametrize("state", [S.STARTING, S.RUNNING])
def test_cancel_while_running_then_infra_failure_is_cancelled_not_retried(
    state: JobState,
) -> None:
    machine = _at(state, retries=5)
    assert machine.attempts_left > 0
    assert machine.cancel() is None
    decision = machine.infra_failed("engine error")
    assert decision == Decision(S.CANCELLED, 0.0, "cancelled")
    assert machine.state is S.CANCELLED


def test_cancel_twice_while_running_is_harmless() -> None:
    machine = _at(S.RUNNING)
    assert machine.cancel() is None
    assert machine.cancel() is None
    assert machine.state is S.RUNNING
    assert machine.exited(1).state is S.CANCELLED


@pytest.mark.parametrize("state", [S.SUCCEEDED, S.FAILED, S.CANCELLED])
def test_cancel_of_a_final_job_does_nothing(state: JobState) -> None:
    machine = _at(state)
    before = (machine.state, machine.attempt, machine.cancel_requested)
    assert machine.cancel() is None
    assert (machine.state, machine.attempt, machine.cancel_requested) == before


@pytest.mark.parametrize("state", [S.SUCCEEDED, S.FAILED, S.CANCELLED])
def test_infra_failure_after_the_end_keeps_the_final_state(state: JobState) -> None:
    machine = _at(state)
    attempt = machine.attempt
    assert machine.infra_failed("late engine error").state is state
    assert machine.state is state
    assert machine.attempt == attempt


# --- illegal transitions ---------------------------------------------------------------------

_ILLEGAL = [
    (S.QUEUED, "running"),
    (S.QUEUED, "exited"),
    (S.UPLOADING, "uploading"),
    (S.UPLOADING, "running"),
    (S.UPLOADING, "exited"),
    (S.STARTING, "uploading"),
    (S.STARTING, "start_attempt"),
    (S.RUNNING, "uploading"),
    (S.RUNNING, "start_attempt"),
    (S.RUNNING, "running"),
    (S.RETRYING, "uploading"),
    (S.RETRYING, "running"),
    (S.RETRYING, "exited"),
    *[(final, call) for final in sorted(FINAL_STATES) for call in ("uploading", "start_attempt")],
    *[(final, call) for final in sorted(FINAL_STATES) for call in ("running", "exited")],
]


def _call(machine: JobMachine, call: str) -> object:
    if call == "exited":
        return machine.exited(0)
    return getattr(machine, call)()


@pytest.mark.parametrize(("state", "call"), _ILLEGAL, ids=str)
def test_illegal_transitions_raise_and_change_nothing(state: JobState, call: str) -> None:
    machine = _at(state)
    before = (machine.state, machine.attempt, machine.cancel_requested)
    with pytest.raises(ValueError, match=f"job is {state.value}, expected one of: "):
        _call(machine, call)
    assert (machine.state, machine.attempt, machine.cancel_requested) == before


# --- preemption -------------------------------------------------------------------------------


def test_a_running_job_preempted_ends_preempted_however_its_program_exits() -> None:
    for code in (0, 1, 143):
        machine = _at(S.RUNNING)
        assert machine.preempt("alice-pc's owner paused sharing") is None  # stop it first
        assert machine.stopping
        assert machine.exited(code) == Decision(S.PREEMPTED, 0.0, "alice-pc's owner paused sharing")
        assert machine.final


def test_a_preempted_job_that_fails_to_stop_cleanly_is_still_preempted_never_retried() -> None:
    machine = _at(S.RUNNING, retries=5)
    machine.preempt("GPU 0 reclaimed")
    assert machine.infra_failed("its container disappeared") == Decision(
        S.PREEMPTED, 0.0, "GPU 0 reclaimed"
    )


@pytest.mark.parametrize("state", [S.QUEUED, S.UPLOADING, S.RETRYING], ids=str)
def test_a_job_not_running_is_preempted_at_once(state: JobState) -> None:
    machine = _at(state)
    assert machine.preempt("paused") == Decision(S.PREEMPTED, 0.0, "paused")
    assert machine.state is S.PREEMPTED


def test_a_cancel_asked_before_a_preemption_wins_and_the_first_reason_stays() -> None:
    cancelled = _at(S.RUNNING)
    cancelled.cancel()
    assert cancelled.preempt("paused") is None
    assert cancelled.exited(143).state is S.CANCELLED
    twice = _at(S.RUNNING)
    twice.preempt("GPU 0 reclaimed")
    twice.preempt("paused")
    assert twice.exited(0).message == "GPU 0 reclaimed"
    assert _at(S.SUCCEEDED).preempt("paused") is None


def test_illegal_transition_message_names_the_allowed_states() -> None:
    machine = JobMachine(1)
    with pytest.raises(ValueError) as caught:
        machine.running()
    assert str(caught.value) == "job is queued, expected one of: starting"


# --- random sequences ------------------------------------------------------------------------


class JobMachineRules(RuleBasedStateMachine):
    """Random call sequences against a reference model of the documented rules."""

    def __init__(self) -> None:
        super().__init__()
        self.machine = JobMachine(0)
        self.retries = 0
        self.cancel_called_while_live = False
        self.cancel_called = False
        self.final_snapshot: tuple[JobState, int] | None = None

    @initialize(retries=st.integers(min_value=0, max_value=7))
    def make(self, retries: int) -> None:
        self.machine = JobMachine(retries)
        self.retries = retries

    # Every call is tried in every state: illegal ones must raise and change nothing.

    def _illegal(self, call: str, code: int = 0) -> None:
        before = (self.machine.state, self.machine.attempt, self.machine.cancel_requested)
        with pytest.raises(ValueError):
            if call == "exited":
                self.machine.exited(code)
            else:
                getattr(self.machine, call)()
        assert (self.machine.state, self.machine.attempt, self.machine.cancel_requested) == before

    def _after_outcome(
        self, decision: Decision, *, attempt_before: int, exit_code: int | None
    ) -> None:
        m = self.machine
        assert decision.state is m.state
        assert m.attempt == attempt_before  # an outcome never starts an attempt
        if self.cancel_called_while_live:
            assert decision == Decision(S.CANCELLED, 0.0, "cancelled")
        elif exit_code == 0:
            assert decision.state is S.SUCCEEDED
        elif self.retries + 1 - attempt_before > 0:
            assert decision.state is S.RETRYING
            assert decision.delay == min(30.0, 2.0 ** (attempt_before - 1))
            assert decision.message.startswith(f"attempt {attempt_before} ")
        else:
            assert decision.state is S.FAILED
            assert decision.delay == 0.0
            if exit_code is not None:
                assert decision.message == f"exited {exit_code}"
        if decision.state is S.SUCCEEDED:
            assert exit_code == 0

    @rule()
    def uploading(self) -> None:
        if self.machine.state is S.QUEUED:
            self.machine.uploading()
            assert self.machine.state is S.UPLOADING
        else:
            self._illegal("uploading")

    @rule()
    def start_attempt(self) -> None:
        before = self.machine.attempt
        if self.machine.state in (S.QUEUED, S.UPLOADING, S.RETRYING):
            assert self.machine.start_attempt() == before + 1
            assert self.machine.attempt == before + 1
            assert self.machine.state is S.STARTING
        else:
            self._illegal("start_attempt")

    @rule()
    def running(self) -> None:
        if self.machine.state is S.STARTING:
            self.machine.running()
            assert self.machine.state is S.RUNNING
        else:
            self._illegal("running")

    @rule(code=st.sampled_from([0, 0, 1, 2, 127, 137, -9]))
    def exited(self, code: int) -> None:
        if self.machine.state in (S.STARTING, S.RUNNING):
            before = self.machine.attempt
            decision = self.machine.exited(code)
            self._after_outcome(decision, attempt_before=before, exit_code=code)
        else:
            self._illegal("exited", code)

    @precondition(lambda self: self.machine.state in (S.STARTING, S.RUNNING, *FINAL_STATES))
    @rule(message=st.sampled_from(["engine error", "lost container", "timed out after 5s"]))
    def infra_failed(self, message: str) -> None:
        # Outside an attempt (queued, uploading, retrying) see the test above.
        before_state = self.machine.state
        before = self.machine.attempt
        decision = self.machine.infra_failed(message)
        if before_state in FINAL_STATES:
            assert decision.state is before_state
            assert self.machine.state is before_state
            return
        self._after_outcome(decision, attempt_before=before, exit_code=None)
        if decision.state is S.FAILED and not self.cancel_called_while_live:
            assert decision.message == message

    @rule()
    def cancel(self) -> None:
        state = self.machine.state
        decision = self.machine.cancel()
        self.cancel_called = True
        if state in FINAL_STATES:
            assert decision is None
            return
        self.cancel_called_while_live = True
        assert self.machine.cancel_requested
        if state in (S.STARTING, S.RUNNING):
            assert decision is None
            assert self.machine.state is state
        else:
            assert decision == Decision(S.CANCELLED, 0.0, "cancelled")
            assert self.machine.state is S.CANCELLED

    # --- invariants ---

    @invariant()
    def attempt_never_exceeds_retries_plus_one(self) -> None:
        assert 0 <= self.machine.attempt <= self.retries + 1
        assert self.machine.attempts_left >= 0

    @invariant()
    def final_states_are_sticky(self) -> None:
        m = self.machine
        if self.final_snapshot is not None:
            assert (m.state, m.attempt) == self.final_snapshot
        if m.final:
            self.final_snapshot = (m.state, m.attempt)
        assert m.final == (m.state in FINAL_STATES)

    @invariant()
    def cancelled_only_after_cancel(self) -> None:
        if self.machine.state is S.CANCELLED:
            assert self.cancel_called_while_live
        if self.machine.cancel_requested:
            assert self.cancel_called

    @invariant()
    def a_cancelled_job_is_never_retried(self) -> None:
        if self.cancel_called_while_live:
            assert self.machine.state in (S.STARTING, S.RUNNING, S.CANCELLED)

    @invariant()
    def retrying_only_with_attempts_left(self) -> None:
        if self.machine.state is S.RETRYING:
            assert self.machine.attempts_left > 0
            assert self.machine.attempt >= 1

    @invariant()
    def succeeded_only_after_an_attempt(self) -> None:
        if self.machine.state in (S.SUCCEEDED, S.FAILED):
            assert self.machine.attempt >= 1


JobMachineRules.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestJobMachineRules = JobMachineRules.TestCase


def test_a_decision_says_whether_the_program_exited_on_its_own() -> None:
    """Followers read this flag (JobStatus.exited), never the message's words."""
    machine = JobMachine(retries=1)
    machine.start_attempt()
    machine.running()
    retry = machine.exited(3)
    assert retry.state is JobState.RETRYING and retry.exited
    machine.start_attempt()
    assert machine.infra_failed("timed out after 5s").exited is False

    done = JobMachine(retries=0)
    done.start_attempt()
    assert done.exited(0).exited and done.state is JobState.SUCCEEDED

    cancelled = JobMachine(retries=0)
    cancelled.start_attempt()
    assert cancelled.cancel("cancelled by bob") is None
    decision = cancelled.exited(137)
    assert decision.state is JobState.CANCELLED and not decision.exited


def test_a_state_a_peer_reports_is_ours_or_a_clear_refusal() -> None:
    """JobStatus.state is text on the wire: a state this version does not know (a
    newer provider's, or a hostile one's) is a ProtocolError naming it, not a crash."""
    from gpumesh.errors import ProtocolError
    from gpumesh.protocol.states import job_state

    assert job_state("running") is JobState.RUNNING
    with pytest.raises(ProtocolError) as caught:
        job_state("paused-by-magic" * 4, "alice-pc")
    message = caught.value.message
    assert message.startswith(
        "alice-pc reported a job state this version does not know ('paused-by-magi"
    )
    assert message.endswith("upgrade gpumesh on this machine")
    assert "\n" not in message
