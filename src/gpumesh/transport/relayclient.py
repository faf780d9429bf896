"""A node's side of the relay: registration, relayed sessions, hole punching.

The relay client shares its endpoint's UDP socket (the relay must see the
same NAT mapping that peers punch through). The endpoint hands it every
packet that is not QUIC; it answers the relay, feeds punching probes to the
session's :class:`~gpumesh.protocol.punch.Puncher`, and gives relayed QUIC
datagrams back to the endpoint under the session's *virtual address*.

It plugs into the endpoint as its :class:`~gpumesh.transport.endpoint.PacketRoute`,
and each session is a :class:`~gpumesh.transport.quic.LinkPath` under the QUIC
link that runs over it: the endpoint calls those, and names nothing here.

Virtual addresses are how QUIC stays unaware of paths: a relayed session is
known to qh3 as ``[100::<session>]:1`` (RFC 6666's discard-only prefix: no
real packet can come from there). The endpoint translates on the way out
(to the punched direct address if one is live, else wrapped in a relay
``Data`` packet) and on the way in (the punched address back to the virtual
one), so moving from the relay to a direct path is invisible to QUIC, as
with WireGuard under Tailscale's magicsock.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
from collections.abc import Callable
from typing import Any

from gpumesh.errors import ProtocolError, RelayError, UnreachableError
from gpumesh.identity.keys import Identity, node_id_for
from gpumesh.protocol import relay as wire
from gpumesh.protocol.addresses import Address, format_address, parse_address
from gpumesh.protocol.punch import PunchConfig, Puncher
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.netinfo import local_addresses
from gpumesh.transport.quic import QuicLink
from gpumesh.transport.relaytcp import RelayStream, RelayTcp, open_relay_stream
from gpumesh.transport.udp import UdpSocket, open_udp_socket

__all__ = [
    "RelayClient",
    "RelayedPath",
    "dial_relayed",
    "dialling_client",
    "parse_host_port",
    "virtual_address",
]

logger = logging.getLogger(__name__)

_HELLO_RETRY = 0.5
_REREGISTER_MAX = 5.0
_MISSED_KEEPALIVES = 3
_TCP_TIMEOUT = 5.0


def virtual_address(session: int) -> Address:
    """``[100::<session>]:1``, in canonical text (qh3 hands it back unchanged)."""
    return (str(ipaddress.IPv6Address((0x0100 << 112) | session)), 1)


def parse_host_port(text: str) -> Address | None:
    """``ip:port`` / ``[v6]:port`` from the wire; None when it is not one."""
    try:
        address = parse_address(text)
    except ValueError:
        return None
    return address if address[0] else None


def _relay_error(what: str, code: str, message: str) -> RelayError:
    """``WHAT: code: meaning (detail)`` for a refusal code from :data:`~wire.REFUSALS`."""
    meaning = wire.REFUSALS.get(code, code)
    message = message.removeprefix(meaning).strip()
    if message.startswith("(") and message.endswith(")"):
        message = message[1:-1]  # the relay's own detail, after the meaning
    detail = f" ({message})" if message else ""
    why = f"{code}: {meaning}{detail}"
    advice = wire.REFUSAL_ADVICE.get(code)
    return RelayError(f"{what}: {why}" + (f" ({advice})" if advice else ""), why=why)


class RelayedPath:
    """One relayed session with one peer, and where its packets go now."""

    def __init__(
        self,
        client: RelayClient,
        session: int,
        peer_key: bytes,
        secret: bytes,
        candidates: list[Address],
        now: float,
        *,
        peer_listens: list[Address],
    ) -> None:
        self.client = client
        self.peer_listens = peer_listens
        """The addresses the peer says it listens on (not its NAT's mapping)."""
        self.session = session
        self.peer_key = peer_key
        self.virtual = virtual_address(session)
        self._header = wire.encode_data(session, b"")
        self.puncher = Puncher(
            session,
            secret,
            candidates,
            now,
            random_tx=lambda: int.from_bytes(os.urandom(8), "big") >> 1,
            config=client.punch_config,
        )
        self.relay_open = True
        self.over_tcp = client.over_tcp
        """Whether the relay carries it over TCP (the registration rode TCP when it opened)."""
        self.settled = asyncio.Event()
        """Set once punching has found a direct path or given up."""
        self.ended: RelayError | None = None
        self.link: QuicLink | None = None

    @property
    def direct(self) -> Address | None:
        return self.puncher.direct

    def outgoing(self, datagrams: list[bytes]) -> list[tuple[bytes, Address]]:
        """Where each QUIC datagram goes now: straight to the punched address, or wrapped
        for the relay."""
        direct = self.puncher.direct
        if direct is not None:
            return [(datagram, direct) for datagram in datagrams]
        header, relay = self._header, self.client.relay_address
        if self.over_tcp:
            self.client.send_over_tcp([header + datagram for datagram in datagrams])
            return []
        return [(header + datagram, relay) for datagram in datagrams]

    def remote_address(self) -> Address:
        return self.puncher.direct or self.client.relay_address

    def describe(self) -> str:
        direct = self.puncher.direct
        if direct is not None:
            return f"direct (hole-punched) {format_address(direct)}"
        if self.client.peer:
            return f"relayed (peer {self.client.peer})"
        return f"relayed {'(tcp) ' if self.over_tcp else ''}via {self.client.label}"

    def attach(self, link: QuicLink) -> None:
        self.link = link

    def release(self) -> None:
        link = self.link
        if link is not None and not link.is_closed:
            # A newer connection from the peer took the path over (it re-dialled the
            # punched address before this side saw the old one end): it keeps it.
            return
        self.client.forget(self)


class RelayClient:
    """This node's registration with one relay, over an endpoint's socket."""

    def __init__(
        self,
        endpoint: QuicEndpoint,
        relay_address: Address,
        label: str,
        identity: Identity,
        *,
        token: str = "",
        serving: bool,
        candidates: Callable[[], list[str]] = list,
        authorize: Callable[[bytes], bool] | None = None,
        punch_config: PunchConfig | None = None,
        tcp: RelayTcp | None = None,
        peer: str = "",
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.peer = peer
        """The name of the paired peer that is this relay (it relays for its peers);
        empty for a ``gpumesh-relay``."""
        self.named = f"peer {peer}" if peer else f"the relay {label}"
        """How messages name it."""
        self.endpoint = endpoint
        self.relay_address = relay_address
        self.label = label
        self.identity = identity
        self.token = token
        self.serving = serving
        self._candidates = candidates
        self._authorize = authorize
        self.punch_config = punch_config or PunchConfig()
        self.registered = asyncio.Event()
        self.observed: str | None = None
        self.error: RelayError | None = None
        self.paths: dict[int, RelayedPath] = {}
        self._by_virtual: dict[Address, RelayedPath] = {}
        self._by_direct: dict[Address, RelayedPath] = {}
        self._requests: dict[int, asyncio.Future[RelayedPath]] = {}
        self._next_request = 1
        self._keepalive_every = 10.0
        self._keepalive_seq = 0
        self._keepalive_at = 0.0
        self._last_heard = 0.0
        self._next_hello = 0.0
        self._hello_backoff = _HELLO_RETRY
        self._pending_register: bytes | None = None
        self._wake = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self.on_path_event: Callable[[RelayedPath, str], None] | None = None
        self.on_change: Callable[[], None] | None = None
        """Called when the registration is accepted, refused or lost."""
        self.tcp = tcp
        """The relay's TCP listener, raced against UDP (None: UDP only)."""
        self._carrier: str | None = None
        """``udp`` or ``tcp``: what the registration under way rides (None while both race)."""
        self.over_tcp = False
        """Whether the registration rides TCP (UDP to the relay got no answer)."""
        self.tcp_error = ""
        """Why the last try of TCP failed, for the one line that says why nothing worked."""
        self._stream: RelayStream | None = None
        self._opening: asyncio.Task[None] | None = None
        self._next_tcp = 0.0
        self._next_udp_try = 0.0

    # --- life cycle ------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"relay {self.label}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for path in list(self.paths.values()):
            if path.relay_open:
                self._send(wire.Close(session=path.session, code="closed", message=""))
        if self._task is not None:
            self._task.cancel()
        self._drop_stream()
        for future in self._requests.values():
            if not future.done():
                future.set_exception(RelayError(f"{self.named}: the node is closing"))
                future.exception()

    @property
    def registered_as(self) -> str:
        """The address the relay sees, and ``(over tcp)`` when the registration rides TCP."""
        return f"{self.observed}{' (over tcp)' if self.over_tcp else ''}"

    async def wait_registered(self, timeout: float) -> None:
        """Wait for the relay to accept us; raise its refusal or a timeout error."""
        try:
            async with asyncio.timeout(timeout):
                while not self.registered.is_set():
                    if self.error is not None:
                        raise self.error
                    self._wake.set()
                    waiter = asyncio.ensure_future(self.registered.wait())
                    try:
                        await asyncio.wait({waiter}, timeout=0.1)
                    finally:
                        waiter.cancel()
        except TimeoutError:
            if self.peer:
                raise UnreachableError(
                    f"no answer from {self.named} as a relay within {timeout:.0f}s: is "
                    "`gpumesh share` running there, with relay_for_peers on?"
                ) from None
            if self.tcp is None:
                raise UnreachableError(
                    f"no answer from the relay {self.label} within {timeout:.0f}s: is "
                    "gpumesh-relay running there and its UDP port reachable?"
                ) from None
            tcp = self.tcp_error or f"TCP to {self.tcp.label}: no answer"
            why = f"no answer over UDP within {timeout:.0f}s; {tcp}"
            raise UnreachableError(
                f"the relay {self.label}: {why}: is gpumesh-relay running there, and UDP or "
                "its TCP port reachable?",
                why=why,
            ) from None

    async def open_path(self, peer_key: bytes, timeout: float) -> RelayedPath:
        """Ask the relay for a session with ``peer_key`` and start punching."""
        request = self._next_request
        self._next_request += 1
        future: asyncio.Future[RelayedPath] = self._loop.create_future()
        self._requests[request] = future
        packet = wire.Connect(request=request, peer=peer_key, candidates=self._my_candidates())
        try:
            async with asyncio.timeout(timeout):
                while True:
                    self._send(packet)
                    done, _ = await asyncio.wait({future}, timeout=1.0)
                    if done:
                        return future.result()
        except TimeoutError:
            raise UnreachableError(
                f"{self.named} did not connect us to the peer within {timeout:.0f}s"
            ) from None
        finally:
            self._requests.pop(request, None)

    # --- used by the endpoint (its PacketRoute) ----------------------------------------

    @property
    def has_paths(self) -> bool:
        return bool(self.paths)

    def path_for_virtual(self, address: tuple[Any, ...]) -> RelayedPath | None:
        """The path behind a virtual address (qh3 gives IPv6 ones as 4-tuples)."""
        return self._by_virtual.get((address[0], address[1]))

    def from_direct(self, source: Address, now: float) -> Address | None:
        path = self._by_direct.get(source)
        if path is None or (path.link is not None and path.link.is_closed):
            # A closed link's path lingers while its close may be retransmitted; a
            # new connection from the peer's punched address is a direct one.
            return None
        path.puncher.on_inbound(now)
        return path.virtual

    def forget(self, path: RelayedPath) -> None:
        """The link over ``path`` is gone: end the relayed session."""
        if self.paths.pop(path.session, None) is None:
            return
        self._by_virtual.pop(path.virtual, None)
        for address, other in list(self._by_direct.items()):
            if other is path:
                del self._by_direct[address]
        if path.relay_open and not self._closed:
            self._send(wire.Close(session=path.session, code="closed", message=""))

    def handle(self, packet: bytes, source: Address, now: float) -> tuple[Address, bytes] | None:
        """One non-QUIC packet; returns ``(virtual address, QUIC datagram)`` to deliver."""
        from_relay = source == self.relay_address
        if from_relay and self._carrier != "tcp":
            self._last_heard = now
        if wire.is_data(packet):
            path = self._data_path(packet) if from_relay else None
            return None if path is None else (path.virtual, packet[wire.DATA_HEADER :])
        try:
            message = wire.decode_packet(packet)
        except ProtocolError as exc:
            logger.debug("relay packet from %s dropped: %s", source, exc)
            return None
        if isinstance(message, wire.Probe):
            self._on_probe(message, source, now)
        elif from_relay and (self._carrier != "tcp" or isinstance(message, wire.Challenge)):
            # Riding TCP, only a challenge counts over UDP: UDP answers again.
            self._on_relay_message(message, now, via_tcp=False)
        return None

    def _from_stream(self, packets: list[bytes]) -> None:
        """Packets the relay sent over TCP: its own, and relayed datagrams for QUIC."""
        now = self._loop.time()
        self._last_heard = now
        relayed: dict[RelayedPath, list[bytes]] = {}
        for packet in packets:
            if wire.is_data(packet):
                path = self._data_path(packet)
                if path is not None:
                    relayed.setdefault(path, []).append(packet[wire.DATA_HEADER :])
                continue
            try:
                message = wire.decode_packet(packet)
            except ProtocolError as exc:
                logger.debug("relay packet over TCP dropped: %s", exc)
                continue
            self._on_relay_message(message, now, via_tcp=True)
        for path, datagrams in relayed.items():
            self.endpoint.receive_routed(path.virtual, datagrams)

    def unwrap_run(
        self, buffer: bytes, segment: int, source: Address
    ) -> tuple[Address, list[bytes]] | None:
        """A run of relayed datagrams of one session read at once (GRO), unwrapped.

        None when it is anything else (the caller then handles each packet).
        """
        if source != self.relay_address or len(buffer) <= segment or segment <= wire.DATA_HEADER:
            return None
        header = buffer[: wire.DATA_HEADER]
        if not wire.is_data(header):
            return None
        for offset in range(segment, len(buffer), segment):
            if buffer[offset : offset + wire.DATA_HEADER] != header:
                return None
        path = self._data_path(header)
        if path is None:
            return None
        self._last_heard = self._loop.time()
        start = wire.DATA_HEADER
        datagrams = [buffer[o + start : o + segment] for o in range(0, len(buffer), segment)]
        return path.virtual, datagrams

    def holds(self, packet: bytes) -> bool:
        """Whether a Data packet is for one of this client's sessions."""
        return self._data_path(packet) is not None

    def _data_path(self, packet: bytes) -> RelayedPath | None:
        """The path of the session a Data packet (or its header) is for, if any."""
        try:
            session, _ = wire.decode_data(packet)
        except ProtocolError:
            return None
        return self.paths.get(session)

    # --- relay messages -----------------------------------------------------------------

    def _on_relay_message(self, message: wire.RelayMessage, now: float, *, via_tcp: bool) -> None:
        if isinstance(message, wire.Challenge):
            self._on_challenge(message, via_tcp=via_tcp)
        elif isinstance(message, wire.Registered):
            first = not self.registered.is_set()
            moved = message.observed != self.observed
            self._registered_over(via_tcp, now)
            self.registered.set()
            self.error = None
            self.observed = message.observed
            self._pending_register = None
            self._hello_backoff = _HELLO_RETRY
            self._keepalive_every = max(1.0, message.keepalive or 10.0)
            self._keepalive_at = now + self._keepalive_every
            if first:
                over = " over TCP" if self.over_tcp else ""
                logger.info("registered with relay %s%s as %s", self.label, over, message.observed)
            if first or moved:
                self._changed()
        elif isinstance(message, wire.Refused):
            self._on_refused(message)
        elif isinstance(message, wire.Incoming):
            self._on_incoming(message, now)
        elif isinstance(message, wire.Connected):
            self._on_connected(message, now)
        elif isinstance(message, wire.Close):
            self._on_close(message)
        elif isinstance(message, wire.KeepAliveAck):
            if not message.registered:
                self._lost_registration("the relay no longer knows this node (it restarted?)")
            elif message.observed and message.observed != self.observed:
                self.observed = message.observed  # our NAT gave us another mapping
                self._changed()

    def _on_challenge(self, challenge: wire.Challenge, *, via_tcp: bool) -> None:
        carrier = "tcp" if via_tcp else "udp"
        if self.registered.is_set():
            if self.over_tcp and not via_tcp and not self.paths:
                self._back_to_udp()  # UDP answers again and no session rides TCP
            else:
                return
        if self._carrier is None:
            self._carrier = carrier  # the race's winner: the registration rides it
        elif self._carrier != carrier:
            return
        identity = self.identity
        signature = identity.sign(
            wire.register_payload(challenge.nonce, identity.public_key, self.serving)
        )
        register = wire.Register(
            public_key=identity.public_key,
            nonce=challenge.nonce,
            signature=signature,
            token_proof=wire.token_proof(self.token, challenge.nonce),
            serving=self.serving,
        )
        self._pending_register = wire.encode_packet(register)
        self._send_raw(self._pending_register)

    def _on_refused(self, refused: wire.Refused) -> None:
        error = _relay_error(f"{self.named} refused", refused.code, refused.message)
        future = self._requests.get(refused.session) if refused.session else None
        if future is not None and not future.done():
            future.set_exception(error)
            return
        if refused.code in ("not-registered",):
            self._lost_registration("the relay says this node is not registered")
            return
        if refused.code == "no-session":
            path = self.paths.get(refused.session)
            if path is not None:
                self._end_relay(path, error)
            return
        if refused.code in ("bad-nonce",):
            self._pending_register = None  # a stale challenge: start over
            self._carrier = None
            self._next_hello = 0.0
            return
        # A refused registration: wait for the caller to read it; retry slowly.
        self.error = error
        self._pending_register = None
        self._hello_backoff = _REREGISTER_MAX
        self._next_hello = self._loop.time() + _REREGISTER_MAX
        logger.warning("%s", error)
        self._changed()

    def _on_incoming(self, incoming: wire.Incoming, now: float) -> None:
        if not self.serving:
            self._send(wire.Decline(session=incoming.session))
            return
        if incoming.session not in self.paths:  # a repeated Incoming is only answered again
            if self._authorize is None or not self._authorize(incoming.peer):
                logger.info(
                    "declined a relayed connection from %s", node_id_for(incoming.peer).short
                )
                self._send(wire.Decline(session=incoming.session))
                return
            self._add_path(incoming.peer, incoming, now)
        self._send(wire.Accept(session=incoming.session, candidates=self._my_candidates()))

    def _on_connected(self, connected: wire.Connected, now: float) -> None:
        future = self._requests.get(connected.request)
        if future is None or future.done():
            return
        path = self.paths.get(connected.session)
        if path is None:
            path = self._add_path(b"", connected, now)
        future.set_result(path)

    def _on_close(self, close: wire.Close) -> None:
        path = self.paths.get(close.session)
        if path is None:
            return
        ended = f"{self.named} ended the session"
        self._end_relay(path, _relay_error(ended, close.code, close.message))

    def _end_relay(self, path: RelayedPath, error: RelayError) -> None:
        path.relay_open = False
        path.ended = error
        logger.info("relayed session %x ended: %s", path.session, error.message)
        if path.link is None:
            self.forget(path)  # no QUIC connection came over it: nothing to keep
        elif path.direct is None:
            path.link.abort(error)

    def _add_path(
        self, peer_key: bytes, offer: wire.Incoming | wire.Connected, now: float
    ) -> RelayedPath:
        listens = [a for text in offer.candidates if (a := parse_host_port(text)) is not None]
        observed = parse_host_port(offer.observed)
        candidates = ([observed] if observed is not None else []) + listens
        path = RelayedPath(
            self, offer.session, peer_key, offer.secret, candidates, now, peer_listens=listens
        )
        self.paths[offer.session] = path
        self._by_virtual[path.virtual] = path
        self._wake.set()
        return path

    # --- punching -----------------------------------------------------------------------

    def _on_probe(self, probe: wire.Probe, source: Address, now: float) -> None:
        path = self.paths.get(probe.session)
        if path is None:
            return
        self._send_many(path.puncher.on_probe(probe, source, now))
        if source in path.puncher.heard_from and source not in self._by_direct:
            # QUIC packets from there are the peer's, even before our own probe
            # is answered: take them rather than drop them.
            self._by_direct[source] = path
        self._after_punch(path)

    def _after_punch(self, path: RelayedPath) -> None:
        for event in path.puncher.take_events():
            if event.kind == "direct" and event.address is not None:
                self._by_direct[event.address] = path
                logger.info(
                    "session %x: direct path to %s after %.0f ms",
                    path.session,
                    format_address(event.address),
                    (path.puncher.direct_after or 0) * 1000,
                )
            elif event.kind == "lost":
                if event.address is not None:
                    self._by_direct.pop(event.address, None)
                logger.info("session %x: direct path lost, back to the relay", path.session)
                if not path.relay_open and path.link is not None:
                    path.link.abort(path.ended or RelayError("the direct path was lost"))
            elif event.kind == "gave_up":
                logger.info("session %x: no direct path; staying on the relay", path.session)
            if event.kind in ("direct", "gave_up"):
                path.settled.set()
            if self.on_path_event is not None:
                self.on_path_event(path, event.kind)
        self._wake.set()

    # --- the timer loop -----------------------------------------------------------------

    async def _run(self) -> None:
        while not self._closed:
            wake_at = self._tick(self._loop.time())
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, wake_at - self._loop.time()))

    def _tick(self, now: float) -> float:
        """Do what is due; return when to look again."""
        wake_at = now + self._keepalive_every
        if not self.registered.is_set():
            if now >= self._next_hello:
                self._hello(now)
                self._next_hello = now + self._hello_backoff
                self._hello_backoff = min(self._hello_backoff * 1.5, _REREGISTER_MAX)
            wake_at = min(wake_at, self._next_hello)
        else:
            if now - self._last_heard >= self._keepalive_every * _MISSED_KEEPALIVES:
                self._lost_registration("no answer from the relay")
                return now
            if now >= self._keepalive_at:
                self._keepalive_seq = (self._keepalive_seq + 1) % 2**32
                self._send_raw(wire.keepalive_packet(self._keepalive_seq))
                self._keepalive_at = now + self._keepalive_every
            wake_at = min(wake_at, self._keepalive_at)
            if self.over_tcp and self.tcp is not None:
                if now >= self._next_udp_try:  # does UDP answer again?
                    self._send_udp(wire.hello_packet())
                    self._next_udp_try = now + self.tcp.udp_retry
                wake_at = min(wake_at, self._next_udp_try)
        for path in list(self.paths.values()):
            self._send_many(path.puncher.poll(now))
            self._after_punch(path)
            next_at = path.puncher.next_wakeup()
            if next_at is not None:
                wake_at = min(wake_at, next_at)
        return wake_at

    def _lost_registration(self, why: str) -> None:
        was_registered = self.registered.is_set()
        if was_registered:
            logger.info("relay %s: %s; registering again", self.label, why)
        self.registered.clear()
        self._pending_register = None
        self._next_hello = 0.0
        self._hello_backoff = _HELLO_RETRY
        self._carrier = None
        self.over_tcp = False
        self._drop_stream()
        for path in list(self.paths.values()):
            if path.relay_open:
                lost = RelayError(f"{self.named} lost the session ({why})")
                self._end_relay(path, lost)
        self._wake.set()
        if was_registered:
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # --- sending --------------------------------------------------------------------------

    def _my_candidates(self) -> list[str]:
        return self._candidates()[: wire.MAX_CANDIDATES]

    def _send(self, message: wire.RelayMessage) -> None:
        self._send_raw(wire.encode_packet(message))

    def _send_raw(self, packet: bytes) -> None:
        """To the relay, over what the registration rides."""
        if self._carrier == "tcp":
            self.send_over_tcp([packet])
        else:
            self._send_udp(packet)

    def _send_udp(self, packet: bytes) -> None:
        self.endpoint.send_raw([(packet, self.relay_address)])

    def send_over_tcp(self, packets: list[bytes]) -> None:
        """Relay packets over the TCP stream (dropped when there is none: the session
        ends with the registration)."""
        stream = self._stream
        if stream is not None:
            stream.send(packets)

    # --- the TCP fallback -----------------------------------------------------------------

    def _hello(self, now: float) -> None:
        """Ask the relay for a challenge: over UDP and, raced beside it, over TCP."""
        if self._pending_register is not None:
            self._send_raw(self._pending_register)
            return
        hello = wire.hello_packet()
        if self._carrier != "tcp":
            self._send_udp(hello)
        if self.tcp is None or self._carrier == "udp":
            return
        if self._stream is not None:
            self._stream.send([hello])
        elif self._opening is None and now >= self._next_tcp:
            self._next_tcp = now + _REREGISTER_MAX
            self._opening = asyncio.create_task(self._open_stream(), name=f"relay tcp {self.label}")

    async def _open_stream(self) -> None:
        tcp = self.tcp
        assert tcp is not None
        try:
            stream = await open_relay_stream(tcp, self._from_stream, timeout=_TCP_TIMEOUT)
        except UnreachableError as exc:
            self.tcp_error = exc.message
            logger.debug("relay %s: %s", self.label, exc.message)
            return
        finally:
            self._opening = None
        if self._closed or self._carrier == "udp" or self.registered.is_set():
            stream.close()  # UDP won the race meanwhile
            return
        self.tcp_error = ""
        self._stream = stream
        stream.send([self._pending_register or wire.hello_packet()])
        await stream.closed.wait()
        if self._stream is stream:
            self._stream = None
            if self._carrier == "tcp" and not self._closed:
                self.tcp_error = f"TCP to {tcp.label}: {stream.why}"
                self._lost_registration(f"the TCP connection ended ({stream.why})")

    def _registered_over(self, via_tcp: bool, now: float) -> None:
        """The registration is accepted over ``via_tcp``'s carrier: the loser of the race
        is dropped; on TCP, UDP is tried again every ``udp_retry``."""
        self.over_tcp = via_tcp
        if via_tcp:
            retry = self.tcp.udp_retry if self.tcp is not None else _REREGISTER_MAX
            if not self.registered.is_set():
                self._next_udp_try = now + retry
        else:
            self._drop_stream()

    def _back_to_udp(self) -> None:
        logger.info("relay %s: UDP answers again; leaving TCP", self.label)
        self.registered.clear()
        self.over_tcp = False
        self._carrier = None  # this challenge, over UDP, makes UDP the carrier
        self._pending_register = None
        self._drop_stream()

    def _drop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        opening, self._opening = self._opening, None
        if opening is not None:
            opening.cancel()

    def _send_many(self, packets: list[tuple[bytes, Address]]) -> None:
        if packets:
            self.endpoint.send_raw(packets)


def dialling_client(
    endpoint: QuicEndpoint,
    relay_address: Address,
    label: str,
    identity: Identity,
    token: str,
    tcp: RelayTcp | None = None,
    peer: str = "",
) -> RelayClient:
    """A client of the relay at ``relay_address`` that only dials (it serves nobody),
    offering the local addresses of ``endpoint``'s port for punching; ``peer``: the
    name of the paired peer that is the relay, if one is."""

    return RelayClient(
        endpoint,
        relay_address,
        label,
        identity,
        token=token,
        serving=False,
        candidates=lambda: local_addresses("0.0.0.0", endpoint.local_address[1]),
        tcp=tcp,
        peer=peer,
    )


async def dial_relayed(
    make_client: Callable[[QuicEndpoint], RelayClient],
    peer_key: bytes,
    *,
    timeout: float,
    local_host: str = "0.0.0.0",
) -> tuple[QuicLink, RelayedPath]:
    """Connect to ``peer_key`` through a relay (and punch a direct path meanwhile).

    ``make_client`` registers a fresh endpoint with the relay; the link and the
    relayed session under it come back (the session says whether punching found
    a direct path, and when).
    """
    try:
        udp = UdpSocket(open_udp_socket(local_host, 0))
    except OSError as exc:
        raise UnreachableError(f"cannot open a UDP socket: {exc}") from exc
    endpoint = QuicEndpoint(udp)
    loop = asyncio.get_running_loop()
    try:
        client = make_client(endpoint)
        endpoint.relay = client
        client.start()
        deadline = loop.time() + timeout
        await client.wait_registered(timeout)
        path = await client.open_path(peer_key, max(0.5, deadline - loop.time()))
        link = await endpoint.dial_link(
            path.virtual,
            f"the peer through {client.named}",
            peer_key,
            max(0.5, deadline - loop.time()),
            path=path,
        )
    except BaseException:
        endpoint.close()
        raise
    return link, path
