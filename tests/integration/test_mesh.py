"""``gpumesh.Mesh`` against a real provider: a `gpumesh share` process, QUIC on
loopback, Docker running the offline busybox image.

Sync methods from a plain script and their async twins; a job's lines, its end
and its exit code; a failing and a cancelled job; copies both ways; a group's
live status; a sync call inside a running loop refused with the twin's name;
errors of the project's tree with their stable codes; and every example of
docs/python-api.md run as a script for the consumer's home. Every test runs in
both modes: through the home's real node process (``Mesh()`` starts it over
``control.sock``) and in-process (``Mesh(in_process=True)``: each test's
``gpumesh.Mesh``, and each example script's, is made to pass it).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpumesh
from gpumesh.client.views.jobs import JobResultView
from gpumesh.errors import (
    ConfigError,
    GPUMeshError,
    NotFoundError,
    NotInitializedError,
    PairingCodeError,
    UnknownPeerError,
)
from tests.integration.conftest import gpumesh as cli
from tests.integration.conftest import shared_pair

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "python-api.md"


class InProcess(gpumesh.Mesh):
    """``gpumesh.Mesh`` with the client layer in this process, whatever a caller asks."""

    def __init__(self, home: str | Path | None = None, *, in_process: bool | None = None) -> None:
        super().__init__(home, in_process=True)


IN_PROCESS = """\
import gpumesh


class InProcess(gpumesh.Mesh):
    def __init__(self, home=None, *, in_process=None):
        super().__init__(home, in_process=True)


gpumesh.Mesh = InProcess
"""
""":class:`InProcess` for a script: put first, every ``gpumesh.Mesh()`` after it is one."""


@pytest.fixture(params=["node", "in-process"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How ``gpumesh.Mesh()`` reaches the home: its node process, or in this process."""
    if request.param == "in-process":
        monkeypatch.setattr(gpumesh, "Mesh", InProcess)
    return str(request.param)


@pytest.fixture
def homes(tmp_path: Path, mode: str) -> Iterator[tuple[Path, Path]]:
    """alice-pc shares (a real `gpumesh share`); bob-laptop is paired with her both
    ways and has a group ``lab`` with her in it."""
    with shared_pair(tmp_path) as (alice, bob):
        assert cli(bob, "group", "create", "lab").returncode == 0
        assert cli(bob, "group", "add", "lab", "alice-pc").returncode == 0
        yield alice, bob
        if mode == "node":  # it went through bob's node process, which is still there
            from gpumesh.daemon.record import holder

            assert holder(bob) is not None


def test_a_script_runs_a_job_reads_its_lines_and_waits_for_its_exit_code(homes) -> None:
    _, bob = homes
    with gpumesh.Mesh(bob) as mesh:
        job = mesh.run("alice-pc", ["sh", "-c", "echo one; printf 'tw'; sleep 1; echo o; exit 3"])
        assert job.peer == "alice-pc" and not job.result.final
        # "tw" and "o" came apart: the line is whole all the same.
        assert list(job.logs(stderr=False)) == ["one", "two"]
        result = job.wait()
        assert isinstance(result, JobResultView)
        assert (result.state, result.exit_code, result.final) == ("failed", 3, True)
        # Output stays with the provider: read again from the start, stderr too.
        both = mesh.run("alice-pc", ["sh", "-c", "echo out; echo err >&2"], detach=False)
        assert both.result.state == "succeeded"
        assert sorted(both.logs()) == ["err", "out"]
        assert list(both.logs(stderr=False)) == ["out"]
        assert mesh.job(job.id[:6]).result.exit_code == 3
        listed = {entry.job_id: entry for entry in mesh.jobs()}
        assert (listed[job.id].state, listed[job.id].role) == ("failed", "submitted")


def test_the_async_twins_stream_lines_and_await_the_end(homes) -> None:
    _, bob = homes

    async def scenario() -> tuple[list[str], JobResultView, list[str]]:
        async with gpumesh.Mesh(bob) as mesh:
            job = await mesh.arun("alice-pc", "sh -c 'echo a; sleep 1; echo b'")
            lines = [line async for line in job.alogs()]
            result = await job
            peers = [peer.name for peer in await mesh.apeers()]
            return lines, result, peers

    lines, result, peers = asyncio.run(scenario())
    assert lines == ["a", "b"]
    assert (result.state, result.exit_code) == ("succeeded", 0)
    assert peers == ["alice-pc"]


def test_a_cancelled_job_says_so(homes, engine) -> None:
    _, bob = homes
    with gpumesh.Mesh(bob) as mesh:
        job = mesh.run("alice-pc", ["sh", "-c", "echo started; sleep 600"])
        for line in job.logs():  # left at the first line: the follow closes
            assert line == "started"
            break
        assert job.cancel().state == "cancelled"
        assert job.wait().state == "cancelled"
        assert mesh.job(job.id).result.state == "cancelled"


def test_cp_copies_up_and_down(homes, tmp_path: Path) -> None:
    _, bob = homes
    source = tmp_path / "weights.bin"
    source.write_bytes(os.urandom(300_000))
    back = tmp_path / "back.bin"
    with gpumesh.Mesh(bob) as mesh:
        up = mesh.cp(str(source), "alice-pc:/models/weights.bin")
        assert (up.direction, up.kind, up.size, up.remote) == (
            "upload",
            "file",
            300_000,
            "/models/weights.bin",
        )
        down = mesh.cp("alice-pc:/models/weights.bin", str(back))
        assert (down.direction, down.digest) == ("download", up.digest)
    assert back.read_bytes() == source.read_bytes()


def test_app_run_mounts_a_folder_copied_to_the_peer(homes, tmp_path: Path) -> None:
    """``mounts`` reaches the job in both modes, as ``app run --mount`` does."""
    _, bob = homes
    data = tmp_path / "data.txt"
    data.write_text("mounted\n")
    app = tmp_path / "app"
    app.mkdir()
    (app / "main.sh").write_text("cat /data/data.txt\n")
    with gpumesh.Mesh(bob) as mesh:
        mesh.cp(str(data), "alice-pc:/dataset/data.txt")
        run = mesh.app_run("alice-pc", app, ["sh", "main.sh"], mounts=["dataset:/data"])
        assert (run.job.state, run.job.exit_code) == ("succeeded", 0)
        assert list(mesh.job(run.job.job_id).logs(follow=False)) == ["mounted"]
        # Without the mount the file is not there: the mount is what put it there.
        bare = mesh.app_run("alice-pc", app, ["sh", "main.sh"])
        assert bare.job.state == "failed"


def test_group_status_asks_the_members(homes) -> None:
    _, bob = homes
    with gpumesh.Mesh(bob) as mesh:
        [lab] = mesh.groups()
        assert (lab.name, lab.member_count, lab.usable) == ("lab", 2, 1)
        # A probe has one second (PROBE_TIMEOUT): a provider's first answer after its
        # start can take longer on a loaded machine, so one job warms it up first,
        # and a few probes are allowed.
        assert mesh.run("alice-pc", ["true"]).wait().state == "succeeded"
        for _ in range(5):
            members = {m.name: m for m in mesh.group_status("lab")}
            if members["alice-pc"].reachable:
                break
        assert members["alice-pc"].reachable is True, members["alice-pc"].reach
        assert members["alice-pc"].state in ("idle", "busy")
        assert members["bob-laptop"].is_self and members["bob-laptop"].reachable is None
        offline = {m.name: m for m in mesh.group_status("lab", live=False)}
        assert offline["alice-pc"].reachable is None


def test_a_sync_call_inside_a_running_loop_is_refused_with_its_twin(homes) -> None:
    _, bob = homes

    async def scenario() -> list[str]:
        messages = []
        async with gpumesh.Mesh(bob) as mesh:
            with pytest.raises(ConfigError) as status:
                mesh.status()
            messages.append(str(status.value))
            with pytest.raises(ConfigError) as run:
                mesh.run("alice-pc", ["true"])
            messages.append(str(run.value))
            job = await mesh.arun("alice-pc", ["echo", "hi"])
            with pytest.raises(ConfigError) as logs:
                job.logs()  # refused at the call, not at the first line
            messages.append(str(logs.value))
            with pytest.raises(ConfigError) as wait:
                job.wait()
            messages.append(str(wait.value))
            # The Mesh is still whole: the twins work.
            assert [line async for line in job.alogs()] == ["hi"]
            assert (await mesh.astatus()).name == "bob-laptop"
        return messages

    messages = asyncio.run(scenario())
    for message, twin in zip(messages, ["astatus", "arun", "alogs", "await_"], strict=True):
        assert "running event loop" in message and f"{twin}(" in message
        assert "\n" not in message


def test_pair_takes_a_code_and_refuses_a_bad_one(homes) -> None:
    alice, bob = homes
    with gpumesh.Mesh(bob) as mesh:
        code = cli(alice, "pair-code").stdout.strip()
        view = mesh.pair(code, check=False)
        assert (view.name, view.allowed, view.paired_back) == ("alice-pc", True, None)
        with pytest.raises(PairingCodeError) as spent:
            mesh.pair(code, check=False)  # a code pairs once
        assert spent.value.code == "bad_code"
        with pytest.raises(PairingCodeError):
            mesh.pair("gpm1_not-a-code")
        assert [peer.name for peer in mesh.peers()] == ["alice-pc"]


def test_errors_are_the_projects_with_stable_codes(homes, tmp_path: Path) -> None:
    _, bob = homes
    with pytest.raises(NotInitializedError) as empty:
        gpumesh.Mesh(tmp_path / "no-home").status()
    assert empty.value.code == "not_initialized"
    with gpumesh.Mesh(bob) as mesh:
        with pytest.raises(UnknownPeerError) as unknown:
            mesh.run("nobody", ["true"])
        assert unknown.value.code == "unknown_peer"
        with pytest.raises(NotFoundError) as missing:
            mesh.job("ffffffffffff")
        assert missing.value.code == "not_found"
        with pytest.raises(ConfigError) as size:
            mesh.run("alice-pc", ["true"], gpu_memory="lots")
        assert size.value.code == "config"
        with pytest.raises(NotFoundError):
            mesh.group_status("nope")
        with pytest.raises(GPUMeshError) as where:
            mesh.cp("here.txt", "there.txt")
        assert where.value.code == "config"
    from gpumesh.client import mesh

    with pytest.raises(ConfigError) as only_here:
        mesh.Mesh(bob, in_process=False)  # the client layer's own: in-process only
    assert "gpumesh.Mesh" in str(only_here.value)


def _examples() -> list[str]:
    """The fenced ``python`` blocks of the doc (``python no-run`` ones are not run)."""
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), re.MULTILINE | re.DOTALL)


def test_the_python_api_docs_examples_run(homes, tmp_path: Path, mode: str) -> None:
    _, bob = homes
    examples = _examples()
    assert len(examples) >= 6
    folder = tmp_path / "work"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "train.sh").write_text(
        'for i in $(seq "${EPOCHS:-1}"); do echo "epoch $i"; done\n'
    )
    env = dict(os.environ, GPUMESH_HOME=str(bob))
    env.pop("GPUMESH_LOG", None)
    outputs = []
    for number, code in enumerate(examples, 1):
        script = folder / f"example{number}.py"
        script.write_text((IN_PROCESS if mode == "in-process" else "") + code)
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"example {number}:\n{code}\n{done.stdout}{done.stderr}"
        outputs.append(done.stdout)
    assert "epoch 1\nepoch 2\nsucceeded 0\n" in outputs[0]
    assert "failed 3" in outputs[1]
    assert "cancelled" in outputs[2]
    assert "alice-pc ['placed']" in outputs[4]
    assert "one\ntwo\nsucceeded 0\n" in outputs[5]
    assert "config status() cannot block" in outputs[5]
    assert outputs[6].startswith("1 succeeded True\nepoch 1\n")  # app_run, --out pulled
    assert "succeeded 0 True" in outputs[7]  # aapp_run


def test_a_detached_job_gets_its_whole_workdir(homes, tmp_path: Path) -> None:
    # A detached submit returns only once the provider holds the whole workdir:
    # closing the session sooner cut the upload off ("connection closed").
    _, bob = homes
    folder = tmp_path / "train"
    folder.mkdir()
    (folder / "data.bin").write_bytes(os.urandom(2_000_000))
    (folder / "train.sh").write_text("wc -c < data.bin\n")
    with gpumesh.Mesh(bob) as mesh:
        job = mesh.run("alice-pc", ["sh", "train.sh"], workdir=folder)
        assert [line.strip() for line in job.logs()] == ["2000000"]
        assert (job.wait().state, job.result.exit_code) == ("succeeded", 0)


def test_a_follow_outlives_its_node_process(tmp_path: Path, monkeypatch) -> None:
    """The node process killed in the middle of ``job.logs()``: the next one is
    started and the follow resumes after the last line it gave, none lost or doubled."""
    import signal

    from gpumesh.daemon.record import holder

    with shared_pair(tmp_path) as (_, bob), gpumesh.Mesh(bob) as mesh:
        script = "for i in 1 2 3 4 5 6; do echo line$i; sleep 0.5; done"
        job = mesh.run("alice-pc", ["sh", "-c", script])
        lines = job.logs()
        got = [next(lines)]
        first = holder(bob)
        assert first is not None and first.pid
        os.kill(first.pid, signal.SIGKILL)
        got += list(lines)
        assert got == [f"line{i}" for i in range(1, 7)]
        assert (job.wait().state, job.result.exit_code) == ("succeeded", 0)
        second = holder(bob)
        assert second is not None and second.pid != first.pid
