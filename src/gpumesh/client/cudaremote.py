"""The consumer's CUDA link: a local byte stream carried to a provider's CUDA session.

Owns the consumer's side of ``CudaOpen``: one local connection (a socket pair
inside :class:`~gpumesh.client.cudadevice.RemoteDevice`, or a program's connection
to ``gpumesh cuda bridge``) is one CUDA session on the peer. The call
protocol's bytes (:mod:`gpumesh.protocol.cuda`) go through unchanged both ways,
so this side parses none of them; what the link itself has to say (the
provider refused, the session was revoked, the link dropped) reaches the local
program as the protocol's ``END`` frame, one line with an error code.

The bridge (:class:`Bridge`) listens on loopback TCP or a unix socket. On
Linux a TCP connection is accepted only from a process of this user (its
socket's owner, looked up in ``/proc/net/tcp`` by
:mod:`gpumesh.transport.sockowner`, which refuses what it cannot prove); a unix
socket is made 0600, and is the way to prefer.
Where neither check is possible the bridge refuses to start on TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gpumesh.errors import (
    AccessDeniedError,
    ConfigError,
    GPUMeshError,
    InUseError,
    ProtocolError,
    error_from_code,
)
from gpumesh.protocol.cuda import end_frame
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import CudaOpen, CudaOpened, Refusal, decode_message
from gpumesh.transport.sockowner import connection_owner, owner_check_available

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.transport.session import Session
    from gpumesh.transport.stream import Stream

__all__ = ["DEFAULT_MEMORY", "Bridge", "carry_socket", "parse_bind"]

logger = logging.getLogger(__name__)

DEFAULT_MEMORY = 1024**3
"""Device memory a session asks for unless told otherwise."""
_CHUNK = 1024 * 1024


class _Local:
    """The local program's side of a session: bytes in, bytes out."""

    async def read(self) -> bytes | memoryview:
        """The next bytes the program sent; empty when it closed its side."""
        raise NotImplementedError

    async def write(self, data: bytes | memoryview) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class _StreamsLocal(_Local):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def read(self) -> bytes:
        return await self.reader.read(_CHUNK)

    async def write(self, data: bytes | memoryview) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, RuntimeError):
            await self.writer.wait_closed()


class _SocketLocal(_Local):
    """A connected socket read straight into fresh 1 MiB buffers: a copy crosses
    once (the socket into the buffer QUIC sends from), not through a stream's
    buffer and out of it again."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    async def read(self) -> memoryview:
        buffer = bytearray(_CHUNK)
        count = await self.loop.sock_recv_into(self.sock, buffer)
        return memoryview(buffer)[:count]

    async def write(self, data: bytes | memoryview) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


async def carry_socket(
    node: Node,
    peer: str,
    memory: int,
    sock: socket.socket,
    on_session: Callable[[Session], None] | None = None,
) -> None:
    """Carry a connected socket's CUDA session (a
    :class:`~gpumesh.client.cudadevice.RemoteDevice`'s socket pair) to ``peer``, this
    loop reading and writing the socket itself: the faster way. ``on_session`` gets
    the QUIC session the CUDA stream runs on (a benchmark times plain requests on it)."""
    await _carry(node, peer, memory, _SocketLocal(sock), on_session)


async def _carry(
    node: Node,
    peer: str,
    memory: int,
    local: _Local,
    on_session: Callable[[Session], None] | None = None,
) -> None:
    """Carry one local connection's CUDA session to ``peer`` until either side ends.

    Failures reach the local side as an END frame; this returns normally.
    """
    try:
        target = node.peer(peer)
        async with node.session(target.node_id) as session:
            if on_session is not None:
                on_session(session)
            stream = session.open_stream()
            stream.send_message(CudaOpen(memory=memory))
            opened = await stream.expect(CudaOpened)
            await _pump(stream, local, opened.provider)
    except GPUMeshError as exc:
        with contextlib.suppress(OSError, RuntimeError):
            await local.write(end_frame(exc.code, exc.message))
    finally:
        await local.close()


async def _pump(stream: Stream, local: _Local, provider: str) -> None:
    outgoing = asyncio.create_task(_local_to_peer(stream, local))
    try:
        while True:
            frame = await stream.read_frame()
            if frame is None:
                return  # the provider closed the session
            if frame.kind is FrameKind.DATA:
                if frame.body:
                    await local.write(frame.body)
                continue
            message = decode_message(frame.body)
            if isinstance(message, Refusal):
                raise error_from_code(message.code, message.message)
            raise ProtocolError(f"{provider} sent {type(message).__name__} in a CUDA session")
    except (ConnectionResetError, BrokenPipeError):
        return  # the local program went away; leaving closes the stream
    finally:
        outgoing.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await outgoing


async def _local_to_peer(stream: Stream, local: _Local) -> None:
    while data := await local.read():
        await stream.send_data(data)
    stream.finish()  # the program closed its side: the worker ends the session


# --- the bridge ----------------------------------------------------------------------------


def parse_bind(text: str) -> tuple[str, int] | Path:
    """``HOST:PORT`` on loopback, or ``unix:PATH``."""
    if text.startswith("unix:"):
        return Path(text[5:]).expanduser()
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(
            f"--bind {text!r} is not HOST:PORT on loopback (127.0.0.1:17999) or unix:PATH"
        ) from None
    if not sep or not 0 <= port < 65536:
        raise ConfigError(f"--bind {text!r}: the port must be 0 to 65535")
    if not address.is_loopback:
        raise ConfigError(
            f"--bind {text!r} is not a loopback address: the bridge serves programs on "
            "this machine only (use 127.0.0.1 or ::1)"
        )
    return host, port


class Bridge:
    """``gpumesh cuda bridge``: local programs' CUDA sessions on ``peer``."""

    def __init__(self, node: Node, peer: str, bind: str, memory: int = DEFAULT_MEMORY) -> None:
        self.node = node
        self.peer = peer
        self.memory = memory
        self.where = parse_bind(bind)
        self._server: asyncio.Server | None = None
        self.sessions = 0
        """Local connections carried so far."""

    async def start(self) -> str:
        """Listen; returns the address programs use (``RemoteDevice.bridge(...)``)."""
        self.node.peer(self.peer)  # an unknown peer fails here, not per connection
        where = self.where
        try:
            if isinstance(where, Path):
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISSOCK(os.lstat(where).st_mode):
                        where.unlink()  # a stale socket from an earlier bridge
                old = os.umask(0o177)
                try:
                    self._server = await asyncio.start_unix_server(self._serve, path=str(where))
                finally:
                    os.umask(old)
                return f"unix:{where}"
            if not owner_check_available():
                raise ConfigError(
                    "this system cannot tell which user connects over TCP: use "
                    "--bind unix:PATH (only you can open it)"
                )
            host, port = where
            self._server = await asyncio.start_server(self._serve, host, port)
        except OSError as exc:
            raise InUseError(f"cannot listen on {self._text()}: {exc.strerror or exc}") from exc
        sockname = self._server.sockets[0].getsockname()
        host = sockname[0]
        return f"[{host}]:{sockname[1]}" if ":" in host else f"{host}:{sockname[1]}"

    def _text(self) -> str:
        where = self.where
        return f"unix:{where}" if isinstance(where, Path) else f"{where[0]}:{where[1]}"

    async def serve_forever(self) -> None:
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if isinstance(self.where, Path):
            with contextlib.suppress(OSError):
                self.where.unlink()

    def _check_user(self, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            return  # the socket file is 0600: only this user opens it
        try:
            owner = None if sock is None else connection_owner(sock)
        except OSError:  # the other end is already gone
            owner = None
        if owner != os.getuid():
            who = f"uid {owner}'s" if owner is not None else "of no provable owner"
            raise AccessDeniedError(
                f"the CUDA bridge serves only its own user's programs (this connection is "
                f"{who}); use --bind unix:PATH, a socket only you can open"
            )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self._check_user(writer)
        except AccessDeniedError as exc:
            logger.warning("%s", exc)
            with contextlib.suppress(OSError, RuntimeError):
                writer.write(end_frame(exc.code, exc.message))
                await writer.drain()
            writer.close()
            return
        self.sessions += 1
        await _carry(self.node, self.peer, self.memory, _StreamsLocal(reader, writer))
