"""What `gpumesh.Mesh` sends the node process: the request structs of
gpumesh.client.bodies, each as the API decodes it (no node process here: the
backend's call is replaced by one that decodes the body the way the route does)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpumesh.client import bodies
from gpumesh.client.jobspec import JobSpec, MountSpec
from gpumesh.daemon.client import _payload
from gpumesh.daemon.mesh import ThroughNode


class Stop(Exception):
    """Raised where the answer would be read: only the request is looked at."""


def _sent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, call: Any) -> tuple[str, Any]:
    """(path, body as the route decodes it) of the one request ``call`` makes."""
    backend = ThroughNode(tmp_path)
    sent: list[tuple[str, str, object]] = []

    async def get(kind: Any, method: str, path: str, body: object = None) -> Any:
        sent.append((method, path, body))
        raise Stop

    monkeypatch.setattr(backend, "_get", get)
    with pytest.raises(Stop):
        asyncio.run(call(backend))
    ((method, path, body),) = sent
    assert method == "POST"
    return path, body


def _decoded(body: object, kind: type[msgspec.Struct]) -> Any:
    assert isinstance(body, kind)
    return msgspec.json.decode(_payload(body), type=kind)  # what the route gets


SPEC = JobSpec(
    image="img:1",
    command=["python", "train.py"],
    env={"A": "1"},
    workdir=None,
    gpu_memory=8_000_000_000,
    retries=2,
    timeout=60.0,
    peer="alice",
    group=None,
    mounts=[MountSpec("/data", "/in"), MountSpec("/out", "/out", rw=True)],
)


def test_a_run_sends_the_job_body_with_its_mounts_as_flags_give_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path, body = _sent(monkeypatch, tmp_path, lambda b: b.run(SPEC, detach=True))
    job = _decoded(body, bodies.JobBody)
    assert path == "/api/v1/jobs"
    assert (job.peer, job.image, job.command, job.env) == (
        "alice",
        "img:1",
        SPEC.command,
        {"A": "1"},
    )
    assert (job.gpu_memory, job.retries, job.timeout) == (8_000_000_000, 2, 60.0)
    assert job.mounts == ["/data:/in", "/out:/out:rw"]


def test_a_copy_carries_its_retries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path, body = _sent(
        monkeypatch, tmp_path, lambda b: b.cp(str(tmp_path / "f"), "alice:/f", retries=7)
    )
    copy = _decoded(body, bodies.CopyBody)
    assert path == "/api/v1/copies"
    assert (copy.source, copy.destination, copy.retries) == (str(tmp_path / "f"), "alice:/f", 7)


def test_a_pair_without_the_check_is_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path, body = _sent(monkeypatch, tmp_path, lambda b: b.pair("CODE", rekey=True, check=False))
    pair = _decoded(body, bodies.PairBody)
    assert path == "/api/v1/peers/pair"
    assert (pair.code, pair.rekey, pair.offline) == ("CODE", True, True)


def test_a_body_with_a_field_of_no_struct_is_refused_naming_it() -> None:
    with pytest.raises(msgspec.ValidationError, match="comand"):
        msgspec.json.decode(b'{"peer": "alice", "comand": ["x"]}', type=bodies.JobBody)


def test_a_group_run_sends_its_wait_max_moves_and_outputs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from gpumesh import Mesh

    monkeypatch.chdir(tmp_path)
    mesh = Mesh(tmp_path / "home")
    sent: list[tuple[Any, float]] = []

    async def run(spec: Any, *, detach: bool, wait: float = 0) -> Any:
        sent.append((spec, wait))
        raise Stop

    monkeypatch.setattr(mesh._backend, "run", run)
    with pytest.raises(Stop):
        asyncio.run(
            mesh.arun(None, "./train.sh", group="lab", outputs="/out", wait="30m", max_moves=5)
        )
    ((spec, wait),) = sent
    assert (spec.group, spec.max_moves, spec.outputs, wait) == ("lab", 5, "/out", 1800.0)
    assert spec.outputs_under == tmp_path / "gpumesh-outputs"  # this process's folder
    path, body = _sent(monkeypatch, tmp_path, lambda b: b.run(spec, detach=True, wait=wait))
    assert path == "/api/v1/jobs"
    job = _decoded(body, bodies.JobBody)
    assert (job.group, job.max_moves, job.wait, job.outputs) == ("lab", 5, 1800.0, "/out")
    assert job.outputs_under == str(tmp_path / "gpumesh-outputs")
