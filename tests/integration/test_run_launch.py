"""``gpumesh run``'s head start (gpumesh.cli.launch) against a real provider (a
``gpumesh share`` process) and a real node process: the plain form's request goes
out before click loads, and its events are printed, and the exit status given,
without click at all; what it prints, and its exit code, are what the same
command left to click prints (the ``--home`` form, which the head start never
takes), a refusal included."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.probe import SCRIPT, node_process, probe, thin_env

pytestmark = pytest.mark.usefixtures("docker_daemon")

JOB = ["sh", "-c", "echo out; echo err >&2; exit 3"]


def _both(home: Path, *args: str) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """``run ARGS`` as the console script runs it (the head start takes it), then
    with ``--home`` first (left to click): each's exit code, stdout, stderr."""
    results = []
    for prefix in ([], ["--home", str(home)]):
        result = subprocess.run(
            [str(SCRIPT), *prefix, "run", *args],
            env=thin_env(home),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        results.append((result.returncode, result.stdout, result.stderr))
    return results[0], results[1]


def test_a_plain_run_is_printed_ahead_as_the_command_left_to_click_prints_it(pair) -> None:
    _alice, bob = pair
    env = thin_env(bob)
    check = (
        "import sys\n"
        "from gpumesh.cli import launch\n"
        f"argv = ['run', '--peer', 'alice-pc', '--', *{JOB!r}]\n"
        "ahead = launch.start(argv)\n"
        "code = launch.finish_run(argv)\n"
        "early = ['click', 'rich', 'typing', 'dataclasses', 'msgspec', 'qh3', 'asyncio']\n"
        "print(ahead, code, len(launch._ahead), len(launch._readers))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in early))\n"
    )
    with node_process(env):
        first = probe(check, env)
        # The job ran, its output was printed and its exit code given, all
        # without click (or anything heavy).
        assert first.stdout.splitlines() == ["out", "True 3 0 0", "[]"], first.stdout + first.stderr
        assert first.stderr == "err\n"

        ahead, left = _both(bob, "--peer", "alice-pc", "--", *JOB)
        assert ahead == left == (3, "out\n", "err\n")

        # A refusal is said once, with the same line and exit code.
        ahead, left = _both(bob, "--peer", "nobody", "true")
        assert ahead == left and ahead[0] != 0
        assert ahead[2].count("no paired peer named 'nobody'") == 1
