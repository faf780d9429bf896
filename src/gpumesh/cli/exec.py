"""``gpumesh exec``"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import click

from gpumesh import platform
from gpumesh.cli._common import run_async
from gpumesh.cli._complete import complete_peer
from gpumesh.cli._node import env_of, node_client
from gpumesh.errors import AgentError, ConfigError, error_from_code
from gpumesh.units import parse_size

if TYPE_CHECKING:
    from gpumesh.client.bodies import ShellRequest
    from gpumesh.control.views import ShellOfferView


@click.command(
    "exec",
    context_settings={"allow_interspersed_args": False},
    epilog="""\b
Examples:
  gpumesh exec alice-pc                              # an interactive sh
  gpumesh exec --image python:3.12-slim alice-pc python
  gpumesh exec -e DEBUG=1 alice-pc -- sh -l
  echo 'nproc; exit 3' | gpumesh exec alice-pc sh    # no terminal: stdin is piped
  gpumesh exec --gpu-memory 8GB alice-pc nvidia-smi  # a shell with a GPU
\b
Each session gets a new container with the same lockdown as a job (no
privileges, no capabilities, no host folders, no GPU unless --gpu-memory asks
for one: its memory is then held for the shell, as for a job, until it ends)
that is removed when the session ends. Options go before PEER; everything after it is the command.
\b
Exit status: the program's exit code (129 when the local terminal hung up,
143 on SIGTERM, 130 on Ctrl-C without a terminal).
""",
)
@click.option("--image", help="Container image (default: config `image` / $GPUMESH_IMAGE).")
@click.option("-e", "--env", "env_items", multiple=True, metavar="KEY=VAL", help="Set a variable.")
@click.option(
    "--gpu-memory",
    metavar="SIZE",
    help="Give the shell a GPU with this much free memory (e.g. 8GB), held while it is open.",
)
@click.argument("peer", envvar="GPUMESH_PEER", shell_complete=complete_peer)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def exec(
    peer: str,
    image: str | None,
    env_items: tuple[str, ...],
    gpu_memory: str | None,
    command: tuple[str, ...],
) -> None:
    """Open a shell (or COMMAND, default sh) in a fresh container on PEER.

    With a terminal, every key (Ctrl-C included) goes to the remote program
    and its window follows yours; without one, stdin is piped through and
    stdout and stderr arrive together. gpumesh exits with the program's code.
    PEER is a name or an id prefix; with no arguments at all, $GPUMESH_PEER.
    """
    if command[:1] == ("--",):  # `gpumesh exec PEER -- CMD`: the separator is not the command
        command = command[1:]
    if image is not None and (not image.strip() or any(ch.isspace() for ch in image)):
        raise ConfigError(f"--image {image!r} is not an image name, such as python:3.12-slim")
    memory = parse_size(gpu_memory) if gpu_memory is not None else 0
    if gpu_memory is not None and memory <= 0:
        raise ConfigError(f"--gpu-memory {gpu_memory!r} must be more than 0, e.g. 8GB")
    # Without termios (Windows) there is no raw mode to give keys through as
    # they are typed: the session runs as with a pipe, line by line.
    tty = os.isatty(0) and os.isatty(1) and platform.has("termios")
    raw = _RawMode(0) if tty else None
    from gpumesh import settings
    from gpumesh.client.bodies import ShellRequest

    request = ShellRequest(
        peer=peer,
        command=list(command),
        image=image or settings.env(settings.ENV_IMAGE),  # ours, not the node's
        env=env_of(env_items),
        gpu_memory=memory,
        tty=tty,
    )
    try:
        code = run_async(_through_node(request, raw))
    finally:
        if raw is not None:
            raw.restore()
    raise SystemExit(code)


async def _through_node(request: ShellRequest, raw: _RawMode | None) -> int:
    """The shell run by the node process: this process carries the terminal's bytes,
    its resizes and the exit code over the socket the node process opened for it
    (:mod:`gpumesh.daemon.shells`)."""
    import msgspec

    from gpumesh.cli._notes import StepNotes
    from gpumesh.client.views import ErrorView
    from gpumesh.client.views.runs import PullingView
    from gpumesh.control.views import ShellOfferView
    from gpumesh.daemon import frames

    client = node_client()
    if raw is not None:
        request.rows, request.cols = _window_size()
    offer = client.call("POST", "/api/v1/shells", ShellOfferView, request)
    reader, writer = await _connect_shell(offer)
    writer.write(frames.frame(frames.TOKEN, offer.token.encode()))
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)  # closing the socket ends the remote session
        main.cancel()

    def resize() -> None:
        writer.write(frames.resize_frame(*_window_size()))

    async def pump() -> None:
        async for data in _read_fd(0):
            writer.write(frames.frame(frames.DATA, data))
            await writer.drain()
        writer.write(frames.frame(frames.EOF))
        await writer.drain()

    undo: list[Callable[[], None]] = []
    tasks: list[asyncio.Task[None]] = []
    for name in ("SIGHUP", "SIGTERM"):
        if hasattr(signal, name):
            signum = getattr(signal, name)
            undo.append(
                platform.add_signal_handler(loop, signum, functools.partial(on_signal, signum))
            )
    notes = StepNotes()
    try:
        tasks.append(asyncio.ensure_future(pump()))
        while True:
            try:
                item = await frames.read_frame(reader)
            except (frames.FrameError, OSError):
                item = None
            if item is None:
                raise AgentError(
                    "the node process stopped during the shell (the remote program was ended)"
                )
            kind, payload = item
            if kind == frames.DATA:
                await _write_stdout(payload)
            elif kind == frames.STARTED and raw is not None:
                raw.enter()
                if platform.has("sigwinch"):
                    undo.append(platform.add_signal_handler(loop, signal.SIGWINCH, resize))
                else:
                    tasks.append(asyncio.ensure_future(_poll_window(resize)))
            elif kind == frames.PULL:
                notes.pull(msgspec.json.decode(payload, type=PullingView))
            elif kind == frames.EXIT:
                return int.from_bytes(payload, "big", signed=True)
            elif kind == frames.FAILED:
                error = msgspec.json.decode(payload, type=ErrorView)
                raise error_from_code(error.code, error.message)
    except asyncio.CancelledError:
        if received:
            return 128 + received[0]
        raise
    finally:
        for task in tasks:
            task.cancel()
        for step in undo:
            step()
        writer.close()


async def _connect_shell(
    offer: ShellOfferView,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The connection to a shell the node process offered: its unix socket, or
    loopback TCP where the system has none."""
    import socket
    from pathlib import Path

    from gpumesh.store.sockets import socket_name

    try:
        if not offer.socket:
            return await asyncio.open_connection("127.0.0.1", offer.port)
        path = Path(offer.socket)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with socket_name(path.parent, path.name) as name:
                sock.connect(name)
        except OSError:
            sock.close()
            raise
        return await asyncio.open_unix_connection(sock=sock)
    except OSError as exc:
        raise AgentError(f"cannot reach the shell the node process opened: {exc}") from None


async def _poll_window(resize: Callable[[], None]) -> None:
    size = _window_size()
    while True:
        await asyncio.sleep(_WINDOW_POLL)
        now = _window_size()
        if now != size:
            size = now
            resize()


_WINDOW_POLL = 0.5
"""Seconds between looks at the window's size where no signal says it changed."""


def _window_size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(0)
    except OSError:
        return (0, 0)
    return (size.lines, size.columns)


async def _write_stdout(data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(1, view)
        except BlockingIOError:
            continue
        view = view[written:]


_READ = 64 * 1024


async def _read_fd(fd: int) -> AsyncIterator[bytes]:
    """What arrives on ``fd`` (the terminal, a pipe or a file), until its end."""
    if not platform.has("add_reader"):
        async for data in _read_in_thread(fd):
            yield data
        return
    while data := await _read(fd):
        yield data


async def _read_in_thread(fd: int) -> AsyncIterator[bytes]:
    """:func:`_read_fd` where the loop cannot watch ``fd`` (Windows: a console or
    a pipe): a daemon thread reads, so a read still blocked when the session
    ends never holds the process open."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue[bytes] = asyncio.Queue(maxsize=4)

    def hand_over(data: bytes) -> bool:
        try:
            asyncio.run_coroutine_threadsafe(arrived.put(data), loop).result()
        except (RuntimeError, concurrent.futures.CancelledError):  # the loop is gone
            return False
        return True

    def pump() -> None:
        while True:
            try:
                data = os.read(fd, _READ)
            except OSError:
                data = b""
            if not hand_over(data) or not data:
                return

    threading.Thread(target=pump, name="gpumesh-stdin", daemon=True).start()
    while data := await arrived.get():
        yield data


async def _read(fd: int) -> bytes:
    """The next bytes available on ``fd``, without blocking the loop; b"" at its end."""
    loop = asyncio.get_running_loop()
    while True:
        ready: asyncio.Future[None] = loop.create_future()
        try:
            loop.add_reader(fd, _set_ready, ready)
        except PermissionError:
            # A regular file (stdin redirected from one) cannot be polled, and
            # reading it never waits long.
            return await asyncio.to_thread(os.read, fd, _READ)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        try:
            return os.read(fd, _READ)
        except BlockingIOError:
            continue
        except OSError as exc:
            if exc.errno == errno.EIO:  # a terminal that was hung up
                return b""
            raise


def _set_ready(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class _RawMode:
    """The local terminal in raw mode while connected: keys go through as bytes
    (Ctrl-C too), nothing is echoed or translated locally."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._saved: list[Any] | None = None

    def enter(self) -> None:
        import termios
        import tty

        if self._saved is None:
            self._saved = termios.tcgetattr(self.fd)
            tty.setraw(self.fd, termios.TCSANOW)

    def restore(self) -> None:
        import termios

        if self._saved is not None:
            saved, self._saved = self._saved, None
            with contextlib.suppress(termios.error, OSError):  # the terminal may be gone
                termios.tcsetattr(self.fd, termios.TCSADRAIN, saved)
