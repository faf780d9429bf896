"""What a consumer is told of a hosted job's status: the epoch of the copy that runs
here, and for one from before the ``preempted`` state, ``failed`` instead."""

from __future__ import annotations

import msgspec
import pytest

from gpumesh.agent.joblogs import told
from gpumesh.protocol.messages import JobOutput, JobStatus
from gpumesh.protocol.states import JobState, job_state


def _status(state: str) -> JobStatus:
    return JobStatus(
        job_id="a" * 12,
        seq=7,
        state=state,
        attempt=1,
        exit_code=143,
        message="alice-pc's owner paused sharing",
    )


def test_a_consumer_from_before_preempted_is_told_failed_with_the_same_reason() -> None:
    older = told(_status(JobState.PREEMPTED), knows_preempted=False, epoch=0)
    assert isinstance(older, JobStatus)
    assert (older.state, older.message, older.exit_code, older.seq) == (
        "failed",
        "alice-pc's owner paused sharing",
        143,
        7,
    )
    # What that consumer decodes and checks: a state it knows.
    assert job_state(msgspec.msgpack.decode(msgspec.msgpack.encode(older), type=JobStatus).state)


def test_a_consumer_that_knows_preempted_reads_it() -> None:
    assert told(_status(JobState.PREEMPTED), knows_preempted=True, epoch=0).state == "preempted"


@pytest.mark.parametrize("state", [s for s in JobState if s is not JobState.PREEMPTED])
def test_every_other_state_and_output_pass_unchanged(state: JobState) -> None:
    status = _status(state)
    assert told(status, knows_preempted=False, epoch=0) is status
    output = JobOutput(seq=1, attempt=1, stream="stdout", data=b"x")
    assert told(output, knows_preempted=False, epoch=3) is output


@pytest.mark.parametrize("knows_preempted", [True, False])
def test_every_status_carries_the_epoch_of_the_copy_that_runs_here(knows_preempted: bool) -> None:
    for state in JobState:
        stamped = told(_status(state), knows_preempted=knows_preempted, epoch=4)
        assert stamped.epoch == 4
        assert (stamped.seq, stamped.message) == (7, "alice-pc's owner paused sharing")
    older = told(_status(JobState.PREEMPTED), knows_preempted=False, epoch=2)
    assert (older.state, older.epoch) == ("failed", 2)
