"""The consumer's `gpumesh jobs` asks providers where unfinished jobs stand: a
detached job that ended while nobody followed it shows as ended, a provider that
does not answer leaves its last known state and "no answer since HH:MM", and
`--offline` asks nobody. Real
`gpumesh share` process, real Docker engine, the CLI as a user types it."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import gpumesh

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")


def _jobs(home: Path, *args: str) -> list[dict[str, Any]]:
    result = gpumesh(home, "jobs", "--json", *args)
    assert result.returncode == 0, result.stderr
    jobs: list[dict[str, Any]] = json.loads(result.stdout)
    return jobs


def _hosted_state(alice: Path, job_id: str, wanted: str) -> dict[str, Any]:
    """Poll the provider's own record (it never dials anyone) until ``wanted``."""
    deadline = time.monotonic() + 60
    while True:
        job = next(j for j in _jobs(alice, "--offline") if j["job_id"] == job_id)
        if job["state"] == wanted:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.2)


def _detach(bob: Path, *command: str) -> str:
    started = gpumesh(bob, "run", "--peer", "alice-pc", "--detach", "--", *command)
    assert started.returncode == 0, started.stderr
    return started.stdout.strip()


def test_jobs_shows_a_detached_job_that_ended_unfollowed(pair) -> None:
    alice, bob = pair
    job_id = _detach(bob, "sleep", "1")
    hosted = _hosted_state(alice, job_id, "succeeded")

    # Not asked: what bob recorded at submission, which is what it showed before.
    (stale,) = _jobs(bob, "--offline")
    assert stale["state"] == "queued"

    (fresh,) = _jobs(bob)
    assert (fresh["state"], fresh["exit_code"]) == ("succeeded", 0)
    assert fresh["unknown_since"] is None
    assert fresh["provider_forgot"] is False
    assert fresh["started_at"] == pytest.approx(hosted["started_at"])
    assert fresh["finished_at"] == pytest.approx(hosted["finished_at"])
    assert fresh["confirmed_at"] >= stale["confirmed_at"]

    # What was learned sticks, without asking again.
    status = json.loads(gpumesh(bob, "status", "--json").stdout)
    assert (status["jobs_submitted_running"], status["jobs_submitted_unknown"]) == (0, 0)
    (kept,) = _jobs(bob, "--offline")
    assert (kept["state"], kept["exit_code"]) == ("succeeded", 0)
    table = gpumesh(bob, "jobs")
    assert "succeeded" in table.stdout
    assert "no answer" not in table.stdout + table.stderr


def test_jobs_with_the_provider_stopped_says_unknown_since(pair) -> None:
    alice, bob = pair
    job_id = _detach(bob, "sleep", "300")
    _hosted_state(alice, job_id, "running")
    (running,) = _jobs(bob)
    assert running["state"] == "running"
    assert running["unknown_since"] is None
    stopped = gpumesh(alice, "share", "stop")
    assert stopped.returncode == 0, stopped.stderr

    # Bounded: the subprocess' own ceiling would fail this if the listing hung.
    (unknown,) = _jobs(bob)
    assert unknown["state"] == "running"  # the last state confirmed, not a guess
    assert unknown["unknown_since"] == pytest.approx(running["confirmed_at"])
    assert unknown["unknown_reason"]
    table = gpumesh(bob, "jobs", timeout=30)
    assert table.returncode == 0, table.stderr
    since = time.strftime("%H:%M", time.localtime(running["confirmed_at"]))
    assert f"running, no answer since {since}" in table.stdout
    assert "alice-pc's jobs show the state it last confirmed: " in table.stderr
    assert "Traceback" not in table.stderr

    status = gpumesh(bob, "status")
    assert f"1 submitted running (1 no answer since {since})" in status.stdout
    assert json.loads(gpumesh(bob, "status", "--json").stdout)["jobs_submitted_unknown"] == 1

    # Offline: nothing asked, so nothing found unknown.
    offline = gpumesh(bob, "jobs", "--offline")
    assert "running" in offline.stdout
    assert "no answer" not in offline.stdout + offline.stderr


def test_jobs_says_when_the_provider_no_longer_knows_a_job(pair) -> None:
    alice, bob = pair
    job_id = _detach(bob, "true")
    _hosted_state(alice, job_id, "succeeded")
    pruned = gpumesh(alice, "prune", "--older-than", "0")
    assert pruned.returncode == 0, pruned.stderr
    assert _jobs(alice, "--offline") == []

    (gone,) = _jobs(bob)
    assert gone["provider_forgot"] is True
    assert gone["state"] == "queued"  # not pretended to have ended one way or another
    table = gpumesh(bob, "jobs")
    assert "gone" in table.stdout
    assert f"alice-pc no longer knows job {job_id}" in table.stderr


def test_jobs_does_not_wait_for_a_provider_that_never_answers(pair) -> None:
    alice, bob = pair
    job_id = _detach(bob, "sleep", "300")
    _hosted_state(alice, job_id, "running")
    _host, port = json.loads(gpumesh(alice, "status", "--json").stdout)["listen"].rsplit(":", 1)
    assert gpumesh(alice, "share", "stop").returncode == 0
    # A patient dial setting does not make the listing patient.
    assert gpumesh(bob, "config", "set", "connect_timeout", "300").returncode == 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", int(port)))  # the provider's port, never answering
        result = gpumesh(bob, "jobs", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    (job,) = json.loads(result.stdout)
    assert job["state"] == "queued"  # as submitted: nobody has said otherwise
    assert job["unknown_since"] == pytest.approx(job["confirmed_at"])
    assert job["unknown_reason"] == "no answer within 3s"


def test_jobs_after_the_provider_denied_you_says_so(pair) -> None:
    alice, bob = pair
    job_id = _detach(bob, "sleep", "300")
    _hosted_state(alice, job_id, "running")
    (running,) = _jobs(bob)
    assert gpumesh(alice, "deny", "bob-laptop").returncode == 0

    # Refused, not unanswered: said so, and the job keeps its last known state.
    (refused,) = _jobs(bob)
    assert refused["state"] == "running"
    assert refused["unknown_since"] == pytest.approx(running["confirmed_at"])
    assert refused["unknown_reason"] == "alice-pc has denied you access"
    table = gpumesh(bob, "jobs")
    assert table.returncode == 0, table.stderr
    assert table.stderr == (
        "gpumesh: alice-pc's jobs show the state it last confirmed: "
        "alice-pc has denied you access\n"
    )
