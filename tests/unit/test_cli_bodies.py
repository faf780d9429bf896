"""What ``cp`` and ``exec`` send the node process: the one schema's structs
(gpumesh.client.bodies), from their flags. (run and app sync, whose head start
sends plain dicts that convert into them: test_cli_launch.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpumesh.cli import cp as cp_module
from gpumesh.cli import exec as exec_module
from gpumesh.client.bodies import CopyBody, ShellRequest


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
