"""Shells from the consumer's side: one ``gpumesh exec`` session.

Owns the session's wire exchange: ``ExecStart``; then the caller's input (a
file descriptor: a terminal already in raw mode, a pipe or a file) as DATA
frames, the provider's DATA frames to an output callback, window sizes as
``ExecResize``; and the program's exit code from ``ExecExit``. Terminal modes
and signals belong to the caller (the CLI); nothing here prints.

Leaving the session any way (the program exits, an error, cancellation) closes
the link, which tells the provider to remove the container at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from gpumesh.errors import ConnectionLostError, GPUMeshError, ProtocolError, error_from_code
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import (
    ExecExit,
    ExecResize,
    ExecStart,
    ExecStarted,
    Refusal,
    decode_message,
)

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.transport.stream import Stream

__all__ = ["HANGUP_EXIT", "ExecSession", "exec_shell"]

HANGUP_EXIT = 129
"""Exit code when the local terminal goes away mid-session (128 + SIGHUP)."""
_READ = 64 * 1024
_MAX_SIZE = 10000


class _TerminalClosed(Exception):
    """The local terminal reached end of input: it was hung up."""


class ExecSession:
    """An open shell, as handed to ``started``: resize its terminal while it runs."""

    def __init__(self, stream: Stream, tty: bool, provider: str) -> None:
        self.provider = provider
        self.tty = tty
        self._stream = stream
        self._open = True

    def resize(self, rows: int, cols: int) -> None:
        """Tell the provider the local window's new size (ignored without a TTY)."""
        if not (self._open and self.tty and rows > 0 and cols > 0):
            return
        message = ExecResize(rows=min(rows, _MAX_SIZE), cols=min(cols, _MAX_SIZE))
        with contextlib.suppress(GPUMeshError):  # the link may be closing
            self._stream.send_message(message)

    def close(self) -> None:
        self._open = False


def _ignore(_session: ExecSession) -> None:
    return None


async def exec_shell(
    node: Node,
    peer: str,
    command: Sequence[str],
    *,
    input_fd: int,
    output: Callable[[bytes], None],
    image: str | None = None,
    env: Mapping[str, str] | None = None,
    tty: bool = False,
    size: tuple[int, int] | None = None,
    started: Callable[[ExecSession], None] = _ignore,
) -> int:
    """Run ``command`` (empty: the image's default) in a fresh container on ``peer``.

    ``tty``: give the program a terminal (``size`` is its (rows, cols)); the
    caller puts its own terminal in raw mode. Without one, the program's
    stdout and stderr arrive merged, and the end of ``input_fd`` is the end of
    its stdin. ``started`` is called once the container runs. Returns the
    program's exit code, or HANGUP_EXIT when ``input_fd`` is a terminal that
    was hung up.
    """
    rows, cols = size if tty and size is not None else (0, 0)
    start = ExecStart(
        image=image or str(node.home.config.get("image")),
        command=list(command),
        env=dict(env or {}),
        tty=tty,
        rows=max(0, min(rows, _MAX_SIZE)),
        cols=max(0, min(cols, _MAX_SIZE)),
    )
    target = node.peer(peer)
    async with node.session(target.node_id) as session:
        stream = session.open_stream()
        stream.send_message(start)
        reply = await stream.expect(ExecStarted)
        shell = ExecSession(stream, tty, reply.provider)
        started(shell)
        pump = asyncio.create_task(_pump_input(stream, input_fd, tty))
        receiver = asyncio.create_task(_receive(stream, output, reply.provider))
        try:
            await asyncio.wait({pump, receiver}, return_when=asyncio.FIRST_COMPLETED)
            if not receiver.done():
                error = pump.exception()
                if isinstance(error, _TerminalClosed):
                    return HANGUP_EXIT
                if error is not None:
                    # Input could not be sent, so the stream failed: the
                    # receiver says why, given a moment.
                    await asyncio.wait({receiver}, timeout=1.0)
                    if not receiver.done():
                        raise error
                await receiver  # input ended (a pipe): the program runs on
            return receiver.result()
        finally:
            shell.close()
            for task in (pump, receiver):
                task.cancel()
            for task in (pump, receiver):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


async def _pump_input(stream: Stream, fd: int, tty: bool) -> None:
    """Local input -> DATA frames; at its end, an empty DATA frame (stdin EOF)."""
    while True:
        data = await _read(fd)
        if not data:
            if tty:
                raise _TerminalClosed
            stream.end_data()
            return
        await stream.send_data(data)


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


async def _receive(stream: Stream, output: Callable[[bytes], None], provider: str) -> int:
    """Provider -> output until ExecExit; returns the exit code."""
    while True:
        frame = await stream.read_frame()
        if frame is None:
            raise ConnectionLostError(f"{provider} ended the shell without its exit status")
        if frame.kind is FrameKind.DATA:
            if frame.body:
                output(frame.body)
            continue
        message = decode_message(frame.body)
        if isinstance(message, ExecExit):
            return message.exit_code
        if isinstance(message, Refusal):
            raise error_from_code(message.code, message.message)
        raise ProtocolError(f"{provider} sent {type(message).__name__} during a shell session")
