"""Jobs that move, the submitter's side without a network: only the newest hop's word
is applied (an older or forged epoch is refused and never recorded), a preempted
group's job is its keeper's to move, the hops a listing shows, the cursor across
hops, and the checks on --max-moves, --wait and job_lease."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.client.hops import HOP_SPAN, status_of, status_problem
from gpumesh.client.jobs import record_status
from gpumesh.client.jobspec import build_spec, queue_wait
from gpumesh.client.node import Node
from gpumesh.client.views.joblist import HopView
from gpumesh.client.views.node import WaitingJob
from gpumesh.daemon.process import _unfinished
from gpumesh.errors import ConfigError
from gpumesh.protocol.messages import JobStatus
from gpumesh.protocol.states import JobRole, JobState
from gpumesh.store.jobs import JobRecord
from tests.unit.test_db import _job as job_record

LEFT = {
    "peer": "alice-pc",
    "peer_id": "alice-id",
    "epoch": 1,
    "attempt": 2,
    "ended": "preempted",
    "reason": "alice-pc's owner paused sharing",
    "stopped": True,
}


def _moved_job() -> JobRecord:
    """A group's job that left alice-pc (epoch 1) and runs on carol (epoch 2)."""
    record = job_record(JobRole.SUBMITTED, "abcd0001", JobState.RUNNING, created_at=1.0)
    return dataclasses.replace(
        record,
        peer_id="carol-id",
        peer_name="carol",
        job_group="research",
        max_moves=3,
        epoch=2,
        attempts_before=2,
        attempt=1,
        hops=[LEFT],
    )


def _status(state: str, epoch: int, message: str = "") -> JobStatus:
    return JobStatus(
        job_id="abcd0001",
        seq=5,
        state=state,
        attempt=1,
        exit_code=0 if state == "succeeded" else None,
        message=message,
        epoch=epoch,
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path / "home")
    made.init("bob-laptop")
    made.home.store.add_job(_moved_job())
    yield made
    made.close()


class _Keeper:
    """Stands in for the node process's keeper: records what it was told."""

    def __init__(self) -> None:
        self.poked: list[str] = []

    def poke(self, job_id: str) -> None:
        self.poked.append(job_id)


def test_only_the_newest_hops_provider_and_epoch_count() -> None:
    job = _moved_job()
    assert status_problem(job, "carol-id", _status("running", 2)) is None
    assert status_problem(job, "carol-id", _status("running", 0)) is None  # before fencing
    assert status_problem(job, "alice-id", _status("succeeded", 1)) == (
        "it came from a provider the job left"
    )
    assert status_problem(job, "carol-id", _status("succeeded", 1)) == (
        "it carries epoch 1, and the job's newest hop is epoch 2"
    )
    assert status_problem(job, "carol-id", _status("succeeded", 3)) == (
        "it carries epoch 3, and the job's newest hop is epoch 2"
    )


@pytest.mark.parametrize(("peer_id", "epoch"), [("alice-id", 1), ("carol-id", 1), ("carol-id", 7)])
def test_an_old_or_forged_end_report_is_refused_logged_and_never_applied(
    node: Node, peer_id: str, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        applied = record_status(node, "abcd0001", peer_id, _status("succeeded", epoch, "exited 0"))
    assert applied is False
    job = node.home.store.job(JobRole.SUBMITTED, "abcd0001")
    assert job is not None and (job.state, job.exit_code) == (JobState.RUNNING, None)
    assert "[job abcd0001] a status (succeeded) refused" in caplog.text


def test_the_newest_hops_end_is_applied(node: Node) -> None:
    assert record_status(node, "abcd0001", "carol-id", _status("succeeded", 2, "exited 0"))
    job = node.home.store.job(JobRole.SUBMITTED, "abcd0001")
    assert job is not None and (job.state, job.exit_code) == (JobState.SUCCEEDED, 0)
    assert job.finished_at is not None


def test_a_preempted_groups_job_is_left_to_its_keeper(node: Node) -> None:
    keeper = _Keeper()
    node.keeper = keeper  # type: ignore[assignment]
    preempted = _status("preempted", 2, "carol's owner paused sharing")
    assert record_status(node, "abcd0001", "carol-id", preempted) is False
    job = node.home.store.job(JobRole.SUBMITTED, "abcd0001")
    assert job is not None and job.state == JobState.RUNNING  # not ended: it moves
    assert job.message == "carol's owner paused sharing"
    assert keeper.poked == ["abcd0001"]
    # Without a keeper (an in-process client) nothing moves it: it ends preempted.
    node.keeper = None
    assert record_status(node, "abcd0001", "carol-id", preempted)
    ended = node.home.store.job(JobRole.SUBMITTED, "abcd0001")
    assert ended is not None and ended.state == JobState.PREEMPTED


def test_a_listing_shows_every_hop_and_where_the_job_runs_now() -> None:
    job = _moved_job()
    assert HopView.all_of(job) == [
        HopView("alice-pc", 2, "preempted", "alice-pc's owner paused sharing", 1),
        HopView("carol", 3, "running", "", 2),
    ]
    waiting = dataclasses.replace(job, peer_id="", state=JobState.QUEUED, message="moving: x")
    assert [h.peer for h in HopView.all_of(waiting)] == ["alice-pc"]
    assert WaitingJob.of(waiting) == WaitingJob("abcd0001", True, "moving: x", None)
    assert status_of(waiting).state == "queued" and status_of(waiting).epoch == 2


def test_a_cursor_names_the_hop_and_the_event() -> None:
    assert divmod(2 * HOP_SPAN + 17, HOP_SPAN) == (2, 17)
    assert HOP_SPAN > 17  # a first hop's cursors are its provider's own sequence numbers


def test_a_queued_or_moving_job_keeps_the_node_process(tmp_path: Path) -> None:
    made = Node(tmp_path / "home")
    made.init("bob-laptop")
    try:
        assert not _unfinished(made.home)
        queued = job_record(JobRole.SUBMITTED, "q0000001", JobState.QUEUED, created_at=1.0)
        made.home.store.add_job(dataclasses.replace(queued, peer_id="", peer_name=""))
        assert _unfinished(made.home)
        assert [j.job_id for j in made.home.store.kept_jobs()] == ["q0000001"]
        # A listing never asks a provider about it: none holds it.
        assert made.home.store.unconfirmed_submitted_jobs() == []
    finally:
        made.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"group": "lab", "max_moves": 11}, "--max-moves must be 0 to 10, got 11"),
        ({"group": "lab", "max_moves": -1}, "--max-moves must be 0 to 10, got -1"),
        ({"peer": "alice", "max_moves": 2}, "--max-moves (max_moves:) needs --group"),
    ],
)
def test_bad_max_moves_are_refused(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_spec(command=["true"], **flags)  # type: ignore[arg-type]
    assert message in info.value.message and "\n" not in info.value.message


def test_max_moves_defaults_to_three_for_a_group_and_none_for_a_peer() -> None:
    assert build_spec(command=["true"], group="lab").max_moves == 3
    assert build_spec(command=["true"], group="lab", max_moves=0).max_moves == 0
    assert build_spec(command=["true"], peer="alice").max_moves == 0


@pytest.mark.parametrize(
    ("given", "seconds"), [("10m", 600.0), ("0", 0.0), (90, 90.0), ("1h30m", 5400.0)]
)
def test_wait_takes_durations_and_seconds(given: float | str, seconds: float) -> None:
    assert queue_wait(given) == seconds


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("soon", "--wait 'soon' is not a duration: use one such as 30s, 10m or 2h"),
        ("-5s", "--wait '-5s' cannot be negative"),
        (float("nan"), "cannot be negative"),
    ],
)
def test_a_bad_wait_is_refused_in_one_line(given: float | str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        queue_wait(given)
    assert message in info.value.message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "invalid job_lease '0': it must be longer than 0; use a duration such as 30s"),
        ("-1s", "invalid job_lease '-1s': it must be longer than 0"),
        ("a while", "invalid job_lease 'a while': use a duration such as 30s, 2m or 1h"),
    ],
)
def test_a_bad_job_lease_is_refused(node: Node, value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        node.home.config.set("job_lease", value)
    assert message in info.value.message
    assert node.home.config.get("job_lease") == "60s"
    node.home.config.set("job_lease", "10s")
    assert node.home.config.get("job_lease") == "10s"
