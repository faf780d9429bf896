"""Shells from the consumer's side: one ``gpumesh exec`` session.

Owns the session's wire exchange: ``ExecStart``; then the caller's input (an
async byte source: a terminal already in raw mode, a pipe, a browser's
terminal) as DATA frames, the provider's DATA frames to an async byte sink,
window sizes as ``ExecResize``; and the program's exit code from ``ExecExit``.
Terminal modes, file descriptors and signals belong to the caller (the CLI);
nothing here prints.

Leaving the session any way (the program exits, an error, cancellation) closes
the link, which tells the provider to remove the container at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from gpumesh.errors import (
    AgentError,
    ConnectionLostError,
    GPUMeshError,
    ProtocolError,
    error_from_code,
)
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import (
    ExecExit,
    ExecResize,
    ExecStart,
    ExecStarted,
    ImagePull,
    Refusal,
    decode_message,
)

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.transport.stream import Stream

__all__ = ["HANGUP_EXIT", "ByteSink", "ExecSession", "exec_shell"]

HANGUP_EXIT = 129
"""Exit code when the local terminal goes away mid-session (128 + SIGHUP)."""
_MAX_SIZE = 10000

ByteSink = Callable[[bytes], Awaitable[None]]
"""Where the program's output goes; awaited, so a slow reader slows the session."""


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
    source: AsyncIterable[bytes],
    sink: ByteSink,
    image: str | None = None,
    env: Mapping[str, str] | None = None,
    tty: bool = False,
    size: tuple[int, int] | None = None,
    started: Callable[[ExecSession], None] = _ignore,
    on_pull: Callable[[ImagePull], None] | None = None,
    gpu_memory: int = 0,
) -> int:
    """Run ``command`` (empty: the image's default) in a fresh container on ``peer``.

    ``tty``: give the program a terminal (``size`` is its (rows, cols)); the
    caller puts its own terminal in raw mode. ``source`` yields the input (its
    end: with a TTY, the terminal hung up; without, the end of the program's
    stdin); ``sink`` takes the output (without a TTY, stdout and stderr
    merged). ``started`` is called once the container runs; ``on_pull`` hears how
    the provider's pull of the image goes before that. ``gpu_memory``: give the
    shell a GPU with that many free bytes (held for it while it is open; refused
    like a job's request when none has the room). Returns the
    program's exit code, or HANGUP_EXIT when a TTY's ``source`` ended.
    """
    rows, cols = size if tty and size is not None else (0, 0)
    start = ExecStart(
        image=image or str(node.home.config.get("image")),
        command=list(command),
        env=dict(env or {}),
        tty=tty,
        rows=max(0, min(rows, _MAX_SIZE)),
        cols=max(0, min(cols, _MAX_SIZE)),
        pull_progress=on_pull is not None,
        gpu_memory=gpu_memory,
    )
    target = node.peer(peer)
    async with node.session(target.node_id) as session:
        stream = session.open_stream()
        stream.send_message(start)
        first = await stream.read_message()
        while on_pull is not None and isinstance(first, ImagePull):
            on_pull(first)
            first = await stream.read_message()
        if not isinstance(first, ExecStarted):
            raise ProtocolError(f"{target.name} answered a shell with {type(first).__name__}")
        reply = first
        if gpu_memory and not reply.gpus:
            # A provider from before ExecStart.gpu_memory ignored it: no GPU in there.
            raise AgentError(
                f"{reply.provider} opened the shell without a GPU: its gpumesh is too old "
                "for `exec --gpu-memory`; ask its owner to upgrade (jobs get GPUs meanwhile)"
            )
        shell = ExecSession(stream, tty, reply.provider)
        started(shell)
        pump = asyncio.create_task(_pump_input(stream, source, tty))
        receiver = asyncio.create_task(_receive(stream, sink, reply.provider))
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
            if not receiver.done():
                # The program did not end (hang-up, Ctrl-C, a failure): reset its
                # stream, so the provider removes the container now, also when the
                # session stays open after it (a node process's warm one).
                stream.abort()
            for task in (pump, receiver):
                task.cancel()
            for task in (pump, receiver):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


async def _pump_input(stream: Stream, source: AsyncIterable[bytes], tty: bool) -> None:
    """Local input -> DATA frames; at its end, an empty DATA frame (stdin EOF)."""
    async for data in source:
        if data:
            await stream.send_data(data)
    if tty:
        raise _TerminalClosed
    stream.end_data()


async def _receive(stream: Stream, sink: ByteSink, provider: str) -> int:
    """Provider -> output until ExecExit; returns the exit code."""
    while True:
        frame = await stream.read_frame()
        if frame is None:
            raise ConnectionLostError(f"{provider} ended the shell without its exit status")
        if frame.kind is FrameKind.DATA:
            if frame.body:
                await sink(frame.body)
            continue
        message = decode_message(frame.body)
        if isinstance(message, ExecExit):
            return message.exit_code
        if isinstance(message, Refusal):
            raise error_from_code(message.code, message.message)
        raise ProtocolError(f"{provider} sent {type(message).__name__} during a shell session")
