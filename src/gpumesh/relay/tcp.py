"""The relay over TCP with TLS: the listener, its connections and its certificate.

Where UDP is blocked, a node reaches the relay over TLS on TCP (443 by default)
and asks for an upgrade inside (:mod:`gpumesh.protocol.relaystream`); after
``101`` both ways carry the relay's own packets, framed. Each upgraded
connection is one address to the :class:`~gpumesh.protocol.relaycore.RelayCore`
(:func:`~gpumesh.protocol.relaycore.tcp_address`), so registration, access, limits and
refusals are the core's, as over UDP; this module moves packets between a
connection and the core and decides nothing about who may send what.

What it owns: the listening socket; per connection its slot (taken before the
TLS handshake, so a flood of strangers is turned away for the price of an
accept), its deadlines (TLS and the upgrade head within ``head_timeout``, a
registration within ``registration_timeout`` and kept), its deframer and its
write bound: with about ``queue`` full-size packets unsent, more for it are
dropped, as a full UDP queue drops them (the QUIC inside recovers). What it
must never do: hold unbounded data for a peer, or let a registration outlive
its connection.

The certificate protects nobody: nodes do not check it, since everything they
say is authenticated inside. It only makes the stream look like HTTPS to what
lies between.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import logging
import socket
import ssl
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpumesh.errors import ConfigError, ProtocolError
from gpumesh.protocol.addresses import Address
from gpumesh.protocol.relay import MAX_PACKET
from gpumesh.protocol.relaycore import RelayCore, Send, address_text, tcp_address
from gpumesh.protocol.relaystream import (
    FRAME_HEADER,
    HEAD_END,
    MAX_HEAD,
    NOT_FOUND,
    UPGRADED,
    Deframer,
    encode_frames,
    is_upgrade_request,
)
from gpumesh.relay.config import RelayConfig

__all__ = [
    "CLOSE_GRACE",
    "HEAD_TIMEOUT",
    "TcpListenError",
    "TcpListener",
    "self_signed_certificate",
    "tls_context",
]

logger = logging.getLogger(__name__)

HEAD_TIMEOUT = 5.0
"""Seconds a connection has from its accept to finish TLS and send its upgrade head."""
CLOSE_GRACE = 2.0
"""Seconds connections get at shutdown to take their goodbyes before they are cut."""
FULL_PACKET = 1500
"""Bytes counted per packet a connection may hold unsent (``queue`` of them)."""
_EARLY_LIMIT = MAX_HEAD + 4 * (FRAME_HEADER + MAX_PACKET)
"""Bytes held from a connection whose TLS ended before its transport was handed over."""
_BACKLOG = 512


class TcpListenError(OSError):
    """The TCP address cannot be listened on; the text says where and why."""


# --- the certificate --------------------------------------------------------------------------


def self_signed_certificate(now: datetime.datetime | None = None) -> tuple[bytes, bytes]:
    """``(certificate PEM, key PEM)``: a fresh ECDSA P-256 key, self-signed, the usual
    shape of a web server's certificate; made at each start, never stored."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpumesh-relay")])
    start = now or datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - datetime.timedelta(days=1))
        .not_valid_after(start + datetime.timedelta(days=365))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def tls_context(config: RelayConfig) -> tuple[ssl.SSLContext, str]:
    """The listener's TLS context and what it presents, in words for the log.

    ``config.tls_cert`` and ``tls_key`` when given (ConfigError naming the file and
    what is wrong with it), else a self-signed certificate made now.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    if config.tls_cert is None or config.tls_key is None:
        cert_pem, key_pem = self_signed_certificate()
        # The ssl module loads a chain from files only; these live for the next line.
        with tempfile.TemporaryDirectory(prefix="gpumesh-relay-") as folder:
            cert_path, key_path = Path(folder, "cert.pem"), Path(folder, "key.pem")
            cert_path.write_bytes(cert_pem)
            key_path.touch(mode=0o600)
            key_path.write_bytes(key_pem)
            context.load_cert_chain(cert_path, key_path)
        return context, "a self-signed certificate made at start"
    _check_pair(config.tls_cert, config.tls_key)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key, password=b"")
    except (OSError, ssl.SSLError) as exc:  # what the checks above did not catch
        raise ConfigError(
            f"cannot use the TLS certificate {config.tls_cert} with the key {config.tls_key}: {exc}"
        ) from None
    return context, f"the certificate {config.tls_cert}"


def _check_pair(cert_path: Path, key_path: Path) -> None:
    """ConfigError with a line an operator can act on, unless the files hold a PEM
    certificate and its unencrypted private key."""
    cert_data, key_data = _read(cert_path, "TLS certificate"), _read(key_path, "TLS key")
    try:
        certificate = x509.load_pem_x509_certificates(cert_data)[0]
    except ValueError:
        raise ConfigError(
            f"the TLS certificate {cert_path} holds no PEM certificate "
            "(-----BEGIN CERTIFICATE-----)"
        ) from None
    try:
        key = serialization.load_pem_private_key(key_data, password=None)
    except TypeError:
        raise ConfigError(
            f"the TLS key {key_path} is encrypted: give it unencrypted (chmod 600)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(
            f"the TLS key {key_path} holds no PEM private key (-----BEGIN PRIVATE KEY-----)"
        ) from None
    raw = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if key.public_key().public_bytes(der, raw) != certificate.public_key().public_bytes(der, raw):
        raise ConfigError(f"the TLS key {key_path} is not the key of the certificate {cert_path}")


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


# --- the listener -----------------------------------------------------------------------------


class TcpListener:
    """The TCP side of one relay: connections in, their packets to the core, the core's
    answers and forwards back out, framed."""

    def __init__(
        self,
        config: RelayConfig,
        core: RelayCore,
        *,
        send: Callable[[list[Send]], None],
        clock: Callable[[], float] = time.monotonic,
        head_timeout: float = HEAD_TIMEOUT,
    ) -> None:
        self.config = config
        self.core = core
        self._send = send
        """Sends what the core answers, to UDP and TCP addresses alike (the server's)."""
        self._clock = clock
        self.head_timeout = head_timeout
        self.write_limit = config.queue * FULL_PACKET
        """Bytes a connection may hold unsent before packets for it are dropped."""
        self._context: ssl.SSLContext | None = None
        self._server: asyncio.Server | None = None
        self._address: Address | None = None
        self._connections: dict[Address, _Connection] = {}
        """Every admitted connection not yet gone, by its address to the core."""
        self._per_ip: dict[str, int] = {}
        self._closing = False
        self._empty = asyncio.Event()
        self._empty.set()

    @property
    def address(self) -> Address:
        """``(host, port)`` listened on (the real port when 0 was asked)."""
        if self._address is None:
            raise RuntimeError("the TCP listener is not started")
        return self._address

    @property
    def connection_count(self) -> int:
        """Connections open now, upgraded or not."""
        return len(self._connections)

    async def start(self, context: ssl.SSLContext) -> Address:
        """Listen on ``config.tcp_host``:``tcp_port``; TcpListenError if it cannot."""
        host, port = self.config.tcp_host, self.config.tcp_port or 0
        try:
            sock = _listening_socket(host, port)
        except OSError as exc:
            where = address_text((host, port))
            reason = exc.strerror or str(exc)
            if exc.errno == errno.EACCES and 0 < port < 1024:
                reason += " (a port below 1024 needs root or CAP_NET_BIND_SERVICE)"
            raise TcpListenError(f"{where}: {reason}") from exc
        self._context = context
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _Connection(self), sock=sock, backlog=_BACKLOG
            )
        except BaseException:
            sock.close()
            raise
        self._address = (host, sock.getsockname()[1])
        return self._address

    def send(self, packets: list[bytes], address: Address) -> tuple[int, int]:
        """Write ``packets`` framed to the connection at ``address``: ``(sent, dropped)``.

        All are dropped when the connection holds :attr:`write_limit` bytes unsent;
        none are counted when it is gone (its registration goes with it)."""
        connection = self._connections.get(address)
        if connection is None:
            return 0, 0
        return connection.write(packets)

    def close(self) -> None:
        """Stop accepting; close every connection, upgraded ones after what was written to
        them (the goodbyes), the others at once."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections.values()):
            connection.shut()

    async def wait_closed(self, grace: float = CLOSE_GRACE) -> None:
        """Give connections ``grace`` seconds to finish closing, then cut the rest."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._empty.wait(), grace)
        for connection in list(self._connections.values()):
            connection.cut("the relay is stopping")
        for _ in range(3):  # the cut transports release their sockets on the next turns
            await asyncio.sleep(0)
        if self._server is not None:
            await self._server.wait_closed()

    # --- what connections report --------------------------------------------------------------

    def admit(self, connection: _Connection, address: Address) -> bool:
        """Whether a new connection from ``address`` may have a slot (then it has one)."""
        host = address[0]
        if self._closing or address in self._connections:
            return False
        if len(self._connections) >= self.config.max_registrations:
            logger.debug(
                "refused tcp %s: %d connections", address_text(address), len(self._connections)
            )
            return False
        if self._per_ip.get(host, 0) >= self.config.max_per_ip:
            logger.debug("refused tcp %s: max_per_ip connections from it", address_text(address))
            return False
        self._connections[address] = connection
        self._per_ip[host] = self._per_ip.get(host, 0) + 1
        self._empty.clear()
        return True

    def received(self, packets: list[bytes], address: Address) -> None:
        """Hand an upgraded connection's packets to the core, as UDP datagrams are."""
        if self._closing:
            return  # the core said its goodbyes; nothing more goes out
        now = self._clock()
        out: list[Send] = []
        for packet in packets:
            try:
                out += self.core.handle(packet, address, now)
            except Exception:  # a bug must cost one packet, never the relay
                logger.exception("failed handling a packet from tcp %s", address_text(address))
        self._send(out)

    def released(self, connection: _Connection) -> None:
        """A connection is gone: free its slot, and its registration with it."""
        address = connection.address
        if self._connections.get(address) is not connection:
            return
        del self._connections[address]
        left = self._per_ip.get(address[0], 0) - 1
        if left > 0:
            self._per_ip[address[0]] = left
        else:
            self._per_ip.pop(address[0], None)
        if not self._connections:
            self._empty.set()
        if connection.upgraded and not self._closing:
            self._send(self.core.disconnect(address, self._clock()))

    def context(self) -> ssl.SSLContext:
        if self._context is None:
            raise RuntimeError("the TCP listener is not started")
        return self._context


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (an IPv6 one serves IPv4 too, where the
    OS allows), not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


# --- one connection ---------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One TCP connection: a slot, then TLS, then the upgrade head, then frames.

    The protocol of the plain connection first, then (through ``start_tls``) of
    the TLS one: its slot is taken before any TLS work, and given back exactly
    once, however the connection ends."""

    def __init__(self, listener: TcpListener) -> None:
        self._listener = listener
        self.address: Address = ("", 0)
        self.upgraded = False
        """Answered 101: its frames go to the core, the core's packets come to it."""
        self._raw: asyncio.Transport | None = None
        self._tls: asyncio.Transport | None = None
        self._buffer = bytearray()
        """The head being read (and bytes after it, until the TLS transport is known)."""
        self._deframer = Deframer()
        self._handshake: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._gone = False

    def __repr__(self) -> str:
        return f"tcp {address_text(self.address)}"

    # --- asyncio's calls ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Only the plain connection calls this: start_tls hands the TLS transport back.
        raw = self._raw = cast(asyncio.Transport, transport)
        peer = raw.get_extra_info("peername")
        if not peer:
            raw.abort()
            return
        self.address = tcp_address(str(peer[0]), int(peer[1]))
        if not self._listener.admit(self, self.address):
            self._gone = True
            raw.abort()
            return
        raw.pause_reading()  # the TLS layer reads first: start_tls resumes it
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._listener.head_timeout, self._head_expired)
        self._handshake = loop.create_task(self._start_tls(raw), name=f"gpumesh-relay-{self!r}")

    def data_received(self, data: bytes) -> None:
        if self._gone or self._refused:
            return
        if self.upgraded:
            self._frames(data)
            return
        self._buffer += data
        if self._tls is None:
            if len(self._buffer) > _EARLY_LIMIT:
                self.cut("sent too much before its TLS was set up")
            return
        self._read_head()

    def eof_received(self) -> bool | None:
        return None  # close: a node that stops sending is gone

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._gone:
            logger.debug("%r closed%s", self, f": {exc}" if exc else "")
        self._release()

    # --- the steps ----------------------------------------------------------------------------

    async def _start_tls(self, raw: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        try:
            tls = await loop.start_tls(
                raw,
                self,
                self._listener.context(),
                server_side=True,
                ssl_handshake_timeout=self._listener.head_timeout,
                ssl_shutdown_timeout=CLOSE_GRACE,
            )
        except Exception as exc:  # reset, timed out, not TLS at all
            logger.debug("%r: TLS failed: %s", self, exc)
            self._handshake = None
            self.cut("its TLS failed")
            return
        self._handshake = None
        if tls is None or self._gone:  # it went away during the handshake
            self.cut("it went away")
            return
        self._tls = tls
        if self._buffer:
            self._read_head()

    def _read_head(self) -> None:
        tls = self._tls
        if tls is None:
            return
        end = self._buffer.find(HEAD_END)
        if end < 0:
            if len(self._buffer) >= MAX_HEAD:
                self._not_found()
            return
        end += len(HEAD_END)
        head, rest = bytes(self._buffer[:end]), bytes(self._buffer[end:])
        self._buffer.clear()
        if not is_upgrade_request(head):
            self._not_found()
            return
        tls.write(UPGRADED)
        self.upgraded = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(
            self._listener.config.registration_timeout, self._check_registered
        )
        logger.debug("%r upgraded", self)
        if rest:
            self._frames(rest)

    def _not_found(self) -> None:
        """Answer as a web server does to what is not ours, and close (the head timer
        still cuts it if the close does not finish)."""
        self._refused = True
        self._buffer.clear()
        logger.debug("%r: not an upgrade request, answered 404", self)
        if self._tls is not None:
            self._tls.write(NOT_FOUND)
            self._tls.close()

    def _frames(self, data: bytes) -> None:
        try:
            packets = self._deframer.feed(data)
        except ProtocolError as exc:
            self.cut(str(exc))
            return
        if packets:
            self._listener.received(packets, self.address)

    def _head_expired(self) -> None:
        self._timer = None
        self.cut(f"no upgrade within {self._listener.head_timeout:g}s")

    def _check_registered(self) -> None:
        """Close a connection whose node has not registered, or whose registration has
        expired (it stopped its keep-alives); look again a timeout later."""
        timeout = self._listener.config.registration_timeout
        if not self._listener.core.is_registered(self.address):
            self._timer = None
            self.cut(f"not registered within {timeout:g}s")
            return
        self._timer = asyncio.get_running_loop().call_later(timeout, self._check_registered)

    # --- writing and ending -------------------------------------------------------------------

    def write(self, packets: list[bytes]) -> tuple[int, int]:
        """``(sent, dropped)``: all written framed, all dropped when the TLS transport
        holds :attr:`TcpListener.write_limit` bytes, neither when it is closing."""
        tls = self._tls
        if tls is None or not self.upgraded or self._gone or tls.is_closing():
            return 0, 0
        if tls.get_write_buffer_size() >= self._listener.write_limit:
            return 0, len(packets)
        tls.write(encode_frames(packets))
        return len(packets), 0

    def shut(self) -> None:
        """Close after what was written (the relay is stopping)."""
        if self._tls is not None and self.upgraded and not self._tls.is_closing():
            self._tls.close()
        else:
            self.cut("the relay is stopping")

    def cut(self, why: str) -> None:
        """Close now, dropping whatever is unsent, and give the slot back."""
        if self._gone:
            return
        logger.debug("%r cut: %s", self, why)
        transport = self._tls or self._raw
        self._release()
        if transport is not None:
            transport.abort()

    def _release(self) -> None:
        if self._gone:
            return
        self._gone = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        handshake = self._handshake
        if handshake is not None and handshake is not asyncio.current_task():
            self._handshake = None
            handshake.cancel()
        self._listener.released(self)
