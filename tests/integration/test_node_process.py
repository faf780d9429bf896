"""The node process for real: started in the background by a command, one per
home, stopped, replaced after a crash or a version change, gone when idle or
when its home is. Every process here is a real one over the home's real unix
socket; nothing is mocked."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.node import CEILING, alive, cli, node_env, spawn, status, wait_gone

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

CONTROL = str(Path(sys.executable).parent / "gpumesh-control")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    result = cli(path, "init", "--name", "node-test")
    assert result.returncode == 0, result.stderr
    return path


def test_a_command_starts_one_node_process_that_status_shows_and_stop_ends(home: Path) -> None:
    assert status(home) == {"running": False, "node": None}
    first = cli(home, "jobs")
    assert first.returncode == 0, first.stderr
    assert "No jobs yet" in first.stdout
    node = status(home)["node"]
    pid = node["pid"]
    assert alive(pid) and node["detached"] and not node["sharing"]
    assert node["api"] == [str(home / "control.sock")]
    assert stat.S_IMODE((home / "control.sock").stat().st_mode) == 0o600
    # A second command uses the same process.
    assert cli(home, "jobs", "--json").stdout.strip() == "[]"
    assert status(home)["node"]["pid"] == pid
    text = cli(home, "daemon", "status").stdout
    assert f"pid       {pid} (background" in text and "sharing   no" in text

    stopped = cli(home, "daemon", "stop")
    assert stopped.returncode == 0
    assert f"pid {pid}" in stopped.stdout
    assert wait_gone(pid)
    assert status(home)["running"] is False
    assert not (home / "control.sock").exists() and not (home / "node.json").exists()
    assert "No node process runs" in cli(home, "daemon", "stop").stdout


def test_a_second_node_process_for_the_home_names_the_first(home: Path) -> None:
    assert cli(home, "jobs").returncode == 0
    pid = status(home)["node"]["pid"]
    second = subprocess.run(
        [sys.executable, "-m", "gpumesh.daemon", "--detached"],
        env=node_env(home),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert second.returncode != 0
    assert f"a node process (pid {pid}) already serves {home}" in second.stderr
    assert "Traceback" not in second.stderr
    assert status(home)["node"]["pid"] == pid  # the first one is untouched


def test_a_killed_node_process_is_replaced_by_the_next_command(home: Path) -> None:
    assert cli(home, "jobs").returncode == 0
    pid = status(home)["node"]["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid)
    again = cli(home, "jobs", "--json")
    assert again.returncode == 0, again.stderr
    new = status(home)["node"]["pid"]
    assert new != pid and alive(new)


def test_an_idle_background_node_process_exits(home: Path) -> None:
    assert cli(home, "jobs", GPUMESH_NODE_IDLE="1").returncode == 0
    pid = status(home)["node"]["pid"]
    assert wait_gone(pid)
    assert status(home)["running"] is False


def test_a_node_process_exits_when_its_home_is_removed(home: Path, tmp_path: Path) -> None:
    assert cli(home, "jobs").returncode == 0
    pid = status(home)["node"]["pid"]
    moved = tmp_path / "moved-away"
    home.rename(moved)  # as a test's temporary home is removed
    assert wait_gone(pid)


def test_a_background_node_process_of_another_version_is_restarted(home: Path) -> None:
    old = subprocess.Popen(
        [sys.executable, "-m", "gpumesh.daemon", "--detached"],
        env=node_env(home, GPUMESH_TEST_NODE_VERSION="0.0.1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_answering(home)
        assert status(home)["node"]["version"] == "0.0.1"
        result = cli(home, "jobs", "--json")
        assert result.returncode == 0, result.stderr
        assert old.wait(timeout=60) == 0
        node = status(home)["node"]
        assert node["version"] != "0.0.1" and node["pid"] != old.pid
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()


def test_a_foreground_node_process_of_another_version_is_named_not_stopped(home: Path) -> None:
    control = subprocess.Popen(
        [CONTROL, "--no-tcp"],
        env=node_env(home, GPUMESH_TEST_NODE_VERSION="0.0.1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_answering(home)
        result = cli(home, "jobs")
        assert result.returncode == 7, (result.returncode, result.stderr)
        line = result.stderr.strip()
        assert line.count("\n") == 0 and line.startswith("error: ")
        assert f"(pid {control.pid}) is version 0.0.1" in line
        assert control.poll() is None
    finally:
        control.send_signal(signal.SIGINT)
        assert control.wait(timeout=60) == 0


def test_gpumesh_control_takes_over_from_a_background_node_process(home: Path) -> None:
    assert cli(home, "jobs").returncode == 0
    background = status(home)["node"]["pid"]
    control = subprocess.Popen(
        [CONTROL, "--no-tcp"],
        env=node_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_gone(background)
        _wait_answering(home)
        node = status(home)["node"]
        assert node["pid"] == control.pid and node["detached"] is False
        assert node["idle_exit"] is None
    finally:
        control.send_signal(signal.SIGINT)
        out, err = control.communicate(timeout=60)
    assert control.returncode == 0, err
    assert "gpumesh-control: stopped" in out


def _wait_answering(home: Path) -> None:
    deadline = time.monotonic() + CEILING
    while not status(home)["running"]:
        assert time.monotonic() < deadline, "the node process did not answer"
        time.sleep(0.05)


def test_share_asks_the_node_process_and_daemon_stop_ends_sharing(home: Path) -> None:
    """`gpumesh share` is a client: the background node process shares (it does not
    exit for being idle while it does), and stopping it ends the share, which the
    follower prints before it exits."""
    from tests.integration.test_cli import _free_udp_port

    settings = (
        ("listen_host", "127.0.0.1"),
        ("listen_port", str(_free_udp_port())),
        ("job_network", "none"),
    )
    for key, value in settings:
        assert cli(home, "config", "set", key, value).returncode == 0
    assert cli(home, "jobs").returncode == 0
    background = status(home)["node"]["pid"]
    with spawn(home, "share") as share:
        deadline = time.monotonic() + CEILING
        while not (status(home)["node"] or {}).get("sharing"):
            assert share.poll() is None, share.communicate()
            assert time.monotonic() < deadline, "the node process did not share"
            time.sleep(0.05)
        node = status(home)["node"]
        assert node["pid"] == background and node["detached"]  # the same process shares
        stopped = cli(home, "daemon", "stop")
        assert stopped.returncode == 0 and f"pid {background}" in stopped.stdout
        out, err = share.communicate(timeout=60)
    assert share.returncode == 0, err
    assert "Sharing node-test" in out and "Stopped sharing." in err
    said = cli(home, "daemon", "status").stdout
    assert "the node process was stopped (`gpumesh daemon stop`)" in said
