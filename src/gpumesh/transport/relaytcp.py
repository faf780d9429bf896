"""The relay over TCP and TLS, for networks that block UDP.

A :class:`RelayStream` is one TLS connection to ``gpumesh-relay``'s TCP
listener (through an HTTP proxy's ``CONNECT`` when ``HTTPS_PROXY`` says so),
upgraded to the relay's stream (:mod:`gpumesh.protocol.relaystream`), that
carries the same relay packets as UDP. The relay client
(:mod:`gpumesh.transport.relayclient`) races one against UDP and uses it when
UDP to the relay gets no answer.

The relay's certificate is not checked, on purpose: nodes do not depend on
it (the registration is signed, the relayed QUIC inside is authenticated end
to end and pinned to the peer's key), so a TLS-inspecting middlebox that
presents its own certificate passes. TLS is there to look like HTTPS.

Every failure is one line naming the step that failed (the proxy, the TCP
connection, the TLS handshake, the upgrade) as :class:`UnreachableError`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import ssl
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpumesh.errors import ProtocolError, UnreachableError
from gpumesh.protocol import relay as wire
from gpumesh.protocol import relaystream as stream
from gpumesh.protocol.addresses import format_address, parse_address

__all__ = [
    "DEFAULT_TCP_PORT",
    "RelayStream",
    "RelayTcp",
    "open_relay_stream",
    "proxy_from_environment",
    "relay_tcp_round_trip",
    "tcp_route",
]

logger = logging.getLogger(__name__)

DEFAULT_TCP_PORT = 443
WRITE_BUFFER_LIMIT = 256 * 1500
"""Bytes a stream may hold unsent; packets beyond are dropped, as a full UDP socket
would (QUIC inside resends them and slows down)."""
_READ_SIZE = 256 * 1024


@dataclass(frozen=True)
class RelayTcp:
    """Where a relay takes TCP, and how to get there."""

    host: str
    port: int
    proxy: str = ""
    """``http://[user:pass@]host:port`` of an HTTP proxy to cross with CONNECT, or empty."""
    udp_retry: float = 30.0
    """Seconds between tries of UDP while the registration rides TCP."""

    @property
    def label(self) -> str:
        return format_address((self.host, self.port))


def proxy_from_environment() -> str:
    """``HTTPS_PROXY`` (or ``https_proxy``), as curl reads it; empty when unset."""
    return os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or ""


def tcp_route(
    relay: str, setting: str, *, udp_retry: float, proxy: str | None = None
) -> RelayTcp | None:
    """The TCP route to the relay ``relay`` (``host[:port]``): ``setting`` is the node's
    ``relay_tcp`` (``HOST:PORT``; empty for the relay host's port 443; ``off``: none);
    ``proxy`` defaults to this process's ``HTTPS_PROXY``."""
    if proxy is None:
        proxy = proxy_from_environment()
    if setting == "off":
        return None
    try:
        host, port = parse_address(setting or relay, DEFAULT_TCP_PORT)
        if not setting:
            port = DEFAULT_TCP_PORT
    except ValueError:
        return None  # the setting is checked where it is set; a bad hint has no TCP route
    return RelayTcp(host, port, proxy, udp_retry)


def _proxy_address(proxy: str) -> tuple[str, int, str]:
    """``(host, port, Proxy-Authorization value)`` of an ``http://`` proxy URL."""
    url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if url.scheme != "http" or not url.hostname:
        raise UnreachableError(
            f"HTTPS_PROXY {proxy!r} is not an http:// proxy (e.g. http://proxy.example.org:3128)"
        )
    try:
        port = url.port or 80
    except ValueError:
        raise UnreachableError(f"HTTPS_PROXY {proxy!r} has an invalid port") from None
    auth = ""
    if url.username is not None:
        user = urllib.parse.unquote(url.username)
        password = urllib.parse.unquote(url.password or "")
        auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    return url.hostname, port, auth


def _client_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # see the module's docstring
    context.set_alpn_protocols(["http/1.1"])
    return context


async def _read_head(reader: asyncio.StreamReader, what: str) -> bytes:
    try:
        return await reader.readuntil(stream.HEAD_END)
    except asyncio.IncompleteReadError:
        raise UnreachableError(f"{what} closed the connection") from None
    except asyncio.LimitOverrunError:
        raise UnreachableError(f"{what} sent an HTTP head too long to read") from None


def _why(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(text)


async def _open(route: RelayTcp) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    target = route.label
    context = _client_context()
    if route.proxy:
        host, port, auth = _proxy_address(route.proxy)
        proxy = format_address((host, port))
        try:
            reader, writer = await asyncio.open_connection(host, port, limit=_READ_SIZE)
        except OSError as exc:
            raise UnreachableError(f"cannot reach the proxy {proxy}: {_why(exc)}") from None
        writer.write(stream.connect_request(target, auth))
        head = await _read_head(reader, f"the proxy {proxy}")
        _expect(
            writer,
            head,
            200,
            odd=f"the proxy {proxy} answered CONNECT oddly",
            other=f"the proxy {proxy} refused CONNECT to {target}",
        )
        try:
            await writer.start_tls(context, server_hostname=route.host)
        except (ssl.SSLError, OSError) as exc:
            writer.close()
            raise UnreachableError(
                f"TLS to {target} through the proxy {proxy} failed: {_why(exc)}"
            ) from None
    else:
        try:
            reader, writer = await asyncio.open_connection(
                route.host, route.port, ssl=context, server_hostname=route.host, limit=_READ_SIZE
            )
        except ssl.SSLError as exc:
            raise UnreachableError(
                f"TLS to {target} failed (a middlebox broke it?): {_why(exc)}"
            ) from None
        except OSError as exc:
            raise UnreachableError(f"TCP to {target}: {_why(exc)}") from None
    writer.write(stream.upgrade_request(target))
    head = await _read_head(reader, target)
    not_relay = f"{target} is not a gpumesh relay over TCP"
    _expect(writer, head, 101, odd=not_relay, other=f"{not_relay}, it answered")
    return reader, writer


def _expect(
    writer: asyncio.StreamWriter, head: bytes, wanted: int, *, odd: str, other: str
) -> None:
    """An HTTP answer with the status ``wanted``; else the connection is closed and the
    error is ``odd`` (not HTTP) or ``other`` (another status), with what came."""
    try:
        code, status = stream.head_status(head)
    except ProtocolError as exc:
        writer.close()
        raise UnreachableError(f"{odd}: {exc}") from None
    if code != wanted:
        writer.close()
        raise UnreachableError(f"{other}: {status}")


async def open_relay_stream(
    route: RelayTcp,
    on_packets: Callable[[list[bytes]], None],
    *,
    timeout: float,
) -> RelayStream:
    """A stream to the relay at ``route``, reading into ``on_packets`` until it closes."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await _open(route)
    except TimeoutError:
        via = f" through the proxy {route.proxy}" if route.proxy else ""
        raise UnreachableError(
            f"TCP to {route.label}{via}: no answer within {timeout:.0f}s"
        ) from None
    except (ssl.SSLError, OSError) as exc:
        raise UnreachableError(f"TCP to {route.label}: {_why(exc)}") from None
    return RelayStream(route, reader, writer, on_packets)


class RelayStream:
    """One upgraded TLS connection to the relay: relay packets both ways."""

    def __init__(
        self,
        route: RelayTcp,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_packets: Callable[[list[bytes]], None],
    ) -> None:
        self.route = route
        self._reader = reader
        self._writer = writer
        self._on_packets = on_packets
        self._deframer = stream.Deframer()
        self.closed = asyncio.Event()
        self.why = ""
        """Why the stream ended, once it has."""
        self.dropped = 0
        """Packets dropped because the connection had too much unsent."""
        self._task = asyncio.create_task(self._read(), name=f"relay tcp {route.label}")

    def send(self, packets: list[bytes]) -> None:
        """Frame and write ``packets``; dropped when too much is waiting already."""
        if self.closed.is_set() or not packets:
            return
        transport = self._writer.transport
        if transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
            self.dropped += len(packets)
            return
        try:
            self._writer.write(stream.encode_frames(packets))
        except (ProtocolError, RuntimeError, OSError) as exc:
            self._end(f"cannot write: {exc}")

    def close(self) -> None:
        self._end("closed by this node")
        self._task.cancel()

    def _end(self, why: str) -> None:
        if self.closed.is_set():
            return
        self.why = why
        self.closed.set()
        with contextlib.suppress(Exception):
            self._writer.close()

    async def _read(self) -> None:
        why = "the relay closed the TCP connection"
        try:
            while True:
                data = await self._reader.read(_READ_SIZE)
                if not data:
                    break
                packets = self._deframer.feed(data)
                if packets:
                    self._on_packets(packets)
        except asyncio.CancelledError:
            raise
        except ProtocolError as exc:
            why = f"the relay sent a bad frame: {exc}"
        except (ssl.SSLError, OSError) as exc:
            why = f"the TCP connection to the relay broke: {_why(exc)}"
        except Exception:  # a bug must end this stream, never the node
            logger.exception("relay stream %s failed", self.route.label)
            why = "the TCP connection to the relay failed"
        self._end(why)


async def relay_tcp_round_trip(
    host: str, port: int, *, proxy: str | None = None, timeout: float = 3.0
) -> float:
    """Seconds from a Hello to the relay's Challenge over a fresh TCP stream (the
    stream's own setup not counted); :class:`UnreachableError` naming the failed step."""
    answered: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    def on_packets(packets: list[bytes]) -> None:
        for packet in packets:
            with contextlib.suppress(ProtocolError):
                challenge = isinstance(wire.decode_packet(packet), wire.Challenge)
                if challenge and not answered.done():
                    answered.set_result(time.monotonic())

    route = RelayTcp(host, port, proxy or "")
    relay = await open_relay_stream(route, on_packets, timeout=timeout)
    try:
        sent = time.monotonic()
        relay.send([wire.hello_packet()])
        closed = asyncio.ensure_future(relay.closed.wait())
        try:
            waiting: set[asyncio.Future[Any]] = {answered, closed}
            await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        if answered.done():
            return answered.result() - sent
        if relay.closed.is_set():
            raise UnreachableError(f"TCP to {route.label}: {relay.why}")
        raise UnreachableError(f"TCP to {route.label}: no Challenge within {timeout:.0f}s")
    finally:
        relay.close()
