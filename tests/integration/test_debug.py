"""`gpumesh debug` (a twin of an ended job's last attempt) and `gpumesh exec --job`
(a program in a running job's container), against a real `gpumesh share`
process and the real Docker engine, without a terminal (`-- CMD`)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from gpumesh.errors import ExitCode
from gpumesh.runtime.base import LABEL_JOB, LABEL_KIND, LABEL_NODE
from tests.integration.conftest import gpumesh, shared_pair, until
from tests.integration.test_cli import _one_line_error

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

# A failed job leaves a file in its workdir, one in its outputs folder and (with a
# writable root) one in its root file system.
_FAILS = (
    "echo in-workdir > /workspace/w.txt; echo in-outputs > $GPUMESH_OUTPUTS/o.txt; "
    "(echo in-root > /left.txt) 2>/dev/null; exit 3"
)
_READ_BACK = 'cat /workspace/w.txt "$GPUMESH_OUTPUTS/o.txt"; cat /left.txt 2>/dev/null; exit 5'


def _shell(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`gpumesh ARGS` (debug, exec) in a process of its own, stdin piped (empty)."""
    return subprocess.run(
        [sys.executable, "-m", "gpumesh", *args],
        env=dict(os.environ, GPUMESH_HOME=str(home)),
        input="",
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def _node_id(home: Path) -> str:
    return str(json.loads(gpumesh(home, "status", "--json").stdout)["node_id"])


def _containers(engine: docker.DockerClient, node_id: str) -> list[dict[str, str]]:
    found = engine.api.containers(all=True, filters={"label": f"{LABEL_NODE}={node_id}"})
    return [dict(summary.get("Labels") or {}) for summary in found]


def _images(engine: docker.DockerClient) -> set[str]:
    return {str(image["Id"]) for image in engine.api.images(all=True)}


def _failed_job(bob: Path, tmp_path: Path) -> str:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "input.txt").write_text("given\n")
    ran = gpumesh(
        bob, "run", "--peer", "alice-pc", "-d", "--workdir", str(work), "--outputs", "/out",
        "--outputs-to", str(tmp_path / "home"), "--", "sh", "-c", _FAILS, timeout=90,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    job_id = ran.stdout.strip()

    def ended() -> bool:
        listed = json.loads(gpumesh(bob, "jobs", "--json").stdout)
        return any(j["job_id"] == job_id and j["state"] == "failed" for j in listed)

    until(ended, "the job to fail", within=90)
    return job_id


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture(scope="module")
def rooted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """alice shares with writable job roots (job_root on), bob submits."""
    with shared_pair(tmp_path_factory.mktemp("debug"), job_root="on") as homes:
        yield homes


def test_a_twin_sees_what_the_failed_attempt_left_and_goes_with_its_shell(
    rooted: tuple[Path, Path], engine: docker.DockerClient, tmp_path: Path
) -> None:
    alice, bob = rooted
    job_id = _failed_job(bob, tmp_path)
    alice_id = _node_id(alice)
    # Its root was writable: its stopped container is kept until debug_ttl.
    assert [c.get(LABEL_JOB) for c in _containers(engine, alice_id)] == [job_id]
    images = _images(engine)

    got = _shell(bob, "debug", job_id[:8], "--", "sh", "-c", _READ_BACK)

    assert got.returncode == 5, got.stderr
    assert got.stdout == "in-workdir\nin-outputs\nin-root\n"
    assert f"job {job_id}, attempt 1, on alice-pc: it exited 3 at " in got.stderr
    # The twin is gone with its shell (and the throwaway image of the kept container);
    # the kept container stays for the next debug.
    until(
        lambda: [c.get(LABEL_KIND) for c in _containers(engine, alice_id)] == [None],
        "the twin to go",
    )
    until(lambda: _images(engine) == images, "the twin's image to go")
    # exec --job is for running jobs: one line, saying what to do.
    _one_line_error(_shell(bob, "exec", "--job", job_id, "--", "true"), 2, "has ended (failed)")


def test_exec_job_enters_the_running_job_and_debug_waits_for_its_end(
    rooted: tuple[Path, Path], engine: docker.DockerClient
) -> None:
    alice, bob = rooted
    ran = gpumesh(bob, "run", "--peer", "alice-pc", "-d", "--", "sleep", "127", timeout=90)
    assert ran.returncode == 0, ran.stderr
    job_id = ran.stdout.strip()

    def running() -> bool:
        listed = json.loads(gpumesh(bob, "jobs", "--json").stdout)
        return any(j["job_id"] == job_id and j["state"] == "running" for j in listed)

    until(running, "the job to run", within=90)
    try:
        seen = _shell(bob, "exec", "--job", job_id[:8], "--", "ps", "-o", "user,args")
        assert seen.returncode == 0, seen.stderr
        assert "sleep 127" in seen.stdout
        _one_line_error(_shell(bob, "debug", job_id, "--", "true"), 2, "is still running")
        # Only its submitter: alice hosts it, she did not submit it.
        _one_line_error(
            _shell(alice, "debug", job_id, "--", "true"), ExitCode.DENIED, "only its submitter"
        )
    finally:
        gpumesh(bob, "cancel", job_id)


def test_unknown_jobs_and_bad_debug_ttl_are_one_line(rooted: tuple[Path, Path]) -> None:
    _alice, bob = rooted
    _one_line_error(_shell(bob, "debug", "abcd0123", "--", "true"), 2, "no job 'abcd0123'")
    _one_line_error(_shell(bob, "exec", "--job", "abcd0123"), 2, "no job 'abcd0123'")
    _one_line_error(gpumesh(bob, "config", "set", "debug_ttl", "soon"), 2, "invalid debug_ttl")


def test_what_a_job_left_goes_at_its_debug_ttl(tmp_path: Path, engine: docker.DockerClient) -> None:
    with shared_pair(tmp_path, job_root="on", debug_ttl="2s") as (alice, bob):
        images = _images(engine)
        job_id = _failed_job(bob, tmp_path)
        alice_id = _node_id(alice)
        folder = alice / "files" / _node_id(bob) / "gpumesh-outputs" / job_id
        db = sqlite3.connect(f"file:{alice / 'gpumesh.db'}?mode=ro", uri=True)
        try:
            kept, ended = db.execute(
                "SELECT kept_until, finished_at FROM jobs WHERE job_id = ?", (job_id,)
            ).fetchone()
        finally:
            db.close()
        assert kept == 0 or kept == pytest.approx(ended + 2.0)  # 0: gone already

        def gone() -> bool:
            return (
                not _containers(engine, alice_id)
                and not (alice / "jobs" / job_id).exists()
                and not folder.exists()
            )

        until(gone, "the kept container, workdir and outputs to go", within=60)
        until(lambda: _images(engine) == images, "no image to be left")
        _one_line_error(_shell(bob, "debug", job_id, "--", "true"), 2, "ended too long ago")
