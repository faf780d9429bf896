"""The fast tier's end-to-end slice (``scripts/test.sh --fast``): one real pair,
alice sharing (a ``gpumesh share`` process) and bob using her, every command of
bob's through his node process as users run them. One ``run`` and its ``logs
-f``, one ``cp`` over the data channel, ``--json`` shapes checked against the
recorded ones, one dashboard page. The full suite covers each far more closely;
these are the ones worth their seconds while working."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import end_node_processes, require_docker
from tests.integration.conftest import shared_pair
from tests.integration.node import cli, status, wait_gone
from tests.integration.test_control_api import _free_tcp_port
from tests.integration.test_json_shapes import FIXTURE, differences, shape_of

pytestmark = [pytest.mark.smoke, pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")]


@pytest.fixture(scope="module")
def homes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """alice sharing and bob paired both ways, for the whole module."""
    require_docker()
    root = tmp_path_factory.mktemp("smoke")
    try:
        with shared_pair(root) as pair:
            yield pair
    finally:
        end_node_processes(root)


def _recorded(case: str) -> Any:
    return json.loads(FIXTURE.read_text())[case]["shape"]


def test_run_then_follow_its_logs_through_the_node_process(homes: tuple[Path, Path]) -> None:
    _alice, bob = homes
    script = "for i in 1 2 3; do echo line-$i; sleep 0.2; done; echo done >&2; exit 4"
    started = cli(bob, "run", "--peer", "alice-pc", "-d", "--", "sh", "-c", script)
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()
    follow = cli(bob, "logs", "-f", job_id)
    assert follow.stdout == "line-1\nline-2\nline-3\n"
    assert "done" in follow.stderr and follow.returncode == 4, follow.stderr
    assert status(bob)["node"]["detached"]  # bob's node process carried both commands
    listed = cli(bob, "jobs", "--json")
    assert listed.returncode == 0, listed.stderr
    jobs = json.loads(listed.stdout)
    assert [(j["job_id"], j["state"], j["exit_code"]) for j in jobs] == [(job_id, "failed", 4)]
    recorded = _recorded("jobs_submitted")
    assert shape_of(jobs)[0] in recorded, differences("jobs", recorded[0], shape_of(jobs)[0])


def test_cp_goes_over_the_data_channel_both_ways(homes: tuple[Path, Path], tmp_path: Path) -> None:
    _alice, bob = homes
    data = secrets.token_bytes(3 * 1024 * 1024 + 17)
    (tmp_path / "one.bin").write_bytes(data)
    up = cli(bob, "cp", str(tmp_path / "one.bin"), "alice-pc:/smoke/one.bin", "--json")
    assert up.returncode == 0, up.stderr
    sent = json.loads(up.stdout)
    assert sent["channel"] == "tls" and sent["size"] == len(data), sent
    assert not differences("cp", _recorded("cp_upload_file"), shape_of(sent))
    down = cli(bob, "cp", "-q", "alice-pc:/smoke/one.bin", str(tmp_path / "back.bin"))
    assert down.returncode == 0, down.stderr
    assert (tmp_path / "back.bin").read_bytes() == data


def test_the_dashboard_serves_a_signed_in_page(homes: tuple[Path, Path]) -> None:
    _alice, bob = homes
    port = _free_tcp_port()
    shown = cli(bob, "dashboard", GPUMESH_API_ADDR=f"127.0.0.1:{port}")
    assert shown.returncode == 0, shown.stderr
    origin, _, code = shown.stdout.strip().partition("/#code=")
    host = origin.removeprefix("http://")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"host": host}) as browser:
        assert browser.post("/api/v1/auth/session", json={"code": code}).status_code == 204
        page = browser.get("/")
        assert page.status_code == 200
        assert "<dd>bob-laptop</dd>" in page.text and "<dd>1 paired, 1 allowed</dd>" in page.text
    pid = status(bob)["node"]["pid"]
    assert cli(bob, "daemon", "stop").returncode == 0  # the dashboard kept it; the next test
    assert wait_gone(pid)  # (or command) starts another
