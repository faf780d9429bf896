"""Every command's `--help` explains each of its options, and the command list
says what each command does (`app run --dir`, `app pull --dir` and `search
--limit` showed only their metavar; the list said `cancel` cancels only jobs you
submitted)."""

from __future__ import annotations

import click
from click.testing import CliRunner

from gpumesh.cli.main import cli


def _commands() -> list[tuple[str, click.Command]]:
    ctx = click.Context(cli)
    found: list[tuple[str, click.Command]] = []

    def walk(group: click.Group, path: str) -> None:
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            if command is None or command.hidden:
                continue
            if isinstance(command, click.Group):
                walk(command, f"{path} {name}")
            else:
                found.append((f"{path} {name}".strip(), command))

    walk(cli, "")
    return found


def test_every_option_of_every_command_has_help_text() -> None:
    commands = _commands()
    assert len(commands) > 40  # the walk reached the subcommands
    silent = [
        f"gpumesh {path} {'/'.join(option.opts)}"
        for path, command in commands
        for option in command.params
        if isinstance(option, click.Option) and not option.hidden and not option.help
    ]
    assert silent == []


def test_the_command_list_says_cancel_ends_hosted_jobs_and_sessions_too() -> None:
    listing = CliRunner().invoke(cli, ["--help"], terminal_width=100).output
    (line,) = [row for row in listing.splitlines() if row.strip().startswith("cancel ")]
    assert "hosted" in line and "session" in line
