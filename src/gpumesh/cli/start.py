"""``gpumesh start``: an interactive menu over the common commands.

A thin shell: the keys and the selection are :mod:`gpumesh.cli._menu`'s, and
every entry runs the same command a user would type (``doctor``, ``share``,
``pair-code``, ``pair``, ``run``), in this process, with its own output and
errors. This module only reads bytes from a raw terminal, draws the menu and
asks for the few words an entry needs. The terminal is back in its own mode
before any entry runs and on every way out, Ctrl-C and failures included.
"""

from __future__ import annotations

import os
import select
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

from gpumesh.cli._common import fail, run_cli
from gpumesh.cli._menu import Choice, Item, KeyDecoder, Menu
from gpumesh.errors import ExitCode, GPUMeshError

ESC_WAIT = 0.05
"""Seconds to wait after an Esc byte for the rest of an arrow key's sequence."""

DIRECT = "gpumesh init, doctor, share, pair-code, pair, run"
"""The commands the menu runs, named where it cannot run."""


@click.command(
    epilog="""\b
Examples:
  gpumesh start                       # arrows and Enter, or type a number; q leaves
  GPUMESH_HOME=~/.gpumesh-bob gpumesh start   # the menu for another home of yours
\b
Without a terminal it exits 2 and names the commands to use instead.
""",
)
@click.pass_context
def start(ctx: click.Context) -> None:
    """Open a menu for the common flows: create this node if needed, check it
    (doctor), share it, show its pairing code, pair with a code, run a command
    on a peer, open the dashboard.

    Move with the arrow keys and press Enter, or type an entry's number; q,
    Esc or Ctrl-C leaves. Each entry runs the command of the same name and
    comes back to the menu.
    """
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        fail(
            "`gpumesh start` is an interactive menu and needs a terminal: run it in one, "
            f"or use the commands directly ({DIRECT})",
            ExitCode.USAGE,
        )
    from gpumesh import platform

    if not platform.has("termios"):
        fail(
            f"`gpumesh start` needs a POSIX terminal; use the commands directly ({DIRECT})",
            ExitCode.USAGE,
        )
    home: str | None = ctx.find_root().obj
    from gpumesh.store.home import Home

    if not Home(home).initialized and not _offer_init(home):
        raise SystemExit(ExitCode.INTERRUPTED)
    items = _items()
    selected = 0
    while True:
        choice = _choose(Menu(items, selected), _title(home))
        if choice.item is None:
            if choice.interrupted:
                raise SystemExit(ExitCode.INTERRUPTED)
            return
        selected = items.index(choice.item)
        if choice.item.action == "quit":
            return
        click.echo()
        _run_entry(home, choice.item.action)
        click.echo()


def _items() -> list[Item]:
    return [
        Item("Check this node (doctor)", "doctor"),
        Item("Share this machine with my peers (share; Ctrl-C stops)", "share"),
        Item("Show my pairing code (pair-code)", "pair-code"),
        Item("Pair with a peer's code (pair)", "pair"),
        Item("Run a command on a peer (run)", "run"),
        Item("Open the dashboard (dashboard)", "dashboard"),
        Item("Quit", "quit"),
    ]


# --- the entries: each asks for its words, then runs the command --------------------


def _run_entry(home: str | None, action: str) -> None:
    try:
        ask = _ENTRY_ARGS.get(action)
        argv = ask(home) if ask is not None else [action]
    except click.Abort:
        click.echo("\nCancelled.")
        return
    if argv is not None:
        _invoke(home, argv)


def _pair_args(home: str | None) -> list[str] | None:
    code = click.prompt("Paste your peer's pairing code (gpm1_...)", default="", show_default=False)
    if not code.strip():
        click.echo("No code given; nothing done.")
        return None
    return ["pair", code.strip()]


def _run_args(home: str | None) -> list[str] | None:
    from gpumesh.client.node import Node

    node = Node(home)
    try:
        peers = [peer.name for peer in node.peers() if peer.allowed]
    finally:
        node.close()
    if not peers:
        click.echo("No paired peers yet: pair with a peer's code first.")
        return None
    click.echo(f"Paired peers: {', '.join(peers)}")
    peer = click.prompt("Peer to run on", default=peers[0] if len(peers) == 1 else None)
    line = click.prompt("Command to run", default="nvidia-smi")
    try:
        command = shlex.split(line)
    except ValueError as exc:
        click.echo(f"Cannot read that command ({exc}); nothing done.")
        return None
    return ["run", "--peer", peer.strip(), "--", *command] if command else None


_ENTRY_ARGS: dict[str, Callable[[str | None], list[str] | None]] = {
    "pair": _pair_args,
    "run": _run_args,
}


def _invoke(home: str | None, argv: list[str]) -> int:
    """Run ``gpumesh ARGV`` in this process, with its own output, errors and exit code."""
    from gpumesh.cli.main import cli

    click.echo(click.style(f"$ gpumesh {shlex.join(argv)}", dim=True))
    code = run_cli(cli, (["--home", home] if home else []) + argv)
    if code:
        click.echo(click.style(f"(exit code {code})", dim=True))
    return code


# --- the first run: a home without a node -----------------------------------------


def _offer_init(home: str | None) -> bool:
    """Ask for a name and create the node; False when the user leaves instead."""
    from gpumesh.client.node import default_node_name

    click.echo("This home has no node yet; let's create one (`gpumesh init`).")
    while True:  # a refused name (its error line is shown) asks again
        try:
            name = click.prompt("Name for this node", default=default_node_name())
        except click.Abort:
            click.echo("\nNothing done; run `gpumesh init` or `gpumesh start` when ready.")
            return False
        if _invoke(home, ["init", "--name", name.strip()]) == 0:
            return True


def _title(home: str | None) -> str:
    from gpumesh.client.node import Node

    try:
        node = Node(home)
        try:
            info = node.info()
        finally:
            node.close()
    except GPUMeshError:
        return "GPUMesh"
    return f"GPUMesh · {info.name} ({info.node_id.short})"


# --- the raw terminal -------------------------------------------------------------


def _choose(menu: Menu, title: str) -> Choice:
    """Draw ``menu`` and feed it keys until it ends; the terminal is restored after."""
    fd = sys.stdin.fileno()
    decoder = KeyDecoder()
    with _raw(fd):
        drawn = _draw(menu, title, 0)
        while True:
            ready, _, _ = select.select([fd], [], [], ESC_WAIT if decoder.pending else None)
            if ready:
                data = os.read(fd, 64)
                if not data:  # the terminal went away
                    return Choice(None)
                keys = decoder.feed(data)
            else:
                keys = decoder.flush()
            for key in keys:
                choice = menu.press(key)
                if choice is not None:
                    return choice
            drawn = _draw(menu, title, drawn)


@contextmanager
def _raw(fd: int) -> Iterator[None]:
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)
        _write("\x1b[?25l")  # hide the cursor while the selection moves
        yield
    finally:
        _write("\x1b[?25h")
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _draw(menu: Menu, title: str, previous: int) -> int:
    """Draw the menu over the ``previous`` lines it took; returns how many it takes now."""
    lines = [
        click.style(title, bold=True),
        click.style("↑/↓ and Enter, or type a number · q or Esc leaves", dim=True),
    ]
    for selected, number, item in menu.lines():
        text = f"{'>' if selected else ' '} {number}  {item.label}"
        lines.append(click.style(text, reverse=selected, dim=False))
    back = f"\x1b[{previous}F\x1b[J" if previous else ""
    # Raw mode leaves "\n" as a bare line feed: each line ends with its own "\r\n".
    _write(back + "".join(line + "\r\n" for line in lines))
    return len(lines)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
