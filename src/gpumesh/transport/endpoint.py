"""The UDP endpoint of QUIC links: one socket, and the links that run over it.

Why not qh3's ``serve()``/``connect()``: they feed one datagram at a time and
send after each, which means one ACK per datagram and a slow loop. Here one
socket wake-up drains every queued datagram (with GRO, many per syscall),
feeds them to the connection, and collects outgoing datagrams once, which
sets a sane ACK rate and lets GSO send them in few syscalls.

It owns the socket and routes datagrams to links by connection id (FEC frames,
which carry none, by source). A packet for no known connection makes no qh3
object unless it is a full-size client Initial that the caller admits (see
:meth:`QuicEndpoint._incoming`): the caller may ask for a stateless Retry first,
and an Initial that does not decrypt leaves nothing behind.

Other paths plug in through :class:`PacketRoute` (the relay client is one): the
endpoint hands such a route every packet that is not QUIC, and a link that runs
over one of its paths (:class:`~gpumesh.transport.quic.LinkPath`) sends through
it. This module names no route: the relay client imports it, never the other way.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from qh3 import QuicConfiguration, QuicConnection

from gpumesh.errors import KeyMismatchError, UnreachableError
from gpumesh.identity.keys import Identity
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
from gpumesh.protocol.messages import ALPNS
from gpumesh.transport.quic import LinkPath, QuicLink
from gpumesh.transport.quicsetup import CID_LENGTH, client_configuration, server_configuration
from gpumesh.transport.reach import unreachable
from gpumesh.transport.udp import UdpSocket, open_udp_socket

__all__ = ["Accept", "OnDrop", "PacketRoute", "QuicEndpoint"]

logger = logging.getLogger(__name__)

_FEC_MARKERS = (fec.DATA, fec.PARITY)


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
        the QUIC datagrams; None when the run is anything else; no datagrams when the
        route took the run itself (a relay it serves forwarded it whole)."""
        ...

    def handle(self, packet: bytes, source: Address, now: float) -> tuple[Address, bytes] | None:
        """One packet that is not QUIC: the ``(virtual address, QUIC datagram)`` it
        carried, or None when it was the route's own (or nothing)."""
        ...

    def close(self) -> None:
        """The endpoint is closing."""
        ...


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
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.udp = udp
        self._server_config = server_config
        self._on_link = on_link
        self._accept = accept
        self._on_drop = on_drop
        self.retry_tokens = RetryTokens(os.urandom(32))
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
                link.abort(unreachable(format_address(link.address), refused=True))
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
                    if run[1]:
                        self._deliver_many(run[1], run[0], now, touched)
                else:
                    for offset in range(0, len(data), segment_size):
                        packet = data[offset : offset + segment_size]
                        unwrapped = relay.handle(packet, address, now)
                        if unwrapped is not None:
                            virtual, datagram = unwrapped
                            self._deliver(datagram, len(datagram), virtual, now, touched)
                continue
            if relay is not None:  # a punched path's packet goes by its virtual address
                address = relay.from_direct(address, now) or address
            self._deliver(data, segment_size, address, now, touched)
        self._settle(touched, now)

    def receive_routed(self, virtual: Address, datagrams: list[bytes]) -> None:
        """QUIC datagrams a route read from elsewhere than this socket (the relay over
        TCP), under the virtual address of their path, as if this socket had read them."""
        if not datagrams or self._socket_closed:
            return
        now = self._loop.time()
        touched: dict[QuicLink, None] = {}
        self._deliver_many(datagrams, virtual, now, touched)
        self._settle(touched, now)

    def _settle(self, touched: dict[QuicLink, None], now: float) -> None:
        """After a wake-up's packets: parity-rebuilt datagrams to QUIC, then each link
        touched processes its events and sends once."""
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
                link.abort(unreachable(format_address(link.address), refused=True))

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
        if link.receive_datagrams(datagrams, address, now):
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
