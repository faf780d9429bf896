"""What the CLI's light commands send the node process converts into the one
schema's structs (gpumesh.client.bodies), field for field. They send plain dicts
so that msgspec stays off their way (see test_cli_lazy.py); these tests are what
keeps those dicts to the schema. (run and app sync: test_cli_launch.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpumesh.cli import cp as cp_module
from gpumesh.cli import exec as exec_module
from gpumesh.client.bodies import CopyBody, ShellRequest


def test_cp_sends_a_copy_body(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sent: list[dict[str, object]] = []

    def through_node(body: dict[str, object], view: Any) -> dict[str, Any]:
        sent.append(body)
        return {}

    monkeypatch.setattr(cp_module, "_through_node", through_node)
    monkeypatch.chdir(tmp_path)
    args = ["data.bin", "alice:/in/", "--retries", "4", "--no-fast-path", "-q"]
    cp_module.cp.main(args=args, prog_name="gpumesh cp", standalone_mode=False)
    (body,) = sent
    copy = msgspec.convert(body, CopyBody)  # no field of its own, none missing
    assert (copy.source, copy.destination, copy.cwd) == ("data.bin", "alice:/in/", str(tmp_path))
    assert (copy.retries, copy.fast_path) == (4, False)


def test_exec_sends_a_shell_request(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[dict[str, object]] = []

    async def through_node(request: dict[str, object], raw: object) -> int:
        sent.append(request)
        return 0

    monkeypatch.setattr(exec_module, "_through_node", through_node)
    args = ["--image", "img:1", "-e", "A=1", "--gpu-memory", "1GB", "alice", "--", "ls", "-l"]
    with pytest.raises(SystemExit) as ended:
        exec_module.exec.main(args=args, prog_name="gpumesh exec", standalone_mode=False)
    assert ended.value.code == 0
    (body,) = sent
    shell = msgspec.convert(body, ShellRequest)
    assert (shell.peer, shell.command, shell.image, shell.env) == (
        "alice",
        ["ls", "-l"],
        "img:1",
        {"A": "1"},
    )
    assert shell.gpu_memory == 1_000_000_000
