"""The top-level group imports a command's module only when that command runs;
what `gpumesh --help` prints must still be exactly what click prints for an
eager group of the same command objects, each listed with the short help of
the listing (the commands' own short help stays what completion shows)."""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from gpumesh.cli import main as cli_main
from tests.probe import SCRIPT, node_process, probe, thin_env

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


class _InOrder(click.Group):
    """An eager group that lists its commands in the order given, as ours does
    (click's own sorts them)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


def _eager_group() -> click.Group:
    lazy = cli_main.cli
    commands: dict[str, click.Command] = {}
    for name, (module, attribute, short) in cli_main.COMMANDS.items():
        command = copy.copy(getattr(importlib.import_module(module), attribute))
        assert command.name == name
        command.short_help = short
        commands[name] = command
    return _InOrder(
        name=lazy.name,
        commands=commands,
        params=lazy.params,
        callback=lazy.callback,
        help=lazy.help,
        epilog=lazy.epilog,
        context_settings=lazy.context_settings,
    )


def _eager_help(columns: int, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        _eager_group().main(["--help"], prog_name="gpumesh")
    assert done.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("columns", [40, 60, 80, 100, 200])
def test_help_is_byte_identical_to_an_eager_group(
    columns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = dict(os.environ, COLUMNS=str(columns))
    lazy = subprocess.run(
        [str(SCRIPT), "--help"], env=env, capture_output=True, check=False, timeout=60
    )
    assert lazy.returncode == 0, lazy.stderr
    assert lazy.stdout.decode() == _eager_help(columns, monkeypatch)


def test_help_imports_no_command_and_nothing_heavy() -> None:
    check = (
        "import contextlib, io, sys\n"
        "from gpumesh.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    code = main(['--help'])\n"
        "roots = {m.split('.')[0] for m in sys.modules}\n"
        "heavy = {'rich', 'msgspec', 'qh3', 'cryptography', 'docker', 'asyncio', 'sqlite3',\n"
        "         'logging', 'shutil', 'pathlib'}\n"
        "print(code, sorted(roots & heavy), sorted(m for m in sys.modules\n"
        "      if m.startswith('gpumesh.') and m.count('.') > 1))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.stdout.strip() == "0 [] ['gpumesh.cli._common', 'gpumesh.cli.main']", (
        result.stdout + result.stderr
    )


# What a command that talks to the node process must not load at start-up:
# the client layer's and the provider's libraries, and what only a terminal
# (Rich), an in-process command (logging, asyncio) or help text needs.
THIN_AVOIDS = {
    "qh3", "cryptography", "docker", "sqlite3", "asyncio", "rich", "logging", "shutil",
    "base64", "signal",
}  # fmt: skip


def test_jobs_and_run_through_a_node_process_start_light(tmp_path: Path) -> None:
    """A real node process in a fresh home, already running (as the commands after
    the first one find it): `jobs` (empty, and as JSON), a `run` the node
    process refuses (no such peer) and a `cancel` it refuses load none of
    THIN_AVOIDS."""
    env = thin_env(tmp_path / "home")
    init = [str(SCRIPT), "init", "--name", "light"]
    subprocess.run(init, env=env, capture_output=True, check=True, timeout=60)
    check = (
        "import sys\n"
        f"avoided = {sorted(THIN_AVOIDS)!r}\n"
        "from gpumesh.cli.main import main\n"
        "codes = [int(main(['jobs'])), int(main(['jobs', '--json'])),\n"
        "         int(main(['run', '--peer', 'nobody', '--', 'true'])),\n"
        "         int(main(['cancel', '--peer', 'nobody', '0123456789ab']))]\n"
        "print(codes, sorted(m for m in sys.modules if m.split('.')[0] in avoided))\n"
    )
    with node_process(env):
        result = probe(check, env)
    assert result.stdout.splitlines()[-1] == "[0, 0, 2, 2] []", result.stdout + result.stderr
    assert result.stdout.splitlines()[-2] == "[]"  # `jobs --json` of an empty home
    assert result.stderr.count("no paired peer named 'nobody'") == 2  # run, then cancel
