"""Shells of ``gpumesh exec`` run by the node process, their bytes on a socket of
their own.

``POST /api/v1/shells`` checks the request and opens a listener for one
connection: a unix socket in the home (0600 in the 0700 home) where the system
has them, else loopback TCP, with a one-time token the answer carries (only
the owner's control socket, or a bearer-token client, gets it). The CLI connects,
sends the token, and the two then exchange frames (:mod:`gpumesh.daemon.frames`):
keys and resizes one way; the program's start, output, the provider's image pull
and the exit code the other. The session itself is the client layer's
:func:`gpumesh.client.exec.exec_shell` over the node process's warm session. A
listener nobody connects to within :data:`CONNECT_TIMEOUT` seconds goes; the
CLI leaving ends the session (the provider removes the container).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from gpumesh import platform
from gpumesh.client.exec import exec_shell
from gpumesh.client.views import ErrorView
from gpumesh.client.views.runs import PullingView
from gpumesh.control.views import ShellOfferView
from gpumesh.daemon import frames
from gpumesh.errors import GPUMeshError
from gpumesh.store.sockets import socket_name

if TYPE_CHECKING:
    from gpumesh.client.bodies import ShellRequest
    from gpumesh.client.exec import ExecSession
    from gpumesh.client.node import Node
    from gpumesh.protocol.messages import ImagePull

__all__ = ["CONNECT_TIMEOUT", "ShellOfferView", "Shells"]

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 30.0
"""Seconds a shell's listener waits for its CLI to connect."""


@dataclass
class Shells:
    """The node process's shells: listeners waiting for their CLI, and sessions."""

    home: Path
    busy: Callable[[int], None] = lambda change: None
    """Told +1 when a session starts and -1 when it ends (the node's idleness)."""
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def offer(self, node: Node, request: ShellRequest) -> ShellOfferView:
        token = secrets.token_urlsafe(32)
        name = f"shell-{secrets.token_hex(6)}.sock"
        listener, path = _listener(self.home, name)
        done = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if done.is_set():  # one connection only
                writer.close()
                return
            try:
                first = await asyncio.wait_for(frames.read_frame(reader), CONNECT_TIMEOUT)
            except (TimeoutError, frames.FrameError, OSError):
                first = None
            if (
                first is None
                or first[0] != frames.TOKEN
                or not hmac.compare_digest(first[1], token.encode())
            ):
                writer.close()
                return
            done.set()
            self.busy(1)
            try:
                await _session(node, request, reader, writer)
            finally:
                self.busy(-1)
                with contextlib.suppress(OSError):
                    writer.close()

        server = await asyncio.start_server(handle, sock=listener)

        async def serve() -> None:
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), CONNECT_TIMEOUT)
            finally:
                server.close()  # no second connection; the one taken goes on
                if path is not None:
                    with contextlib.suppress(OSError):
                        path.unlink()

        task = asyncio.ensure_future(serve())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        port = 0 if path is not None else int(listener.getsockname()[1])
        return ShellOfferView(socket="" if path is None else str(path), port=port, token=token)


def _listener(home: Path, name: str) -> tuple[socket.socket, Path | None]:
    """A listening socket for one shell: a unix socket in ``home`` (its path), or
    loopback TCP where the system has no unix sockets (None)."""
    if platform.has("unix"):
        path = home / name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with socket_name(home, name) as bound:
                sock.bind(bound)
            os.chmod(path, 0o600)
            sock.listen(1)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        return sock, path
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    sock.setblocking(False)
    return sock, None


async def _session(
    node: Node, request: ShellRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """One shell: frames in, the session's frames out, until it ends."""

    shell: list[ExecSession] = []
    pending: list[tuple[int, int]] = []

    async def source() -> AsyncIterator[bytes]:
        while True:
            try:
                item = await frames.read_frame(reader)
            except (frames.FrameError, OSError):
                return
            if item is None or item[0] == frames.EOF:
                return
            kind, payload = item
            if kind == frames.DATA:
                yield payload
            elif kind == frames.RESIZE:
                try:
                    size = frames.resize_of(payload)
                except frames.FrameError:
                    return
                if shell:
                    shell[0].resize(*size)
                else:
                    pending[:] = [size]

    async def sink(data: bytes) -> None:
        writer.write(frames.frame(frames.DATA, data))
        await writer.drain()

    def started(session: ExecSession) -> None:
        shell.append(session)
        writer.write(frames.frame(frames.STARTED))
        if pending:
            session.resize(*pending[0])

    def on_pull(pull: ImagePull) -> None:
        view = PullingView(
            pull.image, pull.layers, pull.layers_done, pull.downloaded, pull.total, pull.done
        )
        writer.write(frames.frame(frames.PULL, msgspec.json.encode(view)))

    try:
        code = await exec_shell(
            node,
            request.peer,
            list(request.command) or ["sh"],
            source=source(),
            sink=sink,
            image=request.image,
            env=request.env,
            tty=request.tty,
            size=(request.rows, request.cols) if request.tty else None,
            started=started,
            on_pull=on_pull,
            gpu_memory=request.gpu_memory,
        )
        last = frames.frame(frames.EXIT, code.to_bytes(4, "big", signed=True))
    except GPUMeshError as exc:
        last = frames.frame(frames.FAILED, msgspec.json.encode(ErrorView(exc.code, exc.message)))
    except OSError:
        return  # the CLI left
    with contextlib.suppress(OSError):
        writer.write(last)
        await writer.drain()
