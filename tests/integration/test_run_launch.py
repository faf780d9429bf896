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


def _both(
    home: Path, *args: str, cwd: Path | None = None
) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """``run ARGS`` as the console script runs it (the head start takes it), then
    with ``--home`` first (left to click): each's exit code, stdout, stderr."""
    results = []
    for prefix in ([], ["--home", str(home)]):
        result = subprocess.run(
            [str(SCRIPT), *prefix, "run", *args],
            env=thin_env(home),
            cwd=cwd,
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
        # The events' decoder (msgspec) loads while the provider starts the job.
        "early = ['click', 'rich', 'dataclasses', 'qh3', 'asyncio', 'cryptography']\n"
        "print(ahead, code, len(launch._ahead), len(launch._readers))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in early))\n"
    )
    with node_process(env):
        first = probe(check, env)
        # The job ran, its output was printed and its exit code given, all
        # without click (or anything heavy but the events' decoder).
        assert first.stdout.splitlines() == ["out", "True 3 0 0", "[]"], first.stdout + first.stderr
        assert first.stderr == "err\n"

        ahead, left = _both(bob, "--peer", "alice-pc", "--", *JOB)
        assert ahead == left == (3, "out\n", "err\n")

        # A refusal is said once, with the same line and exit code.
        ahead, left = _both(bob, "--peer", "nobody", "true")
        assert ahead == left and ahead[0] != 0
        assert ahead[2].count("no paired peer named 'nobody'") == 1


def test_a_run_with_a_workdir_is_printed_ahead_as_the_command_left_to_click_prints_it(
    pair, tmp_path: Path
) -> None:
    """``run --workdir`` is taken by the head start too: the folder (relative to the
    command's own working folder) reaches the job, nothing heavy is loaded, and what
    is printed is what the command left to click prints, refusals included."""
    _alice, bob = pair
    env = thin_env(bob)
    (tmp_path / "proj" / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "sub" / "data.txt").write_text("from the workdir\n")
    job = ["sh", "-c", "cat sub/data.txt; echo err >&2; exit 4"]
    check = (
        "import os, sys\n"
        "from gpumesh.cli import launch\n"
        f"os.chdir({str(tmp_path)!r})\n"
        f"argv = ['run', '--peer', 'alice-pc', '--workdir', 'proj', '--', *{job!r}]\n"
        "ahead = launch.start(argv)\n"
        "code = launch.finish_run(argv)\n"
        "early = ['click', 'rich', 'dataclasses', 'qh3', 'asyncio', 'cryptography', 'yaml']\n"
        "print(ahead, code, len(launch._ahead), len(launch._readers))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in early))\n"
    )
    with node_process(env):
        first = probe(check, env)
        lines = first.stdout.splitlines()
        assert lines == ["from the workdir", "True 4 0 0", "[]"], first.stdout + first.stderr
        assert first.stderr.endswith("err\n")

        args = ("--peer", "alice-pc", "--workdir", "proj", "--", *job)
        ahead, left = _both(bob, *args, cwd=tmp_path)
        assert ahead == left
        assert (ahead[0], ahead[1]) == (4, "from the workdir\n")

        # A refusal of the provider is said once, with the same line and exit code.
        ahead, left = _both(bob, "--peer", "nobody", "--workdir", "proj", "true", cwd=tmp_path)
        assert ahead == left and ahead[0] != 0
        assert ahead[2].count("no paired peer named 'nobody'") == 1

        # A folder that is not there is the command's to refuse, as it always did.
        ahead, left = _both(bob, "--peer", "alice-pc", "--workdir", "gone", "true", cwd=tmp_path)
        assert ahead == left and ahead[0] != 0
        assert ahead[2].count("--workdir gone does not exist") == 1
