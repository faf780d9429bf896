"""The owner comes first: `gpumesh pause` and `resume` on a real `gpumesh share`
process and the real Docker engine, the submitter a real node on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumesh.errors import ExitCode
from tests.integration.conftest import gpumesh, until
from tests.integration.test_cli import _one_line_error

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

_CEILING = 60.0

# Saves its work on SIGTERM (a checkpoint written, then renamed into its outputs; a
# line; exit 0), as a checkpointing job would.
_TRAPS_TERM = (
    "trap 'echo step-7 > $GPUMESH_OUTPUTS/ckpt.tmp && mv $GPUMESH_OUTPUTS/ckpt.tmp "
    "$GPUMESH_OUTPUTS/ckpt; echo saved-at-term; exit 0' TERM; sh train.sh; "
    "while true; do sleep 0.2; done"
)


def _wait_for(home: Path, job_id: str, text: str) -> None:
    deadline = time.monotonic() + _CEILING
    while text not in gpumesh(home, "logs", job_id).stdout:
        assert time.monotonic() < deadline, f"{text!r} never came"
        time.sleep(0.2)


def _job(home: Path, job_id: str) -> dict[str, object]:
    listed = json.loads(gpumesh(home, "jobs", "--json").stdout)
    return next(j for j in listed if j["job_id"] == job_id)


def test_pause_preempts_a_job_within_its_grace_refuses_work_until_resume_and_outlives_a_restart(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    alice, bob = pair
    home_dir = tmp_path / "outputs"
    workdir = tmp_path / "train"
    workdir.mkdir()
    (workdir / "train.sh").write_text("echo up\n")
    started = gpumesh(
        bob,
        "run",
        "--peer",
        "alice-pc",
        "--detach",
        "--workdir",  # its outputs inside it, at /workspace/out, as most jobs have them
        str(workdir),
        "--outputs",
        "/workspace/out",
        "--outputs-to",
        str(home_dir),
        "--",
        "sh",
        "-c",
        _TRAPS_TERM,
    )
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip().split()[-1]
    _wait_for(bob, job_id, "up")
    shell = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "exec", "alice-pc", "sh", "-c", "echo in; sleep 60"],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert shell.stdout is not None and shell.stdout.readline() == "in\n"
        paused = gpumesh(alice, "pause", "--grace", "5s", timeout=90)
        _, shell_err = shell.communicate(timeout=_CEILING)
    finally:
        shell.kill()
    assert paused.returncode == 0, paused.stderr
    assert paused.stdout.strip() == (
        "Paused: 1 guest job preempted, 1 session(s) ended. "
        "Peers get nothing until `gpumesh resume`."
    )
    assert shell.returncode == ExitCode.DENIED
    assert "alice-pc's owner ended your shell" in shell_err
    # Returned once the guest was stopped: ended on the provider, told the submitter.
    hosted = _job(alice, job_id)
    assert (hosted["state"], hosted["message"]) == ("preempted", "alice-pc's owner paused sharing")
    submitted = _job(bob, job_id)
    assert submitted["state"] == "preempted"
    assert submitted["message"] == "alice-pc's owner paused sharing"
    # It had its grace: the trap ran and said so before the container went, and the
    # checkpoint it saved came home.
    assert "saved-at-term" in gpumesh(bob, "logs", job_id).stdout
    until((home_dir / "ckpt").is_file, "the checkpoint to come home", within=_CEILING)
    assert (home_dir / "ckpt").read_text() == "step-7\n"
    follow = gpumesh(bob, "logs", "-f", job_id)
    assert follow.returncode == ExitCode.PREEMPTED
    assert "--- preempted, exit 0: alice-pc's owner paused sharing ---" in follow.stderr

    refused = gpumesh(bob, "run", "--peer", "alice-pc", "--", "true")
    _one_line_error(refused, ExitCode.USAGE, "alice-pc is paused by its owner")
    _one_line_error(gpumesh(bob, "exec", "alice-pc", "true"), ExitCode.USAGE, "takes no shells")
    status = json.loads(gpumesh(alice, "status", "--json").stdout)
    assert status["state"] == "paused" and status["paused_since"] is not None
    assert "Paused   since" in gpumesh(alice, "status").stdout
    again = gpumesh(alice, "pause", "--grace", "1s")
    assert again.returncode == 0 and again.stdout.startswith("Already paused: 0 guest jobs")

    # A new node process, a new share: still the owner's.
    assert gpumesh(alice, "daemon", "stop").returncode == 0
    assert json.loads(gpumesh(alice, "status", "--json").stdout)["state"] == "paused"
    shared = gpumesh(alice, "share", "--detach", timeout=60)
    assert shared.returncode == 0, shared.stderr
    assert "Paused by the owner since" in shared.stdout + shared.stderr
    refused = gpumesh(bob, "run", "--peer", "alice-pc", "--", "true")
    _one_line_error(refused, ExitCode.USAGE, "alice-pc is paused by its owner")

    resumed = gpumesh(alice, "resume")
    assert (resumed.returncode, resumed.stdout) == (
        0,
        "Resumed: peers may use this machine again.\n",
    )
    ran = gpumesh(bob, "run", "--peer", "alice-pc", "--", "echo", "mine-again")
    assert (ran.returncode, ran.stdout) == (0, "mine-again\n"), ran.stderr
    not_paused = gpumesh(alice, "resume", "--json")
    assert not_paused.returncode == 0
    assert json.loads(not_paused.stdout)["changed"] is False
    assert gpumesh(alice, "resume").stdout == "Not paused: peers may use this machine already.\n"


def test_pause_refuses_bad_input_and_a_node_that_does_not_share(
    pair: tuple[Path, Path],
) -> None:
    alice, bob = pair
    for grace in ("soon", "-5s"):
        result = gpumesh(alice, "pause", "--grace", grace)
        assert result.returncode == ExitCode.USAGE, result.stderr
        assert "invalid duration" in result.stderr or "invalid grace" in result.stderr
        assert "Traceback" not in result.stderr
    _one_line_error(
        gpumesh(alice, "pause", "--grace", "3d"), ExitCode.USAGE, "invalid grace 259200s"
    )
    # bob only consumes: nobody uses his machine.
    _one_line_error(gpumesh(bob, "pause"), ExitCode.USAGE, "this node does not share")
    assert json.loads(gpumesh(alice, "status", "--json").stdout)["state"] != "paused"
