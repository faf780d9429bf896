"""The provider's side of jobs that move, without I/O: the refusal of a job id held
under another epoch, the variables that tell an attempt which start of the job it
is, and the outputs a moved job's submitter restored, taken as home already."""

from __future__ import annotations

import time

import pytest

from gpumesh.agent.jobrun import ATTEMPT_ENV, RESUMED_ENV, attempt_env
from gpumesh.agent.jobs import fenced
from gpumesh.errors import InUseError, error_from_code
from gpumesh.protocol.states import JobRole
from gpumesh.store.db import Store
from gpumesh.store.jobs import JobRecord

JOB = "1a2b3c4d5e6f"


def _hosted(epoch: int) -> JobRecord:
    return JobRecord(
        role=JobRole.HOSTED,
        job_id=JOB,
        peer_id="b" * 52,
        peer_name="bob",
        image="busybox",
        command=["true"],
        env={},
        gpu_memory=0,
        gpus=[],
        retries=0,
        timeout=0.0,
        workdir="",
        created_at=time.time(),
        epoch=epoch,
    )


def test_a_newer_copy_is_refused_in_one_line_that_survives_the_wire() -> None:
    refusal = fenced(_hosted(1), 2)
    assert isinstance(refusal, InUseError)
    assert refusal.message.startswith(
        f"job {JOB} ran here before as an older copy (epoch 1): it cannot come back under epoch 2"
    )
    assert "\n" not in refusal.message
    again = error_from_code(refusal.code, refusal.message)
    assert type(again) is InUseError and again.message == refusal.message


def test_an_older_copy_is_refused_saying_a_newer_one_came_here() -> None:
    refusal = fenced(_hosted(3), 2)
    assert isinstance(refusal, InUseError)
    assert "came here as a newer copy (epoch 3)" in refusal.message
    assert "(epoch 2) cannot take its place" in refusal.message


@pytest.mark.parametrize(
    ("before", "attempt", "start", "resumed"),
    [(0, 1, "1", "0"), (0, 2, "2", "1"), (2, 1, "3", "1"), (2, 3, "5", "1"), (1, 1, "2", "1")],
)
def test_an_attempt_is_told_which_start_of_the_job_it_is(
    before: int, attempt: int, start: str, resumed: str
) -> None:
    assert attempt_env(before, attempt) == {ATTEMPT_ENV: start, RESUMED_ENV: resumed}


def test_restored_outputs_are_not_listed_but_a_file_the_job_changes_is(store: Store) -> None:
    restored = [("model.pt", 10, 1_000, 1.0), ("log/epoch1", 3, 2_000, 2.0)]
    assert store.record_outputs(JOB, restored, baseline=True) == 0
    assert store.job_outputs(JOB, 0, 100) == []
    # The job's watch and scans find them unchanged: still not listed.
    assert store.record_outputs(JOB, restored) == 0
    assert store.job_outputs(JOB, 0, 100) == []
    # It writes a new checkpoint over the restored one, and a file of its own.
    assert store.record_outputs(JOB, [("model.pt", 12, 3_000, 3.0), ("log/epoch2", 3, 4_000, 4.0)])
    listed = store.job_outputs(JOB, 0, 100)
    assert [(e.seq, e.path, e.size) for e in listed] == [(1, "model.pt", 12), (2, "log/epoch2", 3)]
    assert store.record_outputs(JOB, [("log/epoch1", 4, 5_000, 5.0)]) == 1
    assert [e.path for e in store.job_outputs(JOB, 2, 100)] == ["log/epoch1"]
