"""What the start-up tests share: the console script, and a Python probe run as a
thin client of a real node process already running in a fresh home (as every
command after the first finds it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

SCRIPT = Path(sys.executable).with_name("gpumesh")


def thin_env(home: Path) -> dict[str, str]:
    """The environment of a command run as users run it in ``home``: through the
    node process, without the tests' debug log (and without a default peer)."""
    env = dict(os.environ, GPUMESH_HOME=str(home))
    env.pop("GPUMESH_LOG", None)
    env.pop("GPUMESH_PEER", None)
    return env


@contextlib.contextmanager
def node_process(env: dict[str, str]) -> Iterator[None]:
    """The home's node process running (started by a first command), stopped after."""
    try:
        # The first command starts the node process (subprocess and all).
        jobs = [str(SCRIPT), "jobs"]
        subprocess.run(jobs, env=env, capture_output=True, check=True, timeout=120)
        yield
    finally:
        stop = [str(SCRIPT), "daemon", "stop"]
        subprocess.run(stop, env=env, capture_output=True, check=False, timeout=60)


def probe(check: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -c check`` with ``env``: its output, as text."""
    return subprocess.run(
        [sys.executable, "-c", check],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
