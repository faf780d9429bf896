"""QUIC links over asyncio: our own adapter around qh3's sans-I/O ``QuicConnection``.

A :class:`QuicLink` owns one connection's timers and byte streams with
backpressure; the endpoint (:mod:`gpumesh.transport.endpoint`) owns the socket
and feeds it, and the link's decisions (parity, early copies, what an
unvalidated peer may be sent) are its :class:`~gpumesh.transport.linkpolicy.LinkPolicy`'s.
It knows nothing of GPUMesh messages beyond the frame layer
(:mod:`gpumesh.transport.stream`).

Pitfalls it handles (all learned the hard way):

* ``HandshakeCompleted`` is the only "connected" signal, and the moment the
  session's binding (:func:`~gpumesh.transport.quicsetup.session_binding`) is taken;
* a peer's streams may first show up out of order (a lost packet): a lower id
  not seen yet is a new stream, not a late frame of an old one;
* ``get_send_buffer_size`` is the only send backpressure signal, and it is
  only meaningful right after ``datagrams_to_send``;
* an application close carries ``code: message`` in the reason phrase so a
  refusal survives the trip (see :func:`~gpumesh.transport.quicsetup.close_reason`).

A link that runs over another path (a relayed session) sends through its
:class:`LinkPath`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from qh3 import QuicConnection, QuicConnectionError
from qh3.quic import events as qe

from gpumesh.errors import ConnectionLostError, GPUMeshError, KeyMismatchError
from gpumesh.identity.tlscert import public_key_from_spki
from gpumesh.protocol import fec
from gpumesh.protocol.addresses import Address
from gpumesh.transport.linkpolicy import LinkPolicy
from gpumesh.transport.quicsetup import (
    APP_ERROR,
    close_reason,
    error_from_close,
    fec_mode,
    fec_secret,
    session_binding,
)
from gpumesh.transport.stream import RESET_OVER_LIMIT, Stream, over_limit_error

__all__ = [
    "Buffered",
    "LinkCarrier",
    "LinkPath",
    "PeerStreamIds",
    "QuicLink",
    "Recovery",
]

logger = logging.getLogger(__name__)

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


class LinkCarrier(Protocol):
    """What a link needs of the endpoint whose socket carries it
    (:class:`~gpumesh.transport.endpoint.QuicEndpoint`)."""

    @property
    def local_address(self) -> Address: ...

    def send(self, datagrams: list[tuple[bytes, Any]]) -> None:
        """Send QUIC datagrams (routed through a path where one is open)."""
        ...

    def register_cid(self, cid: bytes, link: QuicLink) -> None:
        """Packets for ``cid`` go to ``link``."""
        ...

    def unregister_cid(self, cid: bytes) -> None:
        """``cid`` is retired."""
        ...

    def link_closed(self, link: QuicLink) -> None:
        """``link`` is closed: forget it (at once or after a linger)."""
        ...


class QuicLink:
    """One QUIC connection to one peer, carrying many streams."""

    def __init__(
        self,
        endpoint: LinkCarrier,
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
        self.policy = LinkPolicy(
            fec_mode(), is_client=quic.configuration.is_client, validated=validated
        )
        """The link's decisions: parity, early copies, what an unvalidated peer may get."""
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
        """This TLS session's binding (:func:`.session_binding`, set when connected)."""
        self._fec_secret = b""
        """The secret of this session's FEC keys (:func:`.fec_secret`, set when connected)."""
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
        self._keepalive_every = quic.configuration.idle_timeout / 3
        self._pings = 0
        self._keepalive: asyncio.TimerHandle | None = loop.call_later(
            self._keepalive_every, self._send_keepalive
        )
        self.fec_encoder: fec.Encoder | None = None
        """Frames outgoing datagrams once parity is on (None: they go out plain)."""
        self.fec_decoder: fec.Decoder | None = None
        """Takes the peer's FEC frames (made at the first one)."""
        self._fec_to: Any = address
        """Where QUIC sent the datagrams of the open group (parity follows them)."""
        self._born = loop.time()
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
        """End the link here without telling the peer (the path under it is gone, or
        nothing listens at its address)."""
        if not self.is_closed:
            self._finish(error)

    async def wait_closed(self) -> GPUMeshError:
        return await asyncio.shield(self.closed)

    @property
    def validated(self) -> bool:
        """Accepting side: the peer is known to receive at :attr:`address`."""
        return self.policy.validated

    def peer_takes_fec(self) -> None:
        """The peer said it takes FEC frames: parity may go to it from now on
        (``auto``: at once on a link with a round trip of :data:`FEC_LONG_RTT` or
        more, else from the link's first loss; ``on``: at once)."""
        if self.policy.peer_takes_fec():
            self._maybe_start_parity()

    def _maybe_start_parity(self) -> None:
        if self.fec_encoder is not None or not self.policy.fec_peer:
            return
        rtt = self._least_rtt()
        losses = self.loss_total()
        if self.policy.parity_due(rtt, losses):
            # Keys of this session and direction: group ids differ per link, and a
            # frame of another link (or reflected back) fails its tag.
            self.fec_encoder = fec.Encoder(self._fec_keys(sending=True))
            logger.debug(
                "parity on for %s (rtt %s, QUIC losses so far: %d)",
                self.address,
                rtt,
                losses,
            )

    def _least_rtt(self) -> float:
        """The least round trip seen so far (inf before the first sample): the link's
        own, not what queues add under bulk."""
        core = getattr(self.quic, "_core", None)
        sample = None if core is None else core.latest_rtt
        return self.policy.least_rtt(sample)

    def _twice(self, datagrams: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
        """A link's datagrams before parity can start, the first ones sent twice
        (as many as :meth:`.LinkPolicy.copies` says)."""
        # ``on`` copies on any link: no round trip is sampled for it.
        rtt = float("inf") if self.policy.fec_mode == "on" else self._least_rtt()
        count = self.policy.copies([len(data) for data, _ in datagrams], rtt)
        twice = [item for item in datagrams[:count] for _ in (0, 1)]
        return twice + datagrams[count:]

    def _log_loss_burst(self) -> None:
        """Log (debug) when QUIC declared several packets lost at once: what the link's
        recovery, parity and path were then."""
        burst = self.policy.loss_burst(self.loss_total())
        if burst is not None:
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
            if not self.policy.fec_offered or not self.connected.done():
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
        return self.address if self.path is None else self.path.remote_address()

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
        if self.policy.fec_peer and self.fec_encoder is None:
            self._maybe_start_parity()
        encoder = self.fec_encoder
        if datagrams and encoder is not None:
            self._fec_to = address = datagrams[0][1]
            datagrams = [(f, address) for f in encoder.encode([d for d, _ in datagrams], now)]
        elif datagrams and self.policy.early_copies:
            datagrams = self._twice(datagrams)
        if datagrams:
            self._sending(datagrams)
            self._endpoint.send(datagrams)
        self._writable.set()
        self._schedule_timer()

    def note_received(self, size: int) -> None:
        """``size`` bytes came from the peer (what an unvalidated answer may send grows)."""
        self.policy.received(size)

    def _sending(self, datagrams: list[tuple[bytes, Any]]) -> None:
        self.policy.sending(sum(len(data) for data, _ in datagrams))

    def first_flight(
        self, received: int, datagrams: list[tuple[bytes, Any]]
    ) -> list[tuple[bytes, Any]]:
        """What the accepting side sends in answer to the Initial that made the link
        (``received`` bytes): QUIC's ``datagrams``, with copies where they fit."""
        self.note_received(received)
        if self.policy.early_copies:
            datagrams = self._twice(datagrams)
        self._sending(datagrams)
        return datagrams

    def receive_datagrams(self, datagrams: list[bytes], address: Address, now: float) -> bool:
        """Feed QUIC datagrams (a relayed run, or what FEC frames carried) in one call;
        False when QUIC could not take them."""
        self.note_received(sum(len(data) for data in datagrams))
        try:
            self.quic.receive_many_datagrams(datagrams, address, now)
        except Exception:  # a malformed packet must not take the endpoint down
            logger.debug("dropping packets from %s", address, exc_info=True)
            return False
        return True

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
                self.policy.validated = True
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
                self._finish(error_from_close(event))

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
        timers = (
            self.quic.get_timer(),
            None if self.fec_encoder is None else self.fec_encoder.flush_at(),
            None if self.fec_decoder is None else self.fec_decoder.hold_until(),
        )
        at = min((when for when in timers if when is not None), default=None)
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
