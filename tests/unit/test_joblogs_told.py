"""What a consumer from before the ``preempted`` state is told of a preempted job."""

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
    older = told(_status(JobState.PREEMPTED), knows_preempted=False)
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
    assert told(_status(JobState.PREEMPTED), knows_preempted=True).state == "preempted"


@pytest.mark.parametrize("state", [s for s in JobState if s is not JobState.PREEMPTED])
def test_every_other_state_and_output_pass_unchanged(state: JobState) -> None:
    status = _status(state)
    assert told(status, knows_preempted=False) is status
    output = JobOutput(seq=1, attempt=1, stream="stdout", data=b"x")
    assert told(output, knows_preempted=False) is output
