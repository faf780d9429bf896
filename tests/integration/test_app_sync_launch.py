"""``gpumesh app sync``'s head start (gpumesh.cli.launch) against a real provider
(a ``gpumesh share`` process) and a real node process: the request goes out before
click loads and is read once, its answer printed without click or by the command
(a failure); everything printed, and the exit code, are what the same command
left to click prints (the ``--home`` form, which the head start never takes)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.integration.test_app import _app_on, _project
from tests.probe import SCRIPT, node_process, probe, thin_env

pytestmark = pytest.mark.usefixtures("docker_daemon")


def _both(home: Path, *args: str) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """``app sync ARGS`` as the console script runs it (the head start takes it),
    then with ``--home`` first (left to click): each's exit code, stdout, stderr."""
    results = []
    for prefix in ([], ["--home", str(home)]):
        result = subprocess.run(
            [str(SCRIPT), *prefix, "app", "sync", *args],
            env=thin_env(home),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        results.append((result.returncode, result.stdout, result.stderr))
    return results[0], results[1]


def test_app_sync_sent_ahead_prints_what_the_command_left_to_click_prints(
    pair, tmp_path: Path
) -> None:
    alice, bob = pair
    project = _project(tmp_path)
    env = thin_env(bob)
    check = (
        "import sys\n"
        "from gpumesh.cli import launch\n"
        f"argv = ['app', 'sync', '--peer', 'alice-pc', '--dir', {str(project)!r}]\n"
        "ahead = launch.start(argv)\n"
        "code = launch.finish(argv)\n"
        # The answer's decoder (msgspec) loads while the node process syncs.
        "early = ['click', 'rich', 'dataclasses', 'qh3', 'asyncio', 'cryptography']\n"
        "print(ahead, code, len(launch._ahead))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in early))\n"
    )
    with node_process(env):
        first = probe(check, env)
        # The first sync went out, was read once and printed, and landed, all
        # before click (or anything heavy) loaded.
        lines = first.stdout.splitlines()
        assert lines[0].startswith("synced /apps/proj on alice-pc: 3 sent ("), lines
        assert lines[1:] == ["True 0 0", "[]"], first.stdout + first.stderr
        app = _app_on(alice, bob, "proj")
        assert (app / "a.txt").read_text() == "alpha\n"

        # Nothing changed: a summary, and the same summary as JSON.
        ahead, left = _both(bob, "--peer", "alice-pc", "--dir", str(project))
        assert ahead == left
        assert ahead[0] == 0 and ahead[1].startswith("synced /apps/proj on alice-pc: 0 sent")
        ahead, left = _both(bob, "--json", "--dir", str(project), "--peer=alice-pc")
        assert ahead == left and ahead[0] == 0 and '"files_unchanged": 3' in ahead[1]

        # A dry run lists the changed file and sends nothing, both ways.
        (project / "c.txt").write_text("charlie, changed\n")
        ahead, left = _both(bob, "--peer", "alice-pc", "--dir", str(project), "--dry-run")
        assert ahead == left and ahead[0] == 0
        assert "send    c.txt\n" in ahead[1] and "nothing sent" in ahead[1]
        assert (app / "c.txt").read_text() == "charlie\n"

        # A refusal is said once, with the same line and exit code.
        ahead, left = _both(bob, "--peer", "nobody", "--dir", str(project))
        assert ahead == left and ahead[0] != 0
        assert ahead[2].count("no paired peer named 'nobody'") == 1

        # The console script's own sync sends the change once.
        sent = subprocess.run(
            [str(SCRIPT), "app", "sync", "--peer", "alice-pc", "--dir", str(project)],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert sent.returncode == 0, sent.stderr
        assert sent.stdout.startswith("synced /apps/proj on alice-pc: 1 sent ("), sent.stdout
        assert sent.stdout.count("\n") == 1 and sent.stderr == ""
        assert (app / "c.txt").read_text() == "charlie, changed\n"
