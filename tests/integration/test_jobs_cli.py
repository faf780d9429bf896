"""`gpumesh run`, `jobs`, `logs` and `cancel` as a user types them, against a real
`gpumesh share` process and the real Docker engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumesh.errors import ExitCode
from gpumesh.runtime.base import NO_GPU_RUNTIME_NOTE
from tests.integration.conftest import gpumesh, shared_pair
from tests.integration.test_cli import _free_udp_port, _init, _one_line_error

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")


def test_run_streams_apart_and_exits_with_the_jobs_code(pair) -> None:
    alice, bob = pair
    result = gpumesh(
        bob,
        "run",
        "--peer",
        "alice-pc",
        "--image",
        IMAGE,
        "sh",
        "-c",
        "echo out; echo err >&2; exit 4",
    )
    assert result.returncode == 4
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"  # nothing of gpumesh's own for a plain exit

    jobs = json.loads(gpumesh(bob, "jobs", "--json").stdout)
    assert [(j["role"], j["peer"], j["state"], j["exit_code"]) for j in jobs] == [
        ("submitted", "alice-pc", "failed", 4)
    ]
    hosted = json.loads(gpumesh(alice, "jobs", "--json").stdout)
    assert [(j["role"], j["peer"], j["exit_code"]) for j in hosted] == [("hosted", "bob-laptop", 4)]

    logs = gpumesh(bob, "logs")  # no id: the most recent job
    assert logs.returncode == 4
    assert logs.stdout == "out\n"
    assert "err\n" in logs.stderr
    assert "--- attempt 1 ---" in logs.stderr
    assert "--- failed, exit 4 ---" in logs.stderr
    local = gpumesh(alice, "logs", jobs[0]["job_id"][:6])  # the provider reads its own copy
    assert local.stdout == "out\n"


def test_job_file_with_flags_over_it(pair, tmp_path: Path) -> None:
    _alice, bob = pair
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.txt").write_text("from the workdir\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        f"image: {IMAGE}\n"
        "command: sh -c 'cat hello.txt; echo $WHO $MOOD'\n"
        "env:\n  WHO: file\n  MOOD: calm\n"
        "workdir: work\n"
        "peer: alice-pc\n"
    )
    result = gpumesh(bob, "run", "-f", str(job), "--env", "WHO=flag")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "from the workdir\nflag calm\n"


def test_detach_then_follow_then_cancel(pair) -> None:
    _alice, bob = pair
    started = gpumesh(
        bob, "run", "--peer", "alice-pc", "--detach", "--", "sh", "-c", "echo up; sleep 300"
    )
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()
    assert len(job_id) == 12
    deadline = time.monotonic() + 20
    while "up" not in gpumesh(bob, "logs", job_id).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    follower = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "logs", "-f", job_id],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    cancelled = gpumesh(bob, "cancel", job_id)  # the peer is known for our own jobs
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"Job {job_id} on alice-pc: cancelled" in cancelled.stdout
    out, err = follower.communicate(timeout=30)
    assert follower.returncode == 130
    assert out == "up\n"
    assert "--- cancelled" in err
    assert json.loads(gpumesh(bob, "jobs", "--json").stdout)[0]["state"] == "cancelled"
    _one_line_error(gpumesh(bob, "cancel", "--peer", "alice-pc", "ffffffffffff"), 2, "has no job")


def test_ctrl_c_without_a_terminal_cancels_the_remote_job(pair) -> None:
    alice, bob = pair
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpumesh",
            "run",
            "--peer",
            "alice-pc",
            "--",
            "sh",
            "-c",
            "echo go; sleep 300",
        ],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "go\n"
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "cancelled" in err
    assert "Traceback" not in err
    hosted = json.loads(gpumesh(alice, "jobs", "--json").stdout)
    assert hosted[0]["state"] == "cancelled"


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--gpu-memory", "lots", "true"], 2, "invalid size"),
        (["--env", "NOEQUALS", "true"], 2, "NOEQUALS"),
        (["--workdir", "/nonexistent/dir", "true"], 2, "does not exist"),
        (["--image", "no/such:image", "true"], ExitCode.RUNTIME, "not on alice-pc"),
        (["--gpu-memory", "8GB", "true"], 2, "alice-pc has no NVIDIA GPU"),
    ],
    ids=["memory-units", "env-syntax", "workdir", "image", "no-gpu"],
)
def test_bad_run_input_is_one_line_and_starts_nothing(pair, args, code, message) -> None:
    alice, bob = pair
    _one_line_error(gpumesh(bob, "run", "--peer", "alice-pc", *args), code, message)
    assert json.loads(gpumesh(alice, "jobs", "--json").stdout) == []


def test_invalid_job_file_names_field_and_line(pair, tmp_path: Path) -> None:
    _alice, bob = pair
    job = tmp_path / "job.yaml"
    job.write_text(f"image: {IMAGE}\ncommand: true\nretries: many\n")
    _one_line_error(gpumesh(bob, "run", "-f", str(job)), 2, "job.yaml:3: retries")


def test_prune_forgets_finished_jobs_and_their_logs(pair) -> None:
    alice, bob = pair
    assert gpumesh(bob, "run", "--peer", "alice-pc", "echo", "kept?").returncode == 0
    hosted = json.loads(gpumesh(alice, "jobs", "--json").stdout)
    workdirs = alice / "jobs"
    assert "Would remove 1" in gpumesh(alice, "prune", "--older-than", "0", "--dry-run").stdout
    assert len(json.loads(gpumesh(alice, "jobs", "--json").stdout)) == 1
    assert "Removed 1" in gpumesh(alice, "prune", "--older-than", "0").stdout
    assert json.loads(gpumesh(alice, "jobs", "--json").stdout) == []
    assert not (workdirs / hosted[0]["job_id"]).exists()
    _one_line_error(gpumesh(alice, "logs", hosted[0]["job_id"]), 2, "no job")
    assert "Removed 0" in gpumesh(bob, "prune").stdout  # 7 days by default


def test_denied_peer_cannot_run(pair) -> None:
    alice, bob = pair
    assert gpumesh(alice, "deny", "bob-laptop").returncode == 0
    _one_line_error(gpumesh(bob, "run", "--peer", "alice-pc", "true"), 3, "denied you access")


def test_run_on_a_group_places_the_job_and_says_why(pair, tmp_path: Path) -> None:
    alice, bob = pair
    carol = tmp_path / "c"  # paired with bob but not sharing: unreachable
    _init(carol, "carol", _free_udp_port())
    assert gpumesh(bob, "pair", gpumesh(carol, "pair-code").stdout.strip()).returncode == 0
    assert gpumesh(bob, "group", "create", "research").returncode == 0
    for member in ("alice-pc", "carol"):
        added = gpumesh(bob, "group", "add", "research", member)
        assert added.returncode == 0, added.stderr
    listed = {
        m["name"]: m
        for m in json.loads(gpumesh(bob, "group", "members", "research", "--json").stdout)
    }
    assert listed["alice-pc"]["reachable"] is True
    assert listed["alice-pc"]["gpus"] == "none"
    assert listed["alice-pc"]["state"] == "idle"
    assert listed["carol"]["reachable"] is False
    assert listed["bob-laptop"]["is_self"] is True
    table = gpumesh(bob, "group", "members", "research")
    assert "REACHABLE" in table.stdout and "unreachable" in table.stdout
    result = gpumesh(bob, "run", "--group", "research", "--explain", "--", "echo", "placed")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "placed\n"
    assert "placing on alice-pc: CPU only" in result.stderr
    assert "carol: skipped: unreachable" in result.stderr
    jobs = json.loads(gpumesh(bob, "jobs", "--json").stdout)
    assert jobs[0]["peer"] == "alice-pc"
    # Nothing fits: a clear refusal with every member's reason, nothing started.
    refused = gpumesh(bob, "run", "--group", "research", "--gpu-memory", "8GB", "--", "true")
    _one_line_error(refused, 2, "no member can take the job with 8GB of GPU memory")
    assert "alice-pc: no NVIDIA GPU" in refused.stderr
    assert len(json.loads(gpumesh(alice, "jobs", "--json").stdout)) == 1
    _one_line_error(gpumesh(bob, "run", "--group", "nope", "true"), 2, "nope")


def test_the_providers_owner_cancels_a_hosted_job_from_the_cli(pair) -> None:
    alice, bob = pair
    started = gpumesh(bob, "run", "--peer", "alice-pc", "--detach", "--retries", "2", "sleep", "60")
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip().split()[-1]
    cancelled = gpumesh(alice, "cancel", job_id[:6])
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.strip() == (
        f"Job {job_id} of bob-laptop: cancelled (cancelled by the provider's owner)"
    )
    hosted = json.loads(gpumesh(alice, "jobs", "--json").stdout)
    assert [(j["role"], j["state"]) for j in hosted] == [("hosted", "cancelled")]


def test_cancelling_a_hosted_job_without_a_running_share_is_one_line(pair) -> None:
    alice, bob = pair
    started = gpumesh(bob, "run", "--peer", "alice-pc", "--detach", "sleep", "60")
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip().split()[-1]
    assert gpumesh(alice, "share", "stop").returncode == 0  # its container keeps running
    result = gpumesh(alice, "cancel", job_id)
    _one_line_error(result, 1, "no `gpumesh share` runs for")
    assert "its cancel is recorded" in result.stderr


@pytest.fixture
def gpus_docker_cannot_give(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU (simulated: A100, 80GB) that this machine's Docker cannot give to
    containers, as on a GPU machine without NVIDIA's container toolkit."""
    import contextlib

    from gpumesh.runtime.docker import DockerRuntime

    with contextlib.closing(DockerRuntime()) as runtime:
        gives = runtime.gpu_runtime_available()  # the provider's own answer
    if gives:  # pragma: no cover
        pytest.skip("this machine's Docker can give GPUs to containers")
    monkeypatch.setenv("GPUMESH_TEST_SIMULATED_GPUS", "A100:80GB")


@pytest.mark.usefixtures("gpus_docker_cannot_give")
def test_a_provider_whose_docker_cannot_give_gpus_is_named(tmp_path: Path) -> None:
    """alice-pc reports a GPU (simulated) but its Docker has no NVIDIA runtime: the
    consumer's message names alice-pc, not "this machine" (which reads as its own)."""
    with shared_pair(tmp_path) as (_alice, bob):
        result = gpumesh(bob, "run", "--peer", "alice-pc", "--gpu-memory", "1GB", "--", "true")
    assert result.returncode != 0, result.stderr
    assert "alice-pc's Docker cannot give GPUs to containers" in result.stderr
    assert "this machine" not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.usefixtures("gpus_docker_cannot_give")
def test_a_cpu_job_runs_on_a_gpu_provider_whose_docker_cannot_give_gpus(tmp_path: Path) -> None:
    """Every job failed there (exit 125), CPU jobs too: each was given the GPUs."""
    with shared_pair(tmp_path) as (_alice, bob):
        for n in (1, 2):  # each made without GPUs (the provider found out at its start)
            result = gpumesh(bob, "run", "--peer", "alice-pc", "--", "echo", f"cpu-{n}")
            assert result.returncode == 0, result.stderr
            assert result.stdout == f"cpu-{n}\n"
        jobs = json.loads(gpumesh(bob, "jobs", "--json", "--offline").stdout)
        assert [job["state"] for job in jobs] == ["succeeded", "succeeded"]


@pytest.mark.usefixtures("gpus_docker_cannot_give")
def test_a_provider_that_found_its_docker_cannot_give_gpus_says_so_and_is_skipped_for_gpu_jobs(
    tmp_path: Path,
) -> None:
    # Simulated GPUs stand for a machine whose Docker gives them, so the provider
    # finds out with the first job's container (a real machine's share finds out
    # at its start). Then the owner is told, and placement skips it for GPU jobs.
    with shared_pair(tmp_path) as (alice, bob):
        assert gpumesh(bob, "group", "create", "lab").returncode == 0
        assert gpumesh(bob, "group", "add", "lab", "alice-pc").returncode == 0
        cpu_job = gpumesh(bob, "run", "--group", "lab", "--", "echo", "cpu")
        assert cpu_job.returncode == 0, cpu_job.stderr
        assert cpu_job.stdout == "cpu\n"
        from gpumesh.control.shareviews import ShareLine
        from gpumesh.daemon.client import NodeClient

        # What the share said, as its followers print it.
        path = "/api/v1/share/output?after=0&follow=false"
        stream = NodeClient(alice).events(path, {"line": ShareLine, "end": dict})
        said = [event.view.text for event in stream if isinstance(event.view, ShareLine)]
        assert f"  {NO_GPU_RUNTIME_NOTE}" in said
        gpu_job = gpumesh(bob, "run", "--group", "lab", "--gpu-memory", "1GB", "--", "true")
        assert gpu_job.returncode != 0
        assert "alice-pc: its Docker cannot give GPUs to containers" in gpu_job.stderr


def test_a_command_missing_from_the_image_is_said_in_our_words(pair) -> None:
    _alice, bob = pair
    result = gpumesh(bob, "run", "--peer", "alice-pc", "--", "nvidia-smi")
    assert result.returncode == 127
    assert f"gpumesh: nvidia-smi: not found in image {IMAGE} (exit 127)" in result.stderr
    assert "tini" not in result.stderr
