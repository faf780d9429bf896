"""`gpumesh app run` and `gpumesh.Mesh.app_run` through real node processes: bob's
home's node process syncs, runs and pulls on alice (a real `gpumesh share`
process, Docker running the offline busybox image). Its stream numbers the
job's events like the job's events route, survives the node process being
killed (the next one is started and the output resumes, nothing lost or
repeated), and holds no backlog of a reader that stopped reading: the
provider keeps the output (up to its job_log_limit) and the reader is told what
it lost. Nothing is mocked."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpumesh.client.views.apps import AppRunView
from gpumesh.client.views.jobs import Dropped, Output
from gpumesh.daemon.apprun import APP_RUN_EVENTS
from gpumesh.protocol.states import FINAL_STATES
from tests.integration.conftest import gpumesh, shared_pair
from tests.integration.node import CEILING, cli, node_env, status, wait_gone
from tests.integration.test_job_output import LINE, _numbered, _numbered_job

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")


def test_app_run_resumes_after_its_node_process_is_killed(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """The node process dies mid app run: the CLI starts another, resumes the job's
    output after the last line it printed, and still pulls --out back."""
    _alice, bob = pair
    work = tmp_path / "work"
    (work / "proj").mkdir(parents=True)
    (work / "proj" / "a.txt").write_text("alpha\n")
    script = (
        "for i in $(seq 1 30); do echo line-$i; sleep 0.3; done; "
        "mkdir -p renders && cp a.txt renders/a.txt; exit 4"
    )
    run = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "app", "run", "--peer", "alice-pc", "--dir", "proj",
         "--out", "renders", "--", "sh", "-c", script],
        env=node_env(bob),
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert run.stdout is not None
    lines = [run.stdout.readline() for _ in range(3)]
    first = status(bob)["node"]["pid"]
    os.kill(first, signal.SIGKILL)
    assert wait_gone(first)
    rest, err = run.communicate(timeout=180)
    assert run.returncode == 4, err  # the job's exit code, as without a kill
    assert "".join(lines) + rest == "".join(f"line-{i}\n" for i in range(1, 31))
    assert "synced /apps/proj on alice-pc: 1 sent" in err
    assert "pulled alice-pc:/apps/proj/renders -> renders" in err
    assert "Traceback" not in err
    assert (work / "renders" / "a.txt").read_text() == "alpha\n"
    assert status(bob)["node"]["pid"] != first  # a new node process carried the rest


def test_app_run_stream_is_numbered_and_a_reader_that_stops_reading_is_told_what_it_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader takes the sync's event, then nothing until the job ended: the node
    process holds no backlog for it beyond the link's flow-control window (alice
    keeps 1MB of the job's 24MB), and what it then reads is each byte in order or
    a `dropped` event saying how many went."""
    from gpumesh.daemon.client import connect

    # More than one QUIC stream's window (16 MiB) and alice's 1MB together: had
    # the job's output been read as fast as it was written (a loaded machine
    # slows the job), the window alone could hold 8MB and nothing would drop.
    lines = 24_000
    with contextlib.ExitStack() as stack:
        alice, bob = stack.enter_context(shared_pair(tmp_path, job_log_limit="1MB"))
        stack.callback(gpumesh, bob, "daemon", "stop")
        folder = tmp_path / "proj"
        folder.mkdir()
        (folder / "x.txt").write_text("x\n")
        body = {"peer": "alice-pc", "dir": str(folder), "command": _numbered_job(lines, 0)}
        # Started by a command, so this test process holds no child of its own.
        assert cli(bob, "jobs").returncode == 0
        events = connect(bob).events("/api/v1/apps/run", APP_RUN_EVENTS, "POST", body)
        stack.callback(events.close)
        first = next(events)
        assert first.event == "syncview", first.view
        deadline = time.monotonic() + 180
        while True:
            hosted = json.loads(gpumesh(alice, "jobs", "--json").stdout)
            if hosted and hosted[0]["state"] in FINAL_STATES:
                break
            assert time.monotonic() < deadline, hosted
            time.sleep(0.2)
        position, dropped, ids, kinds = 0, 0, [], []
        end = None
        for event in events:
            kinds.append(event.event)
            if event.id is not None:
                ids.append(event.id)
            if isinstance(event.view, Output):
                data = base64.b64decode(event.view.data)
                assert data == _numbered(position, len(data)), position
                position += len(data)
            elif isinstance(event.view, Dropped):
                dropped += event.view.count
                position += event.view.count
            elif isinstance(event.view, AppRunView):
                end = event.view
        assert end is not None, kinds
        assert end.job.state == "succeeded" and end.job.exit_code == 0
        assert position == lines * LINE
        assert dropped > 0  # not all of it waited in the node process for this reader
        assert ids == sorted(set(ids)) and ids  # numbered, each once, in order
        assert kinds.index("acceptedview") < kinds.index("output")


def test_mesh_app_run_goes_through_the_node_process(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """``Mesh().app_run`` and ``aapp_run`` are done by the node process (the script
    imports no QUIC), with local paths taken from the script's folder."""
    _alice, bob = pair
    work = tmp_path / "work"
    (work / "proj").mkdir(parents=True)
    (work / "proj" / "in.txt").write_text("data\n")
    check = textwrap.dedent(
        """
        import asyncio, sys
        import gpumesh

        command = ["sh", "-c", "mkdir -p out && wc -c < in.txt > out/n.txt && echo ran"]
        with gpumesh.Mesh() as mesh:
            run = mesh.app_run("alice-pc", "proj", command, out="out")
            print(run.sync.files_sent, run.job.state, run.job.exit_code, run.pulled,
                  run.out_remote)

        async def main() -> None:
            async with gpumesh.Mesh() as mesh:
                run = await mesh.aapp_run("alice-pc", "proj", "sh -c 'exit 2'", out="none")
                print(run.sync.files_sent, run.job.state, run.job.exit_code, run.pulled)

        asyncio.run(main())
        print("HEAVY", sorted(m for m in sys.modules if m.split(".")[0] in ("qh3", "docker")))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", check],
        cwd=work,
        env=node_env(bob),
        capture_output=True,
        text=True,
        timeout=CEILING * 3,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "1 succeeded 0 True /apps/proj/out",
        "0 failed 2 False",
        "HEAVY []",
    ]
    assert (work / "out" / "n.txt").read_text().strip() == "5"
    assert status(bob)["node"]["detached"]


def test_app_run_through_the_node_process_of_a_simulated_windows(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """As on Windows (no unix sockets, no flock): the node process locks the home
    with a byte lock and serves loopback TCP, and `app run` goes through it."""
    _alice, bob = pair
    # Pairing started bob's node process on this system's unix socket: the one
    # without unix sockets starts afresh.
    assert gpumesh(bob, "daemon", "stop").returncode == 0
    assert gpumesh(bob, "config", "set", "listen_host", "127.0.0.1").returncode == 0
    report = tmp_path / "platform-report"
    windows = {"GPUMESH_TEST_PLATFORM": "windows", "GPUMESH_TEST_PLATFORM_REPORT": str(report)}
    work = tmp_path / "work"
    (work / "proj").mkdir(parents=True)
    (work / "proj" / "a.txt").write_text("alpha\n")
    ran = subprocess.run(
        [sys.executable, "-m", "gpumesh", "app", "run", "--peer", "alice-pc", "--dir", "proj",
         "--", "cat", "a.txt"],
        env=node_env(bob, **windows),
        cwd=work,
        capture_output=True,
        text=True,
        timeout=CEILING * 3,
        check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "alpha\n"
    shown = subprocess.run(
        [sys.executable, "-m", "gpumesh", "daemon", "status", "--json"],
        env=node_env(bob, **windows),
        capture_output=True,
        text=True,
        timeout=CEILING,
        check=False,
    )
    node = json.loads(shown.stdout)["node"]
    assert node is not None and node["api"][0].startswith("http://127.0.0.1:"), shown.stderr
    assert not (bob / "control.sock").exists()
    lines = report.read_text().splitlines()
    assert any(line.endswith(" took fcntl") for line in lines)
    used = [line for line in lines if " used unix" in line or " used fcntl" in line]
    assert not used, used
    # A process of the real platform sees no flock held: the home's lock is the byte one.
    import fcntl

    fd = os.open(bob / "node.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert cli(bob, "daemon", "stop", **windows).returncode == 0
