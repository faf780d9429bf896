"""QUIC over asyncio: our own adapter around qh3's sans-I/O ``QuicConnection``.

Why not qh3's ``serve()``/``connect()``: they feed one datagram at a time and
send after each, which means one ACK per datagram and a slow loop. Here one
socket wake-up drains every queued datagram (with GRO, many per syscall),
feeds them to the connection, and collects outgoing datagrams once, which
sets a sane ACK rate and lets GSO send them in few syscalls.

What this module owns: sockets, timers, connection-id demultiplexing, and
byte streams with backpressure. It knows nothing of GPUMesh messages beyond
the frame layer (:mod:`gpumesh.transport.stream`).

Pitfalls it handles (all learned the hard way):

* ``HandshakeCompleted`` is the only "connected" signal, and the moment the
  session's binding (:func:`session_binding`) is taken;
* a peer's streams may first show up out of order (a lost packet): a lower id
  not seen yet is a new stream, not a late frame of an old one;
* ``get_send_buffer_size`` is the only send backpressure signal, and it is
  only meaningful right after ``datagrams_to_send``;
* an application close carries ``code: message`` in the reason phrase so a
  refusal survives the trip (see :func:`close_reason`);
* a packet for no known connection makes no qh3 object unless it is a full-size
  client Initial that the caller admits (see :meth:`QuicEndpoint._incoming`):
  the caller may ask for a stateless Retry first, and an Initial that does not
  decrypt leaves nothing behind.

Other paths plug in through :class:`PacketRoute` (the relay client is one):
the endpoint hands such a route every packet that is not QUIC, and a link
that runs over one of its paths (:class:`LinkPath`) sends through it. This
module names no route: the relay client imports it, never the other way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from qh3 import QuicConfiguration, QuicConnection, QuicConnectionError
from qh3.quic import events as qe
from qh3.tls import (
    SignatureAlgorithm,
    hkdf_expand_label,
    load_pem_private_key,
    load_pem_x509_certificates,
)

from gpumesh import settings
from gpumesh.errors import (
    ConnectionLostError,
    GPUMeshError,
    KeyMismatchError,
    ProtocolError,
    UnreachableError,
    error_from_code,
)
from gpumesh.identity.keys import Identity
from gpumesh.identity.tlscert import public_key_from_spki, self_signed_certificate_pem
from gpumesh.protocol import fec
from gpumesh.protocol.addresses import Address, format_address
from gpumesh.protocol.admission import (
    Admission,
    DropReason,
    InitialHeader,
    RetryTokens,
    encode_retry,
    parse_initial,
)
from gpumesh.protocol.handshake import BINDING_SIZE
from gpumesh.protocol.messages import ALPNS
from gpumesh.transport.reach import unreachable
from gpumesh.transport.stream import RESET_OVER_LIMIT, Stream, over_limit_error
from gpumesh.transport.udp import UdpSocket, open_udp_socket
from gpumesh.version import __version__

__all__ = [
    "APP_ERROR",
    "Buffered",
    "LinkPath",
    "PacketRoute",
    "PeerStreamIds",
    "QuicEndpoint",
    "QuicLink",
    "Recovery",
    "client_configuration",
    "close_reason",
    "fec_secret",
    "server_configuration",
    "session_binding",
]

logger = logging.getLogger(__name__)

CID_LENGTH = 8
APP_ERROR = 0x100
"""Application close code: the reason phrase is ``code: message``."""
MAX_DATAGRAM = 1452 - 8 - fec.TAG
"""QUIC's datagram size: an IPv6 packet of 1500 bytes holds 1452 bytes of UDP
payload, less room for the FEC frame header (6, and a parity symbol's 2) and tag."""
IDLE_TIMEOUT = 60.0
FEC_MODES = ("auto", "on", "off")
FEC_LONG_RTT = 0.025
"""Seconds of round trip from which ``auto`` sends parity from the start: on such a
link one random loss in slow start costs QUIC seconds of a small window."""
EARLY_COPIES = 64
"""Most datagrams each side of a link sends twice before parity can start (see
:meth:`QuicLink._twice`)."""
LOSS_BURST = 8
"""Packets declared lost in one go from which a link logs it (debug)."""
_FEC_MARKERS = (fec.DATA, fec.PARITY)
_STREAM_WINDOW = 16 * 1024 * 1024
_CONNECTION_WINDOW = 64 * 1024 * 1024
SEND_HIGH_WATER = 2 * 1024 * 1024
"""Queued-but-unsent bytes on one stream above which writers wait."""


@dataclass(frozen=True)
class Buffered:
    """What a link holds in memory for its streams."""

    unread: int
    """Bytes received and not yet read by a request handler (and partial frames)."""
    unsent: int
    """Bytes queued to send that QUIC has not sent yet (flow control, congestion)."""

    @property
    def total(self) -> int:
        return self.unread + self.unsent


@dataclass(frozen=True)
class Recovery:
    """What QUIC's loss recovery holds for a link now (qh3's, read from its core)."""

    window: int
    """Congestion window, bytes."""
    in_flight: int
    """Bytes sent and neither acknowledged nor declared lost."""
    smoothed_rtt: float | None
    """Seconds; None before the first sample."""
    lost: int
    """Packets declared lost so far (each one also cut the window, or kept it cut)."""
    probe_timeouts: int
    """Probe timeouts so far (nothing acknowledged for a while)."""


def _base_configuration(is_client: bool, alpns: Sequence[str]) -> QuicConfiguration:
    config = QuicConfiguration(
        is_client=is_client,
        alpn_protocols=list(alpns),
        connection_id_length=CID_LENGTH,
        idle_timeout=IDLE_TIMEOUT,
        max_datagram_size=MAX_DATAGRAM,
        max_stream_data=_STREAM_WINDOW,
        max_data=_CONNECTION_WINDOW,
    )
    return config


def server_configuration(identity: Identity, alpns: Sequence[str] = ALPNS) -> QuicConfiguration:
    """``alpns``: the connection protocols accepted, preferred first."""
    config = _base_configuration(is_client=False, alpns=alpns)
    config.certificate = load_pem_x509_certificates(self_signed_certificate_pem(identity))[0]
    config.private_key = load_pem_private_key(identity.private_pem())
    return config


def client_configuration(alpns: Sequence[str] = ALPNS) -> QuicConfiguration:
    """``alpns``: the connection protocols offered, preferred first."""
    config = _base_configuration(is_client=True, alpns=alpns)
    # No CA: the certificate is self-signed and the caller pins its key instead.
    config.verify_mode = ssl.CERT_NONE
    config.server_name = "gpumesh"
    # qh3 leaves EdDSA out of its default list; our nodes only have Ed25519 keys.
    config.signature_algorithms = [SignatureAlgorithm.ED25519]
    return config


_BINDING_LABEL = b"gpumesh auth"
_FEC_LABEL = b"gpumesh fec"


def session_binding(quic: QuicConnection) -> bytes:
    """A secret of this TLS session that both ends hold once its handshake is done.

    ``HKDF-Expand-Label(master secret, "gpumesh auth", Transcript-Hash(ClientHello
    .. client Finished), 32)``: how TLS 1.3 derives its exporter and resumption
    secrets (RFC 8446 sections 7.1 and 7.5), under a label of our own, because
    qh3 offers no exporter. It depends on both ends' key shares and randoms and on
    the certificate the server sent, so a man in the middle, who runs two sessions
    with different keys, cannot make them share one, and a passive observer never
    learns it. Both ends' key schedules stop at this point after the handshake
    (qh3's server has already hashed the client Finished it expects).
    """
    return _exported(quic, _BINDING_LABEL)


def fec_secret(quic: QuicConnection) -> bytes:
    """The secret this TLS session's FEC keys come from (:class:`fec.FecKeys`).

    Derived as :func:`session_binding` is, under a label of its own, so it shares
    nothing with the binding that the identity proofs sign: a passive observer, or a
    peer's other sessions, never learns it.
    """
    return _exported(quic, _FEC_LABEL)


def _exported(quic: QuicConnection, label: bytes) -> bytes:
    """``HKDF-Expand-Label(master secret, label, Transcript-Hash(ClientHello ..
    client Finished), 32)``, once the handshake is done."""
    tls = quic.tls
    schedule = None if tls is None else tls.key_schedule
    if schedule is None or schedule.generation != 3:  # 3: the master secret
        raise ProtocolError("the TLS handshake did not finish: no session binding")
    return hkdf_expand_label(
        schedule.algorithm,
        schedule.secret,
        label,
        schedule.hash.copy().digest(),
        BINDING_SIZE,
    )


def close_reason(error: GPUMeshError) -> str:
    return f"{error.code}: {error.message}"[:1000]


_TLS_HANDSHAKE_FAILURE = 0x100 + 40
"""QUIC's CRYPTO_ERROR for the TLS alert handshake_failure (RFC 9001, 4.8)."""
_NO_COMMON_ALPN = "No common ALPN protocols"
"""qh3's reason when the two sides share no connection protocol (it sends
handshake_failure, not no_application_protocol, so only the words tell)."""


def _error_from_close(event: qe.ConnectionTerminated) -> GPUMeshError:
    if event.error_code == APP_ERROR and ": " in event.reason_phrase:
        code, message = event.reason_phrase.split(": ", 1)
        return error_from_code(code, message)
    if event.error_code == _TLS_HANDSHAKE_FAILURE and _NO_COMMON_ALPN in event.reason_phrase:
        return ProtocolError(
            f"the peer speaks none of this node's GPUMesh protocol versions "
            f"({', '.join(ALPNS)}; GPUMesh {__version__}): it runs a much newer or "
            "older GPUMesh; upgrade GPUMesh on the older side"
        )
    if event.reason_phrase:
        return ConnectionLostError(f"connection closed by peer: {event.reason_phrase}")
    if event.error_code == 0:
        return ConnectionLostError("connection closed")
    return ConnectionLostError(f"connection lost (QUIC error {event.error_code:#x})")


FEC_DEFAULT = "off"
"""Measured on an idle machine (docs/architecture.md, "Parity is off by default"),
parity made no copy faster at 50 ms / 0.5%, 100 ms / 1% or 100 ms / 2%: it is
there for whoever asks (``auto`` or ``on``), not sent by default."""


def fec_mode() -> str:
    """``auto``, ``on`` or ``off`` (:data:`FEC_DEFAULT`): when links send parity
    (see :class:`QuicLink`)."""
    mode = (settings.env(settings.ENV_FEC) or FEC_DEFAULT).lower()
    return mode if mode in FEC_MODES else FEC_DEFAULT


def _destination_cid(data: bytes) -> bytes | None:
    """The destination connection id of a QUIC packet (RFC 8999 invariants)."""
    if not data:
        return None
    if data[0] & 0x80:
        if len(data) < 6:
            return None
        length = data[5]
        return data[6 : 6 + length] if len(data) >= 6 + length else None
    return data[1 : 1 + CID_LENGTH] if len(data) > CID_LENGTH else None


class PeerStreamIds:
    """Which of a peer's stream ids have been seen: a frame for a stream we keep no
    object for is a new request only the first time.

    Ids only grow as a peer opens streams, but first frames may arrive out of
    order (a lost packet): a lower id not seen yet is new (QUIC opened it with the
    higher one), a lower id seen before is a late frame of a request already
    served. The ids not seen yet are at most the peer's stream limit.
    """

    def __init__(self) -> None:
        self._last: dict[int, int] = {}
        """Highest id seen, per kind of stream (the id modulo 4)."""
        self._unseen: set[int] = set()

    def first_seen(self, stream_id: int) -> bool:
        kind = stream_id % 4
        last = self._last.get(kind, kind - 4)
        if stream_id > last:
            self._unseen.update(range(last + 4, stream_id, 4))
            self._last[kind] = stream_id
            return True
        if stream_id in self._unseen:
            self._unseen.discard(stream_id)
            return True
        return False


class LinkPath(Protocol):
    """The way a link's packets travel when they do not go straight to its address:
    a relayed session, perhaps punched through to a direct address since.

    qh3 knows the peer by the path's :attr:`virtual` address; the endpoint asks
    the path where each datagram goes, so a move from the relay to a punched
    address is invisible to QUIC.
    """

    @property
    def virtual(self) -> Address:
        """The address the link's QUIC connection knows the peer by (no packet comes
        from there: the route hands them over under it)."""
        ...

    def outgoing(self, datagrams: list[bytes]) -> list[tuple[bytes, Address]]:
        """Each QUIC datagram of the link as it leaves the socket, and where to."""
        ...

    def remote_address(self) -> Address:
        """Where packets go now (a punched address, or the relay's)."""
        ...

    def describe(self) -> str:
        """``direct (hole-punched) ADDR`` or ``relayed via RELAY``."""
        ...

    def attach(self, link: QuicLink) -> None:
        """``link`` runs over this path from now on."""
        ...

    def release(self) -> None:
        """The link over this path is gone: the path may end what carried it."""
        ...


class PacketRoute(Protocol):
    """Another user of an endpoint's socket, carrying some of its links over paths of
    its own (:class:`LinkPath`): the relay client, which must share the socket
    whose NAT mapping peers punch through.

    The endpoint hands it every packet that is not QUIC and delivers the QUIC
    datagrams they carried under the path's virtual address; for QUIC packets
    from elsewhere it asks whether a path was punched to their source. The
    route sends its own packets with :meth:`QuicEndpoint.send_raw`.
    """

    @property
    def has_paths(self) -> bool:
        """Whether any path is open (the endpoint's send path skips lookups if not)."""
        ...

    def path_for_virtual(self, address: tuple[Any, ...]) -> LinkPath | None:
        """The path behind a virtual address (qh3 gives IPv6 ones as 4-tuples)."""
        ...

    def from_direct(self, source: Address, now: float) -> Address | None:
        """A QUIC packet came from ``source``: the virtual address of the path punched
        through to there (which hears that it is alive), or None."""
        ...

    def unwrap_run(
        self, buffer: bytes, segment: int, source: Address
    ) -> tuple[Address, list[bytes]] | None:
        """A GRO run of ``segment``-byte packets of one path: its virtual address and
        the QUIC datagrams; None when the run is anything else."""
        ...

    def handle(self, packet: bytes, source: Address, now: float) -> tuple[Address, bytes] | None:
        """One packet that is not QUIC: the ``(virtual address, QUIC datagram)`` it
        carried, or None when it was the route's own (or nothing)."""
        ...

    def close(self) -> None:
        """The endpoint is closing."""
        ...


class QuicLink:
    """One QUIC connection to one peer, carrying many streams."""

    def __init__(
        self,
        endpoint: QuicEndpoint,
        quic: QuicConnection,
        address: Address,
        *,
        validated: bool = False,
        path: LinkPath | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._endpoint = endpoint
        self.quic = quic
        self.address = address
        self.validated = validated
        """Accepting side: the peer is known to receive at ``address`` (it echoed a
        Retry token, came through a relay session, or finished the QUIC handshake)."""
        self._streams: dict[int, Stream] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._transmit_scheduled = False
        self._writable = asyncio.Event()
        self.connected: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[GPUMeshError] = loop.create_future()
        self.on_stream: Callable[[Stream], None] | None = None
        self.alpn: str | None = None
        """The connection protocol both ends agreed on (set when connected)."""
        self.binding = b""
        """This TLS session's binding (:func:`session_binding`, set when connected)."""
        self._fec_secret = b""
        """The secret of this session's FEC keys (:func:`fec_secret`, set when connected)."""
        self.cids: set[bytes] = {quic.host_cid}
        self.path = path
        """The path under this link (a relayed session), or None for a plain direct link."""
        self._peer_streams = PeerStreamIds()
        self.buffer_limit = 0
        """Most bytes the link may hold (:meth:`buffered`) before a stream that would add
        to them is ended (see :mod:`gpumesh.transport.stream`); 0: no limit. The
        provider sets it; a dialer trusts the peer it pinned."""
        self._unread = 0
        # A job can stay silent for hours while its consumer waits: PINGs keep
        # the connection from idling out (a dead peer still times out, since
        # only packets received restart the idle timer).
        self._keepalive_every = IDLE_TIMEOUT / 3
        self._pings = 0
        self._keepalive: asyncio.TimerHandle | None = loop.call_later(
            self._keepalive_every, self._send_keepalive
        )
        self.fec_mode = fec_mode()
        """Whether this link offers FEC and when it sends parity (:func:`fec_mode`)."""
        self.fec_peer = False
        """Whether the peer said it takes FEC frames (:meth:`peer_takes_fec`)."""
        self.fec_encoder: fec.Encoder | None = None
        """Frames outgoing datagrams once parity is on (None: they go out plain)."""
        self.fec_decoder: fec.Decoder | None = None
        """Takes the peer's FEC frames (made at the first one)."""
        self._fec_to: Any = address
        """Where QUIC sent the datagrams of the open group (parity follows them)."""
        self._min_rtt = float("inf")
        self._born = loop.time()
        self._losses_seen = 0
        """QUIC's loss count when :meth:`process_events` last looked (for the debug log
        of a burst of losses)."""
        self._early_copies = EARLY_COPIES if self.fec_offered else 0
        """Datagrams this link may still send twice (:meth:`_twice`)."""
        self.early_duplicates = 0
        """Datagrams sent twice so far."""
        self._allowance = 0
        """Accepting side, until the peer's address is validated: bytes it may still
        send there (three times what came from it, less what went to it)."""
        if path is not None:
            path.attach(self)

    # --- public -------------------------------------------------------------------

    @property
    def is_closed(self) -> bool:
        return self.closed.done()

    def peer_public_key(self) -> bytes:
        """The raw Ed25519 key in the peer's certificate (dialer side only)."""
        cert = self.quic.get_peercert()
        if cert is None:
            raise KeyMismatchError("the peer presented no certificate")
        return public_key_from_spki(cert.public_key())

    def open_stream(self) -> Stream:
        if self.is_closed:
            raise self.closed.result()
        stream_id = self.quic.get_next_available_stream_id()
        stream = Stream(self, stream_id)
        self._streams[stream_id] = stream
        return stream

    def close(self, error: GPUMeshError | None = None) -> None:
        """Close the connection, telling the peer why."""
        if self.is_closed:
            return
        if error is None:
            self.quic.close(error_code=0, reason_phrase="")
        else:
            self.quic.close(error_code=APP_ERROR, reason_phrase=close_reason(error))
        self.transmit_now()  # before _finish: a dialer's socket closes with its link
        self._finish(error or ConnectionLostError("connection closed"))

    def abort(self, error: GPUMeshError) -> None:
        """The path under the link is gone: end it here without telling the peer."""
        if not self.is_closed:
            self._finish(error)

    async def wait_closed(self) -> GPUMeshError:
        return await asyncio.shield(self.closed)

    @property
    def fec_offered(self) -> bool:
        """Whether to tell the peer that this end takes FEC frames."""
        return self.fec_mode != "off"

    def peer_takes_fec(self) -> None:
        """The peer said it takes FEC frames: parity may go to it from now on
        (``auto``: at once on a link with a round trip of :data:`FEC_LONG_RTT` or
        more, else from the link's first loss; ``on``: at once)."""
        if self.fec_offered:
            self.fec_peer = True
            self._maybe_start_parity()

    def _maybe_start_parity(self) -> None:
        if self.fec_encoder is not None or not self.fec_peer:
            return
        rtt = self._least_rtt()
        long_link = rtt != float("inf") and rtt >= FEC_LONG_RTT
        if self.fec_mode == "on" or long_link or self.loss_total() > 0:
            # Keys of this session and direction: group ids differ per link, and a
            # frame of another link (or reflected back) fails its tag.
            self.fec_encoder = fec.Encoder(self._fec_keys(sending=True))
            logger.debug(
                "parity on for %s (rtt %s, QUIC losses so far: %d)",
                self.address,
                rtt,
                self.loss_total(),
            )

    def _least_rtt(self) -> float:
        """The least round trip seen so far (inf before the first sample): the link's
        own, not what queues add under bulk."""
        core = getattr(self.quic, "_core", None)
        sample = None if core is None else core.latest_rtt
        if sample is not None and sample < self._min_rtt:
            self._min_rtt = sample
        return self._min_rtt

    def _twice(self, datagrams: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
        """A link's datagrams before parity can start, each sent twice.

        Parity starts once the peer's Welcome says it takes FEC frames, two round
        trips in; a loss before that (an Initial, the Finished, the proof or the
        first flight of an upload) is one QUIC takes for congestion, and qh3 then
        leaves slow start at a window of a few datagrams for the whole connection
        (an upload's dialer sends some 25 datagrams before parity: at 0.5% loss,
        1 - 0.995^25, about one dial in eight loses one). A copy lost on its own
        costs nothing: QUIC drops the one that comes second as a duplicate. Only
        on a link not known to be short (no round trip seen yet, or the least one
        :data:`FEC_LONG_RTT` or more; ``on``: any), for at most :data:`EARLY_COPIES`
        datagrams. The accepting side copies its handshake flight too (a lost
        ServerHello or certificate costs the same), but until the peer's address is
        validated what it sends there, copies included, stays within three times
        what it received (RFC 9000, 8.1): a copy that would pass it is left out.
        """
        if self.fec_mode != "on" and self._least_rtt() < FEC_LONG_RTT:
            self._early_copies = 0
            return datagrams
        count = min(len(datagrams), self._early_copies)
        if self._unvalidated():
            spare = self._allowance - sum(len(data) for data, _ in datagrams)
            fit = 0
            for data, _ in datagrams[:count]:
                if len(data) > spare:
                    break
                spare -= len(data)
                fit += 1
            count = fit
        self._early_copies -= count
        self.early_duplicates += count
        twice = [item for item in datagrams[:count] for _ in (0, 1)]
        return twice + datagrams[count:]

    def _log_loss_burst(self) -> None:
        """Log (debug) when QUIC declared several packets lost at once: what the link's
        recovery, parity and path were then."""
        lost = self.loss_total()
        burst, self._losses_seen = lost - self._losses_seen, lost
        if burst >= LOSS_BURST:
            logger.debug(
                "%d packets declared lost at once on %s, %.3f s in (parity %s): %s",
                burst,
                self.describe_path(),
                self._loop.time() - self._born,
                "on" if self.fec_encoder is not None else "off",
                self.recovery(),
            )

    def loss_total(self) -> int:
        """Packets QUIC declared lost on this link so far."""
        core = getattr(self.quic, "_core", None)
        return int(core.loss_total) if core is not None else 0

    def recovery(self) -> Recovery | None:
        """The link's congestion window, round trip and losses now (None before QUIC
        has a connection state): a window cut early and never grown back is what
        makes a long link's bulk crawl."""
        core = getattr(self.quic, "_core", None)
        if core is None:
            return None
        return Recovery(
            window=int(core.congestion_window),
            in_flight=int(core.bytes_in_flight),
            smoothed_rtt=core.smoothed_rtt,
            lost=int(core.loss_total),
            probe_timeouts=int(core.pto_total),
        )

    def _fec_keys(self, *, sending: bool) -> fec.FecKeys:
        """The FEC keys of frames this end sends (``sending``) or the peer sends."""
        # Both callers wait for the handshake, which sets the secret.
        assert self._fec_secret, "FEC keys before the handshake finished"
        from_client = self.quic.configuration.is_client == sending
        return fec.FecKeys.derive(self._fec_secret, from_client=from_client)

    def fec_receive(self, frame: bytes, now: float) -> list[bytes]:
        """The QUIC datagrams an FEC frame from the peer gives now."""
        if self.fec_decoder is None:
            # Frames come only after we offered FEC, which is after the handshake.
            if not self.fec_offered or not self.connected.done():
                return []
            self.fec_decoder = fec.Decoder(self._fec_keys(sending=False))
        return self.fec_decoder.receive(frame, now)

    @property
    def local_port(self) -> int:
        """The local UDP port this link's packets leave from."""
        return self._endpoint.local_address[1]

    def describe_path(self) -> str:
        """``direct``, ``direct (hole-punched) ADDR`` or ``relayed via RELAY``."""
        return "direct" if self.path is None else self.path.describe()

    def remote_address(self) -> Address:
        """Where packets go now: the real address, also for punched sessions."""
        if self.path is None:
            return self.address
        return self.path.remote_address()

    # --- used by Stream -----------------------------------------------------------

    def send(self, stream_id: int, data: bytes | memoryview, end_stream: bool = False) -> None:
        if self.is_closed:
            raise self.closed.result()
        try:
            self.quic.send_stream_data(stream_id, data, end_stream)
        except QuicConnectionError as exc:
            # qh3 knows of a peer's close (its draining period) a moment before
            # we get ConnectionTerminated, and refuses writes meanwhile.
            raise ConnectionLostError(f"the connection closed ({exc.reason_phrase})") from None
        self.transmit()

    def reset_stream(self, stream_id: int, code: int = 0) -> None:
        if not self.is_closed:
            try:
                self.quic.reset_stream(stream_id, code)
            except Exception:  # the stream may already be finished on both sides
                logger.debug("reset of stream %d failed", stream_id, exc_info=True)
            self.transmit()
        self.forget_stream(stream_id)

    def send_buffer_size(self, stream_id: int | None = None) -> int:
        """Bytes QUIC has not sent yet, of one stream or (None) of all."""
        return int(self.quic.get_send_buffer_size(stream_id))

    async def wait_writable(self, stream_id: int) -> None:
        """Wait until the stream's unsent bytes fall under the high-water mark, and
        with a buffer limit, the whole link's under half of it (the other half is
        for unread bytes and for replies, which do not wait)."""
        while self.send_buffer_size(stream_id) > SEND_HIGH_WATER or (
            self.buffer_limit and self.send_buffer_size() > self.buffer_limit // 2
        ):
            if self.is_closed:
                raise self.closed.result()
            self._writable.clear()
            await self._writable.wait()

    def forget_stream(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            stream.uncount()

    def stop_receiving(self, stream_id: int, code: int = RESET_OVER_LIMIT) -> None:
        """Ask the peer to stop sending on a stream (QUIC STOP_SENDING)."""
        if self.is_closed:
            return
        try:
            self.quic.stop_stream(stream_id, code)
        except Exception:  # the peer may have finished sending already
            logger.debug("stop_sending on stream %d failed", stream_id, exc_info=True)
        self.transmit()

    # --- what the link holds ---------------------------------------------------------

    def note_unread(self, delta: int) -> None:
        """A stream's unread bytes changed by ``delta`` (called by Stream)."""
        self._unread += delta

    def buffered(self) -> Buffered:
        """Bytes the link holds now: unread by handlers, and not yet sent by QUIC."""
        unsent = 0 if self.is_closed else self.send_buffer_size()
        return Buffered(unread=self._unread, unsent=unsent)

    def held(self) -> int:
        return self.buffered().total

    # --- driven by the endpoint ---------------------------------------------------

    def transmit(self) -> None:
        """Send soon: coalesces every write made in this loop iteration."""
        if not self._transmit_scheduled:
            self._transmit_scheduled = True
            self._loop.call_soon(self.transmit_now)

    def transmit_now(self) -> None:
        self._transmit_scheduled = False
        now = self._loop.time()
        datagrams = self.quic.datagrams_to_send(now)
        if self.fec_peer and self.fec_encoder is None:
            self._maybe_start_parity()
        encoder = self.fec_encoder
        if datagrams and encoder is not None:
            self._fec_to = address = datagrams[0][1]
            datagrams = [(f, address) for f in encoder.encode([d for d, _ in datagrams], now)]
        elif datagrams and self._early_copies:
            datagrams = self._twice(datagrams)
        if datagrams:
            self._sending(datagrams)
            self._endpoint.send(datagrams)
        self._writable.set()
        self._schedule_timer()

    def _unvalidated(self) -> bool:
        """Accepting side, the peer's address not yet validated."""
        return not self.validated and not self.quic.configuration.is_client

    def note_received(self, size: int) -> None:
        """``size`` bytes came from the peer (what an unvalidated answer may send grows)."""
        if self._unvalidated():
            self._allowance += 3 * size

    def _sending(self, datagrams: list[tuple[bytes, Any]]) -> None:
        if self._unvalidated():
            self._allowance -= sum(len(data) for data, _ in datagrams)

    def first_flight(
        self, received: int, datagrams: list[tuple[bytes, Any]]
    ) -> list[tuple[bytes, Any]]:
        """What the accepting side sends in answer to the Initial that made the link
        (``received`` bytes): QUIC's ``datagrams``, with copies where they fit."""
        self.note_received(received)
        if self._early_copies:
            datagrams = self._twice(datagrams)
        self._sending(datagrams)
        return datagrams

    def receive_datagrams(self, datagrams: list[bytes], address: Address, now: float) -> None:
        """Feed QUIC datagrams that FEC frames carried, rebuilt or released, in one call."""
        self.note_received(sum(len(data) for data in datagrams))
        try:
            self.quic.receive_many_datagrams(datagrams, address, now)
        except Exception:  # a malformed packet must not take the endpoint down
            logger.debug("dropping packets from %s", address, exc_info=True)

    def receive(self, data: bytes, segment_size: int, address: Address, now: float) -> None:
        self.note_received(len(data))
        if len(data) > segment_size:
            self.quic.receive_gro_buffer(data, segment_size, address, now)
        else:
            self.quic.receive_datagram(data, address, now)

    def process_events(self) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            self._log_loss_burst()
        while (event := self.quic.next_event()) is not None:
            if isinstance(event, qe.StreamDataReceived):
                stream = self._streams.get(event.stream_id)
                if stream is None:
                    if event.stream_id % 4 == (0 if self.quic.configuration.is_client else 1):
                        continue  # data for a stream we already closed and forgot
                    if not self._peer_streams.first_seen(event.stream_id):
                        continue  # a late frame of a request already served: not a new one
                    stream = Stream(self, event.stream_id)
                    self._streams[event.stream_id] = stream
                    if self.on_stream is None:
                        self.reset_stream(event.stream_id)
                        continue
                    self.on_stream(stream)
                stream.feed(event.data, event.end_stream)
            elif isinstance(event, qe.StreamReset):
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    if event.error_code == RESET_OVER_LIMIT:
                        stream.fail(over_limit_error())
                    else:
                        stream.fail(ConnectionLostError("the peer abandoned the request"))
                    # Nobody reads our side any more: what QUIC still holds for it goes.
                    stream.abort()
            elif isinstance(event, qe.StopSendingReceived):
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream.stop_sending()
            elif isinstance(event, qe.HandshakeCompleted):
                self.validated = True
                self.alpn = event.alpn_protocol
                self.binding = session_binding(self.quic)
                self._fec_secret = fec_secret(self.quic)
                if not self.connected.done():
                    self.connected.set_result(None)
            elif isinstance(event, qe.ConnectionIdIssued):
                self.cids.add(event.connection_id)
                self._endpoint.register_cid(event.connection_id, self)
            elif isinstance(event, qe.ConnectionIdRetired):
                self.cids.discard(event.connection_id)
                self._endpoint.unregister_cid(event.connection_id)
            elif isinstance(event, qe.ConnectionTerminated):
                self._finish(_error_from_close(event))

    def _send_keepalive(self) -> None:
        self._keepalive = None
        if self.is_closed:
            return
        if self.connected.done():
            self._pings += 1
            self.quic.send_ping(self._pings)
            self.transmit()
        self._keepalive = self._loop.call_later(self._keepalive_every, self._send_keepalive)

    def _finish(self, error: GPUMeshError) -> None:
        if not self.closed.done() and logger.isEnabledFor(logging.DEBUG):
            where = f"{self.address} ({self.describe_path()})"
            logger.debug("link to %s ended: %s", where, self.recovery())
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        if not self.closed.done():
            self.closed.set_result(error)
        if not self.connected.done():
            self.connected.set_exception(error)
            self.connected.exception()  # mark retrieved: nobody may be waiting
        for stream in list(self._streams.values()):
            stream.fail(error)
            stream.uncount()
        self._streams.clear()
        self._writable.set()
        self._endpoint.link_closed(self)

    def _schedule_timer(self) -> None:
        at = self.quic.get_timer()
        for fec_at in (
            None if self.fec_encoder is None else self.fec_encoder.flush_at(),
            None if self.fec_decoder is None else self.fec_decoder.hold_until(),
        ):
            if fec_at is not None and (at is None or fec_at < at):
                at = fec_at
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        now = self._loop.time()
        if self.fec_decoder is not None:
            released = self.fec_decoder.poll(now)
            if released:
                self.receive_datagrams(released, self.address, now)
        quic_at = self.quic.get_timer()
        if quic_at is not None and now >= quic_at:
            self.quic.handle_timer(now)
        self.process_events()
        if self.fec_encoder is not None:
            parity = self.fec_encoder.poll(now)
            if parity:
                self._endpoint.send([(frame, self._fec_to) for frame in parity])
        self.transmit_now()

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


Accept = Callable[[Address, bool], Admission | DropReason]
"""Whether a new connection from an address (validated or not) may start."""
OnDrop = Callable[[Address, DropReason, bool], None]
"""Told of each packet dropped for a reason (the address, and whether it was validated)."""


class QuicEndpoint:
    """One UDP socket and the QUIC connections that run over it.

    A server endpoint accepts new connections: ``accept`` decides, for each
    full-size client Initial, whether to make the connection, to answer with a
    stateless Retry, or to drop it (budgets live with the caller); ``on_drop``
    hears of every packet dropped, for a summary. A dialer endpoint has
    exactly one link on an ephemeral, connected socket.
    """

    def __init__(
        self,
        udp: UdpSocket,
        *,
        server_config: QuicConfiguration | None = None,
        on_link: Callable[[QuicLink], None] | None = None,
        accept: Accept | None = None,
        on_drop: OnDrop | None = None,
        retry_tokens: RetryTokens | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.udp = udp
        self._server_config = server_config
        self._on_link = on_link
        self._accept = accept
        self._on_drop = on_drop
        self.retry_tokens = retry_tokens or RetryTokens(os.urandom(32))
        """Keyed with a secret of this endpoint's own: tokens die with it."""
        self.retries_sent = 0
        self._by_cid: dict[bytes, QuicLink] = {}
        self._by_address: dict[Any, QuicLink] = {}
        """Links by their peer's (or path's virtual) address: where FEC frames go."""
        self._fec_pending: dict[QuicLink, list[bytes]] = {}
        """QUIC datagrams from this wake-up's FEC frames, per link, not fed yet."""
        self.links: set[QuicLink] = set()
        self._closed = False
        self._socket_closed = False
        self._dialer_link: QuicLink | None = None
        self.relay: PacketRoute | None = None
        """The route sharing this socket: the relay client, once this endpoint registers
        with a relay."""
        self._fileno = udp.sock.fileno()
        self._loop.add_reader(self._fileno, self._on_readable)
        self._writer_registered = False

    @classmethod
    def listen(
        cls,
        identity: Identity,
        host: str,
        port: int,
        *,
        on_link: Callable[[QuicLink], None],
        accept: Accept | None = None,
        on_drop: OnDrop | None = None,
        alpns: Sequence[str] = ALPNS,
    ) -> QuicEndpoint:
        udp = UdpSocket(open_udp_socket(host, port))
        return cls(
            udp,
            server_config=server_configuration(identity, alpns),
            on_link=on_link,
            accept=accept,
            on_drop=on_drop,
        )

    @classmethod
    async def dial(
        cls,
        address: Address,
        *,
        expected_key: bytes,
        timeout: float,
        local_host: str | None = None,
        alpns: Sequence[str] = ALPNS,
    ) -> QuicLink:
        """Connect to ``address`` from an ephemeral port and pin ``expected_key``;
        ``alpns``: the connection protocols to offer, preferred first."""
        host = local_host or ("::" if ":" in address[0] else "0.0.0.0")
        try:
            udp = UdpSocket(open_udp_socket(host, 0))
        except OSError as exc:
            raise UnreachableError(f"cannot open a UDP socket: {exc}") from exc
        where = f"{address[0]}:{address[1]}"
        try:
            udp.connect(address)
        except OSError as exc:
            udp.close()
            raise unreachable(where, reason=str(exc.strerror or exc)) from exc
        endpoint = cls(udp)
        try:
            return await endpoint.dial_link(address, where, expected_key, timeout, alpns=alpns)
        except BaseException:
            endpoint.close()
            raise

    async def dial_link(
        self,
        address: Address,
        where: str,
        expected_key: bytes,
        timeout: float,
        *,
        path: LinkPath | None = None,
        alpns: Sequence[str] = ALPNS,
        shared: bool = False,
    ) -> QuicLink:
        """Connect this dialer endpoint's one link to ``address`` (a ``path``'s virtual
        address when it runs over one) and pin ``expected_key``; ``where`` names
        the peer in errors. ``shared``: the endpoint carries other client links too
        (routed by connection id), and a failed dial closes only its own link."""
        quic = QuicConnection(configuration=client_configuration(alpns))
        link = QuicLink(self, quic, address, path=path)
        if not shared:
            self._dialer_link = link
        self._add_link(link)
        quic.connect(address, self._loop.time())
        link.transmit_now()
        try:
            await asyncio.wait_for(asyncio.shield(link.connected), timeout)
        except TimeoutError:
            if link.is_closed:
                raise link.closed.result() from None
            if shared:
                link.close()
            raise unreachable(where, waited=timeout) from None
        except BaseException:
            if shared:
                link.close()
            raise
        if link.peer_public_key() != expected_key:
            error = KeyMismatchError(
                f"the node at {where} presented a different key than the one you paired "
                "with: it may be another machine or an impostor; re-pair if it was reinstalled"
            )
            link.close(error)
            raise error
        return link

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in list(self.links):
            link.close()  # still sends: the socket closes below
            link.cancel_timer()
        if self.relay is not None:
            self.relay.close()
        self._loop.remove_reader(self._fileno)
        if self._writer_registered:
            self._loop.remove_writer(self._fileno)
        self.udp.close()
        self._socket_closed = True

    @property
    def local_address(self) -> Address:
        return self.udp.local_address

    # --- link bookkeeping -----------------------------------------------------------

    def _add_link(self, link: QuicLink) -> None:
        self.links.add(link)
        self._by_address[link.address] = link
        for cid in link.cids:
            self._by_cid[cid] = link

    def register_cid(self, cid: bytes, link: QuicLink) -> None:
        self._by_cid[cid] = link

    def unregister_cid(self, cid: bytes) -> None:
        self._by_cid.pop(cid, None)

    def link_closed(self, link: QuicLink) -> None:
        if link is self._dialer_link or self._server_config is None:
            # A dialer's socket (one link, or a shared one's several): its close is
            # already sent, and no peer's retransmission needs an answer. A relayed
            # link's session ends at the relay now, not after a linger.
            self._forget(link)
            return
        # Keep routing for a moment so the close can be retransmitted, then forget.
        self._loop.call_later(3.0, self._forget, link)

    def _forget(self, link: QuicLink) -> None:
        link.cancel_timer()
        if link.path is not None:
            link.path.release()
        self.links.discard(link)
        if self._by_address.get(link.address) is link:
            del self._by_address[link.address]
        for cid in link.cids:
            if self._by_cid.get(cid) is link:
                del self._by_cid[cid]
        if self._dialer_link is link:
            self.close()

    # --- I/O ------------------------------------------------------------------------

    def send(self, datagrams: list[tuple[bytes, Any]]) -> None:
        relay = self.relay
        if relay is not None and relay.has_paths:
            path = relay.path_for_virtual(datagrams[0][1]) if datagrams else None
            if path is not None and all(address == datagrams[0][1] for _, address in datagrams):
                # The usual case: everything of one transmit goes to one relayed peer.
                datagrams = path.outgoing([data for data, _ in datagrams])
            else:
                routed: list[tuple[bytes, Any]] = []
                for data, address in datagrams:
                    path = relay.path_for_virtual(address)
                    routed += path.outgoing([data]) if path is not None else [(data, address)]
                datagrams = routed
        self.send_raw(datagrams)

    def send_raw(self, datagrams: list[tuple[bytes, Any]]) -> None:
        """Send as is (relay packets, probes, already routed QUIC datagrams)."""
        if self._socket_closed:
            return
        self.udp.send_batch(datagrams)
        if self.udp.blocked and not self._writer_registered:
            self._writer_registered = True
            self._loop.add_writer(self._fileno, self._on_writable)

    def _on_writable(self) -> None:
        if self.udp.flush():
            self._writer_registered = False
            self._loop.remove_writer(self._fileno)

    def _on_readable(self) -> None:
        try:
            batch = self.udp.receive_batch()
        except ConnectionRefusedError:
            # Only dialers have connected sockets: ICMP says nothing listens there.
            link = self._dialer_link
            if link is not None and not link.connected.done():
                host, port = link.address
                link._finish(unreachable(format_address((host, port)), refused=True))
            return
        except OSError as exc:
            logger.debug("udp receive failed: %s", exc)
            return
        if not batch:
            if self.udp.reports_refusals:  # a shared dialer's socket (Linux)
                self._refused(self.udp.take_refusals())
            return
        now = self._loop.time()
        touched: dict[QuicLink, None] = {}
        relay = self.relay
        for item in batch:
            data, segment_size, address = item.data, item.segment_size, item.address
            if data[0] in _FEC_MARKERS:  # parity-protected QUIC (see protocol/fec.py)
                if relay is not None:
                    address = relay.from_direct(address, now) or address
                for offset in range(0, len(data), segment_size):
                    frame = data[offset : offset + segment_size]
                    self._deliver_fec(frame, address, now, touched)
                continue
            if data[0] < 0x40:  # not QUIC: the relay's, or a punching probe
                if relay is None:
                    self._dropped(address, DropReason.NOT_QUIC)
                    continue
                run = relay.unwrap_run(data, segment_size, address)
                if run is not None:
                    self._deliver_many(run[1], run[0], now, touched)
                else:
                    for offset in range(0, len(data), segment_size):
                        packet = data[offset : offset + segment_size]
                        unwrapped = relay.handle(packet, address, now)
                        if unwrapped is not None:
                            virtual, datagram = unwrapped
                            self._deliver(datagram, len(datagram), virtual, now, touched)
                continue
            if relay is not None:
                punched = relay.from_direct(address, now)
                if punched is not None:
                    address = punched  # the path's virtual address
            self._deliver(data, segment_size, address, now, touched)
        for link, datagrams in self._fec_pending.items():
            link.receive_datagrams(datagrams, link.address, now)
        self._fec_pending.clear()
        for link in touched:
            link.process_events()
            link.transmit_now()

    def _refused(self, addresses: list[Address]) -> None:
        """ICMP said nothing listens at ``addresses``: their dials fail at once."""
        for link in list(self.links):
            if link.path is None and link.address in addresses and not link.connected.done():
                link._finish(unreachable(format_address(link.address), refused=True))

    def _deliver(
        self,
        data: bytes,
        segment_size: int,
        address: Address,
        now: float,
        touched: dict[QuicLink, None],
    ) -> None:
        if data[0] in _FEC_MARKERS:  # a relayed path's frame
            self._deliver_fec(data, address, now, touched)
            return
        link = self._route(data, address)
        if link is None:
            if len(data) <= segment_size:
                self._incoming(data, address, now, touched)
            else:
                # A client's first flight, or a flood, sent with GSO arrives as one
                # buffer: each datagram on its own (the first may open a connection
                # that the next belongs to).
                for offset in range(0, len(data), segment_size):
                    datagram = data[offset : offset + segment_size]
                    self._deliver(datagram, len(datagram), address, now, touched)
            return
        if link.path is not None and address != link.address:
            return  # a relayed link takes packets only through its path
        try:
            link.receive(data, segment_size, address, now)
        except Exception:  # a malformed packet must not take the endpoint down
            logger.debug("dropping packet from %s", address, exc_info=True)
            return
        touched[link] = None

    def _deliver_many(
        self, datagrams: list[bytes], address: Address, now: float, touched: dict[QuicLink, None]
    ) -> None:
        link = self._route(datagrams[0], address)
        if link is None or any(datagram[0] in _FEC_MARKERS for datagram in datagrams):
            for datagram in datagrams:
                self._deliver(datagram, len(datagram), address, now, touched)
            return
        if link.path is not None and address != link.address:
            return
        link.note_received(sum(len(datagram) for datagram in datagrams))
        try:
            link.quic.receive_many_datagrams(datagrams, address, now)
        except Exception:  # a malformed packet must not take the endpoint down
            logger.debug("dropping packets from %s", address, exc_info=True)
            return
        touched[link] = None

    def _deliver_fec(
        self, frame: bytes, address: Address, now: float, touched: dict[QuicLink, None]
    ) -> None:
        """An FEC frame: routed by its source (it carries no connection id)."""
        link = self._dialer_link or self._by_address.get(address)
        if link is None:
            self._dropped(address, DropReason.NOT_QUIC)  # a stranger's: it costs nothing
            return
        if address != link.address:
            return  # frames come only from the link's own peer (or its relayed path)
        datagrams = link.fec_receive(frame, now)
        if datagrams:
            # Fed to QUIC once per socket wake-up, like a GRO buffer (see _on_readable).
            self._fec_pending.setdefault(link, []).extend(datagrams)
        touched[link] = None

    def _route(self, data: bytes, address: Address) -> QuicLink | None:
        if self._dialer_link is not None:
            return self._dialer_link
        cid = _destination_cid(data)
        return None if cid is None else self._by_cid.get(cid)

    # --- new connections -----------------------------------------------------------

    def _incoming(
        self, packet: bytes, address: Address, now: float, touched: dict[QuicLink, None]
    ) -> None:
        """A datagram for no known connection: maybe a new one, most often nothing.

        Everything up to the admission is cheap and stateless; only an admitted
        Initial makes a qh3 connection, and only one that decrypts is kept.
        """
        if self._server_config is None or self._closed:
            return
        header = parse_initial(packet)
        if header is None:
            self._dropped(address, DropReason.NOT_INITIAL if packet[0] & 0x80 else DropReason.STRAY)
            return
        # A relayed session's peer already proved its key to the relay and was
        # authorized by us: its address (a virtual one) needs no Retry.
        path = self.relay.path_for_virtual(address) if self.relay is not None else None
        validated = path is not None
        original, retry_source = header.dcid, None
        if header.token and not validated:
            checked = self.retry_tokens.check(address, header.token, header.dcid)
            if isinstance(checked, DropReason):
                self._dropped(address, checked)
                return
            original, retry_source, validated = checked, header.dcid, True
        verdict = Admission.ACCEPT if self._accept is None else self._accept(address, validated)
        if verdict is Admission.RETRY and not validated:
            self._send_retry(header, address)
            return
        if verdict is not Admission.ACCEPT:
            self._dropped(address, verdict if isinstance(verdict, DropReason) else DropReason.BUSY)
            return
        quic = QuicConnection(
            configuration=self._server_config,
            original_destination_connection_id=original,
            retry_source_connection_id=retry_source,
        )
        try:
            quic.receive_datagram(packet, address, now)
            datagrams = quic.datagrams_to_send(now)
        except Exception:  # a malformed packet must not take the endpoint down
            logger.debug("dropping an Initial from %s", address, exc_info=True)
            datagrams = []
        if not datagrams:
            # Random bytes shaped like an Initial: qh3 found nothing to answer.
            self._dropped(address, DropReason.UNDECRYPTABLE, validated=validated)
            return
        link = QuicLink(self, quic, address, validated=validated, path=path)
        link.cids.add(header.dcid)
        self._add_link(link)
        self.send(link.first_flight(len(packet), datagrams))
        touched[link] = None
        if self._on_link is not None:
            self._on_link(link)

    def _send_retry(self, header: InitialHeader, address: Address) -> None:
        retry_scid = os.urandom(CID_LENGTH)
        token = self.retry_tokens.mint(address, header.dcid, retry_scid)
        packet = encode_retry(
            header.version, header.scid, retry_scid, header.dcid, token, os.urandom(1)[0]
        )
        self.retries_sent += 1
        self.send_raw([(packet, address)])

    def _dropped(self, address: Address, reason: DropReason, *, validated: bool = False) -> None:
        if self._on_drop is not None:
            self._on_drop(address, reason, validated)


def random_nonce() -> bytes:
    return os.urandom(32)
