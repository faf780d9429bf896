"""Helpers of the node process tests: the CLI with the node process on (as users
get it), and the node process's record read back."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.cli import run_cli

CEILING = 60.0
"""Seconds a node process gets to start or go (generous: CI is a loaded 2-core box)."""


def node_env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, GPUMESH_HOME=str(home))
    env.pop("GPUMESH_LOG", None)
    env.update(extra)
    return env


def cli(
    home: Path, *args: str, timeout: float = 60, **extra: str
) -> subprocess.CompletedProcess[str]:
    """``gpumesh ARGS`` for ``home`` through its node process, run in this process
    (:func:`tests.cli.run_cli`)."""
    return run_cli(list(args), node_env(home, **extra), timeout=timeout)


@contextlib.contextmanager
def spawn(home: Path, *args: str, **extra: str) -> Iterator[subprocess.Popen[str]]:
    """``gpumesh ARGS`` for ``home`` through its node process, running while the
    block runs (text pipes for its output); killed at its end if still running."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", *args],
        env=node_env(home, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def status(home: Path) -> dict[str, Any]:
    result = cli(home, "daemon", "status", "--json")
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of ours (a Popen not yet waited) is gone too.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, ceiling: float = CEILING) -> bool:
    deadline = time.monotonic() + ceiling
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def share_view(home: Path) -> dict[str, Any] | None:
    """``GET /api/v1/share`` of ``home``'s node process; None while none answers."""
    from gpumesh.daemon.client import NodeClient, NodeUnavailableError

    try:
        # The JSON as it is: tests read its shape.
        view = NodeClient(home).call("GET", "/api/v1/share", dict[str, Any], timeout=10)
    except NodeUnavailableError:
        return None
    return view


def wait_shares(
    home: Path, process: subprocess.Popen[str] | None = None, ceiling: float = CEILING
) -> dict[str, Any]:
    """Until ``home``'s node process shares (a `gpumesh share` was asked); its share
    view, whose ``agent`` says the pid and port. Fails at once if ``process`` (the
    command that asked) ended first."""
    deadline = time.monotonic() + ceiling
    while (view := share_view(home)) is None or not view["sharing"]:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"share did not start: {process.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{home} did not share within {ceiling:g} s")
        time.sleep(0.05)
    return view


def shares(home: Path) -> bool:
    """Whether ``home`` shares now (a node process runs it)."""
    view = share_view(home)
    return view is not None and bool(view["sharing"])
