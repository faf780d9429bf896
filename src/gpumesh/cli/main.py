"""The ``gpumesh`` entry point: a lazily loaded command group.

Each command lives in its own module and is imported only when run, so
``gpumesh --help`` does not pay for QUIC, cryptography or Docker imports.
"""

from __future__ import annotations

import importlib
import os
import sys

import click
import click.formatting

from gpumesh.errors import JOB_CODES_NOTE, exit_code_rows
from gpumesh.version import __version__

__all__ = ["COMPLETE_VAR", "cli", "main"]

COMPLETE_VAR = "_GPUMESH_COMPLETE"

# name -> (module, attribute, short help shown in `gpumesh --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "init": ("gpumesh.cli.init", "init", "Create this node's identity and config."),
    "start": ("gpumesh.cli.start", "start", "Open a menu for the common flows (needs a terminal)."),
    "status": ("gpumesh.cli.status", "status", "Show this node: sharing, GPUs, jobs, peers."),
    "gpu": ("gpumesh.cli.gpu", "gpu", "Show this machine's NVIDIA GPUs."),
    "doctor": ("gpumesh.cli.doctor", "doctor", "Check what this node needs and how to fix it."),
    "netcheck": (
        "gpumesh.cli.netcheck",
        "netcheck",
        "Check UDP, the NAT, the path MTU and TCP to the relay.",
    ),
    "config": ("gpumesh.cli.config", "config", "Show or change settings."),
    "pair-code": ("gpumesh.cli.pair_code", "pair_code", "Print this node's pairing code."),
    "pair": ("gpumesh.cli.pair", "pair", "Pair with a peer using its code."),
    "peers": ("gpumesh.cli.peers", "peers", "List paired peers."),
    "allow": ("gpumesh.cli.access", "allow", "Let a paired peer use this node again."),
    "deny": ("gpumesh.cli.access", "deny", "Revoke a peer's access at once."),
    "connect": ("gpumesh.cli.connect", "connect", "Dial a peer and report path and RTT."),
    "share": ("gpumesh.cli.share", "share", "Share this machine with paired peers."),
    "pause": ("gpumesh.cli.pause", "pause", "Take this machine back from peers until resume."),
    "resume": ("gpumesh.cli.pause", "resume", "Offer this machine to peers again."),
    "run": ("gpumesh.cli.run", "run", "Run a command in a container on a peer."),
    "jobs": ("gpumesh.cli.jobs", "jobs", "List jobs submitted and hosted."),
    "logs": ("gpumesh.cli.logs", "logs", "Print or follow a job's output."),
    "cancel": (
        "gpumesh.cli.cancel",
        "cancel",
        "Cancel a job (yours or hosted), or a session.",
    ),
    "cp": ("gpumesh.cli.cp", "cp", "Copy files to or from a peer's sandbox."),
    "app": ("gpumesh.cli.app", "app", "Sync a project folder to a peer and run jobs in it."),
    "exec": ("gpumesh.cli.exec", "exec", "Open a shell in a fresh container on a peer."),
    "prune": ("gpumesh.cli.prune", "prune", "Remove old finished jobs and their logs."),
    "group": ("gpumesh.cli.group", "group", "Create, share and join groups of nodes."),
    "desktop": ("gpumesh.cli.desktop", "desktop", "Share your VNC/RDP desktop, or use a peer's."),
    "search": ("gpumesh.cli.search", "search", "Find shared GPUs in the public registry."),
    "sync": ("gpumesh.cli.sync", "sync", "Re-publish to the registry; refresh peers' addresses."),
    "daemon": ("gpumesh.cli.daemon", "daemon", "Show or stop this home's node process."),
    "completion": ("gpumesh.cli.completion", "completion", "Print a shell completion script."),
    "cuda": ("gpumesh.cli.cuda", "cuda", "Use a peer's GPU from your programs (experimental)."),
    "dashboard": ("gpumesh.cli.dashboard", "dashboard", "Print a sign-in URL for the dashboard."),
}

EPILOG = """\b
Examples:
  gpumesh init --name alice-pc
  gpumesh share                       # on the machine with the GPU
  gpumesh pair 'gpm1_...'             # paste the other node's code
  gpumesh connect alice-pc
  gpumesh run --peer alice-pc -- nvidia-smi
\b
Every node's state lives in $GPUMESH_HOME (default ~/.gpumesh).
"""


def exit_codes_help() -> str:
    """The exit code table as ``gpumesh --help`` shows it (from errors.ExitCode)."""
    import textwrap

    rows = [f"  {code:>3}  {meaning}" for code, meaning in exit_code_rows()]
    note = textwrap.wrap(JOB_CODES_NOTE, 90, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(["\b", "Exit codes:", *rows, *note]) + "\n"


def terminal_columns() -> int:
    """``shutil.get_terminal_size().columns``, as click's help asks it, without
    importing :mod:`shutil` (and the archive modules it pulls in) on every
    ``gpumesh --help``: ``$COLUMNS`` when a positive number, else the width of
    the terminal on standard output, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns > 0:
        return columns
    try:
        size = os.get_terminal_size(sys.__stdout__.fileno())  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return 80
    return size.columns or 80


class HelpContext(click.Context):
    """The top-level group's context: click's help formatter of the same width."""

    def make_formatter(self) -> click.HelpFormatter:
        width = self.terminal_width
        if width is None:
            width = click.formatting.FORCED_WIDTH
        if width is None:
            width = max(min(terminal_columns(), self.max_content_width or 80) - 2, 50)
        return self.formatter_class(width=width, max_width=self.max_content_width)


class LazyGroup(click.Group):
    context_class = HelpContext

    # The epilog (examples and the exit code table) is made when help is shown
    # (or asked for), not on every command's start.
    @property
    def epilog(self) -> str:
        return EPILOG + "\n" + exit_codes_help()

    @epilog.setter
    def epilog(self, value: str | None) -> None:
        pass

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module = importlib.import_module(entry[0])
        command: click.Command = getattr(module, entry[1])
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, entry[2]) for name, entry in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--home",
    envvar="GPUMESH_HOME",
    show_envvar=True,
    type=click.Path(file_okay=False),
    help="Node state folder (default ~/.gpumesh).",
)
@click.version_option(__version__, "-V", "--version", prog_name="gpumesh")
@click.pass_context
def cli(ctx: click.Context, home: str | None) -> None:
    """GPUMesh: run Docker jobs on your friends' idle GPUs, peer to peer."""
    ctx.obj = home


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every GPUMesh error becomes one line and an exit code."""
    from gpumesh.cli._common import run_cli
    from gpumesh.daemon import setting_gone

    if COMPLETE_VAR in os.environ:  # a shell's Tab press: our PowerShell completer must answer
        import gpumesh.cli._powershell  # noqa: F401
    setting_gone()

    return run_cli(cli, argv)


def entry() -> None:
    """Console-script entry: run, flush, and leave without interpreter teardown.

    Tearing down the modules a job run loads (QUIC, TLS, SQLite, asyncio) costs
    tens of milliseconds on every command; all state is already committed and
    every file closed by the time main() returns, so only output is flushed
    (and the log handlers, where a command set logging up: a thin command
    never imports it).
    """
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        code = code or 1
    if (logging := sys.modules.get("logging")) is not None:
        logging.shutdown()
    os._exit(code)
