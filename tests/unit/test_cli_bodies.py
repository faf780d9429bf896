"""What ``cp``, ``exec``, ``run`` and ``app sync`` send the node process: the one
schema's structs (gpumesh.client.bodies), from their flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpumesh.cli import app as app_module
from gpumesh.cli import cp as cp_module
from gpumesh.cli import exec as exec_module
from gpumesh.cli import run as run_module
from gpumesh.client.bodies import CopyBody, JobBody, ShellRequest, SyncBody
from gpumesh.errors import GPUMeshError


def test_cp_sends_a_copy_body(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sent: list[CopyBody] = []

    def through_node(body: CopyBody, view: Any) -> None:
        sent.append(body)

    monkeypatch.setattr(cp_module, "_through_node", through_node)
    monkeypatch.chdir(tmp_path)
    args = ["data.bin", "alice:/in/", "--retries", "4", "--no-fast-path", "-q"]
    cp_module.cp.main(args=args, prog_name="gpumesh cp", standalone_mode=False)
    (copy,) = sent
    assert (copy.source, copy.destination, copy.cwd) == ("data.bin", "alice:/in/", str(tmp_path))
    assert (copy.retries, copy.fast_path) == (4, False)


def test_exec_sends_a_shell_request(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[ShellRequest] = []

    async def through_node(request: ShellRequest, raw: object) -> int:
        sent.append(request)
        return 0

    monkeypatch.setattr(exec_module, "_through_node", through_node)
    args = ["--image", "img:1", "-e", "A=1", "--gpu-memory", "1GB", "alice", "--", "ls", "-l"]
    with pytest.raises(SystemExit) as ended:
        exec_module.exec.main(args=args, prog_name="gpumesh exec", standalone_mode=False)
    assert ended.value.code == 0
    (shell,) = sent
    assert (shell.peer, shell.command, shell.image, shell.env) == (
        "alice",
        ["ls", "-l"],
        "img:1",
        {"A": "1"},
    )
    assert shell.gpu_memory == 1_000_000_000


def _run_body(args: list[str], monkeypatch: pytest.MonkeyPatch) -> JobBody:
    """What ``gpumesh run ARGS`` sends (its sending replaced), as the one struct."""
    sent: list[JobBody] = []

    def through_node(body: JobBody, **flags: bool) -> None:
        sent.append(body)

    monkeypatch.setattr(run_module, "_through_node", through_node)
    run_module.run.main(args=args, prog_name="gpumesh run", standalone_mode=False)
    (body,) = sent
    assert isinstance(body, JobBody)
    return body


@pytest.mark.parametrize(
    ("args", "fields"),
    [
        (["--peer", "alice", "echo", "hi"], {"command": ["echo", "hi"], "image": None}),
        (["--peer=alice", "--image=img:1", "--", "sh", "-c", "exit 3"],
         {"command": ["sh", "-c", "exit 3"], "image": "img:1"}),
        (["--peer", "alice", "-e", "A=1", "--retries", "2", "--timeout", "90s", "true"],
         {"env": {"A": "1"}, "retries": 2, "timeout": "90s"}),
        (["--peer", "alice", "--gpu-memory", "8GB", "--mount", "data:/data", "true"],
         {"gpu_memory": "8GB", "mounts": ["data:/data"]}),
        (["--peer", "alice", "--wait", "10m", "true"], {"wait": "10m", "max_moves": None}),
    ],
)  # fmt: skip
def test_run_sends_a_job_body(
    args: list[str], fields: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("GPUMESH_IMAGE", "GPUMESH_PEER"):
        monkeypatch.delenv(name, raising=False)
    body = _run_body(args, monkeypatch)
    assert (body.peer, body.group, body.workdir) == ("alice", None, None)
    for name, value in fields.items():
        assert getattr(body, name) == value, name


def test_run_with_a_workdir_sends_it_absolute_and_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "proj")
    monkeypatch.chdir(tmp_path)
    for given in ("proj", "./proj/", "proj/../proj//", "link"):
        body = _run_body(["--peer", "alice", "--workdir", given, "true"], monkeypatch)
        assert (body.workdir, body.command) == (str(tmp_path / "proj"), ["true"])


@pytest.mark.parametrize(
    ("workdir", "message"),
    [
        ("data.bin", "is not a folder: give the folder to upload"),
        ("missing", "does not exist: give an existing folder to upload"),
    ],
)
def test_run_refuses_a_workdir_that_is_no_folder_before_sending(
    workdir: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data.bin").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GPUMeshError) as raised:
        _run_body(["--peer", "alice", "--workdir", workdir, "true"], monkeypatch)
    assert raised.value.message == f"--workdir {workdir} {message}"


@pytest.mark.parametrize("flags", [[], ["--dry-run"], ["--json"]])
def test_app_sync_sends_a_sync_body(
    flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[str, str, object]] = []

    class Recorder:
        def send(self, method: str, path: str, body: object) -> Any:
            sent.append((method, path, body))
            raise _Sent

    class _Sent(Exception):
        pass

    (tmp_path / "proj").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(app_module, "node_client", Recorder)
    with pytest.raises(_Sent):
        args = ["--peer", "alice", "--dir", "./proj/", *flags]
        app_module.sync.main(args=args, prog_name="gpumesh app sync", standalone_mode=False)
    ((method, path, body),) = sent
    assert (method, path) == ("POST", "/api/v1/apps/sync")
    assert isinstance(body, SyncBody)
    sync = body
    assert (sync.peer, sync.dir, sync.dry_run) == (
        "alice",
        str(tmp_path / "proj"),
        flags == ["--dry-run"],
    )


def test_run_sends_a_job_files_max_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("command: [true]\ngroup: lab\nmax_moves: 5\noutputs: /out\n")
    monkeypatch.chdir(tmp_path)
    body = _run_body(["-f", str(job), "--wait", "10m"], monkeypatch)
    assert (body.group, body.max_moves, body.wait, body.outputs) == ("lab", 5, "10m", "/out")
    assert body.outputs_under == str(tmp_path / "gpumesh-outputs")
