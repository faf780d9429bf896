"""What sits between a node and the relay on networks that block UDP, for tests: an
HTTP CONNECT proxy (one that may refuse), a TLS-terminating proxy that presents its
own certificate and re-encrypts to the relay, and a middlebox that breaks TLS.

They run on an asyncio loop in a thread of the test process, on real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from gpumesh.relay.tcp import self_signed_certificate

__all__ = ["Middleboxes", "middleboxes", "self_signed"]

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A certificate and key nobody signed (made as the relay makes its own), as files."""
    cert, key = self_signed_certificate()
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert)
    key_path.write_bytes(key)
    return cert_path, key_path


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))


class Middleboxes:
    """Servers on one loop in a thread; each ``start_*`` returns the port it listens on."""

    def __init__(self, host: str, folder: Path) -> None:
        self.host = host
        self.folder = folder
        self.connects: list[str] = []
        """Targets the CONNECT proxy was asked for."""
        self.terminated: list[bytes] = []
        """What the TLS-terminating proxy read in the clear first, per connection."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._servers: list[asyncio.Server] = []
        self._writers: set[asyncio.StreamWriter] = set()

    def _serve(self, handler: Handler, ssl_context: ssl.SSLContext | None = None) -> int:
        async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._writers.add(writer)
            try:
                await handler(reader, writer)
            finally:
                with contextlib.suppress(Exception):
                    writer.close()

        async def start() -> int:
            server = await asyncio.start_server(tracked, self.host, 0, ssl=ssl_context)
            self._servers.append(server)
            port: int = server.sockets[0].getsockname()[1]
            return port

        return asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)

    def start_connect_proxy(self, *, refuse: bool = False) -> int:
        """An HTTP proxy that tunnels CONNECT (or answers 403 to it)."""

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                writer.close()
                return
            method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
            self.connects.append(target)
            if method != "CONNECT" or refuse:
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                writer.close()
                return
            host, _, port = target.rpartition(":")
            try:
                upstream = await asyncio.open_connection(host, int(port))
            except OSError:
                writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                writer.close()
                return
            self._writers.add(upstream[1])
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await _splice((reader, writer), upstream)

        return self._serve(handle)

    def start_tls_terminator(self, upstream_host: str, upstream_port: int) -> int:
        """A proxy that ends the node's TLS with a certificate of its own and opens its
        own TLS to the relay (what a TLS-inspecting middlebox does)."""
        cert, key = self_signed(self.folder, "middlebox")
        server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_side.load_cert_chain(cert, key)
        client_side = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client_side.check_hostname = False
        client_side.verify_mode = ssl.CERT_NONE

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                self.terminated.append(head)
                upstream = await asyncio.open_connection(
                    upstream_host, upstream_port, ssl=client_side
                )
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                writer.close()
                return
            self._writers.add(upstream[1])
            upstream[1].write(head)
            await _splice((reader, writer), upstream)

        return self._serve(handle, server_side)

    def start_web_server(self) -> int:
        """An HTTPS server that is no relay: 404 to whatever it is asked."""
        cert, key = self_signed(self.folder, "web")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, ssl.SSLError):
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()

        return self._serve(handle, context)

    def start_tls_breaker(self) -> int:
        """A middlebox that answers a TLS hello with something that is not TLS."""

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                await reader.read(1024)
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
            writer.close()

        return self._serve(handle)

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
            for writer in self._writers:
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for server in self._servers:
                await server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@contextlib.contextmanager
def middleboxes(host: str, folder: Path) -> Iterator[Middleboxes]:
    boxes = Middleboxes(host, folder)
    try:
        yield boxes
    finally:
        boxes.close()
