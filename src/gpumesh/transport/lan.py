"""LAN discovery's socket: announcing this node to paired peers on the same network,
and hearing theirs, with no server.

One UDP socket bound to the ``lan_port`` setting sends the announcements of
:mod:`gpumesh.protocol.lan` to the multicast group :data:`GROUP` on each interface
(at start, then every ``lan_interval``, and at once when :meth:`LanDiscovery.wake`
is called: a share started), and to each paired peer's last-known IPv4 addresses
by unicast every ``lan_reprobe``, for networks that filter multicast. An
announcement heard with a paired peer's tag is handed up as a hint (the peer's id,
the datagram's source address and the port it announced); a node that serves
answers one that was not itself an answer, by unicast to its source, at most once
per :data:`ANSWER_GAP` per peer, so a node that starts late hears of the others
at once. Multicast is sent with a TTL of 1 and without loopback: routers never
forward it, and the other homes on this machine do not hear it; nor are they
re-probed, or heard from, at this machine's own addresses.

It never dials: a hint is only a hint (:mod:`gpumesh.client.lan` dials it through
the authenticated dial). It never raises out of the datagram handler: malformed,
foreign, replayed or excess datagrams are a debug line each (excess: one per
source until it slows down).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpumesh import platform
from gpumesh.protocol.lan import Gate, Listener, announcements
from gpumesh.transport.netinfo import multicast_interfaces, own_ipv4s

__all__ = ["ANSWER_GAP", "GROUP", "LanDiscovery", "LanPeer", "LanSettings", "is_lan_host"]

logger = logging.getLogger(__name__)

GROUP = "239.255.47.99"
"""The IPv4 multicast group announcements go to (organisation-local scope)."""
ANSWER_GAP = 5.0
"""Seconds between two answers to the same peer: a replayed announcement costs at
most one small datagram per gap."""
PEERS_REFRESH = 5.0
"""Seconds the paired peers' keys are kept before the store is read again (a peer
paired now is recognised within them)."""
MAX_HOSTS = 4
"""Last-known addresses of one peer re-probed by unicast."""


@dataclass(frozen=True)
class LanSettings:
    port: int
    """The UDP port every node announces on and listens at (``lan_port``)."""
    interval: float
    """Seconds between multicast announcements (``lan_interval``)."""
    reprobe: float
    """Seconds between unicast announcements to peers' last-known addresses
    (``lan_reprobe``)."""


@dataclass(frozen=True)
class LanPeer:
    """A paired peer as LAN discovery needs it."""

    peer_id: str
    send_key: bytes
    """The key of this node's tags for the peer (:func:`~gpumesh.protocol.lan.lan_key`)."""
    listen_key: bytes
    """The key of the peer's tags for this node."""
    hosts: tuple[str, ...] = ()
    """IPv4 addresses it was last known at, re-probed by unicast."""


class LanDiscovery:
    """Announce and listen until cancelled (:meth:`run`)."""

    def __init__(
        self,
        settings: LanSettings,
        *,
        peers: Callable[[], Sequence[LanPeer]],
        serving_port: Callable[[], int],
        heard: Callable[[str, tuple[str, int]], None],
        clock: Callable[[], float] = time.time,
        random: Callable[[int], bytes] = os.urandom,
        group: str = GROUP,
    ) -> None:
        """``peers``: the paired peers to announce to and recognise (read again every
        :data:`PEERS_REFRESH` seconds); ``serving_port``: the QUIC port this node's
        share listens on, 0 when it does not share; ``heard``: told (peer id, its
        address) of each peer heard that announced a port."""
        self.settings = settings
        self._peers_of = peers
        self._serving_port = serving_port
        self._heard = heard
        self._clock = clock
        self._random = random
        self._group = group
        self._listener = Listener()
        self._answers = Gate(ANSWER_GAP)
        self._peers: dict[str, LanPeer] = {}
        self._peers_at = -PEERS_REFRESH
        self._own: set[str] = set()
        """This machine's addresses: other homes here are not LAN peers."""
        self._sock: socket.socket | None = None
        self._woken = asyncio.Event()
        self.sent = 0
        """Datagrams sent (multicast, unicast and answers)."""

    def wake(self) -> None:
        """Announce now (the port this node serves on changed)."""
        self._woken.set()

    async def run(self) -> None:
        """Listen and announce until cancelled. A port that cannot be bound is one
        warning, and no LAN discovery."""
        try:
            sock = self._open()
        except OSError as exc:
            logger.warning(
                "LAN discovery is off: cannot listen on UDP port %d (%s); "
                "pick another with `gpumesh config set lan_port PORT`",
                self.settings.port,
                exc.strerror or exc,
            )
            return
        self._sock = sock
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Receiver(self), sock=sock)
        logger.info(
            "LAN discovery on UDP %d (group %s), every %g s, re-probe every %g s",
            self.settings.port,
            self._group,
            self.settings.interval,
            self.settings.reprobe,
        )
        now = time.monotonic()
        next_announce = next_probe = now
        try:
            while True:
                now = time.monotonic()
                woken = self._woken.is_set()
                self._woken.clear()
                self._refresh(force=woken)
                if woken or now >= next_announce:
                    self._own = own_ipv4s()
                    self._join()
                    self._multicast()
                    next_announce = now + self.settings.interval
                if woken or now >= next_probe:
                    self._reprobe()
                    next_probe = now + self.settings.reprobe
                wait = max(0.0, min(next_announce, next_probe) - time.monotonic())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), wait)
        finally:
            transport.close()
            self._sock = None

    # --- the socket ------------------------------------------------------------------

    def _open(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            # Every home on this machine listens at the same port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("0.0.0.0", self.settings.port))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    def _interfaces(self) -> list[int]:
        """Interface indexes to join and send on; [0]: the system's choice."""
        return (multicast_interfaces() if platform.system() == "linux" else []) or [0]

    def _join(self) -> None:
        """Join the group on each interface (again: one may have come up since)."""
        sock = self._sock
        if sock is None:
            return
        group = socket.inet_aton(self._group)
        for index in self._interfaces():
            request = (
                struct.pack("4s4si", group, socket.inet_aton("0.0.0.0"), index)
                if index
                else struct.pack("4s4s", group, socket.inet_aton("0.0.0.0"))
            )
            try:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, request)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:  # joined already
                    logger.debug("cannot join %s on interface %d: %s", self._group, index, exc)

    def _send(self, packets: list[bytes], address: tuple[str, int]) -> None:
        sock = self._sock
        if sock is None:
            return
        for packet in packets:
            try:
                sock.sendto(packet, address)
                self.sent += 1
            except OSError as exc:
                logger.debug("LAN announcement to %s:%d not sent: %s", *address, exc)
                return

    # --- announcing ------------------------------------------------------------------

    def _refresh(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._peers_at < PEERS_REFRESH:
            return
        self._peers_at = now
        try:
            peers = list(self._peers_of())
        except Exception:
            logger.debug("cannot read the paired peers for LAN discovery", exc_info=True)
            return
        self._peers = {peer.peer_id: peer for peer in peers}
        self._listener.set_peers({peer.peer_id: peer.listen_key for peer in peers})

    def _packets(self, keys: list[bytes], *, answer: bool = False) -> list[bytes]:
        return announcements(
            keys, port=self._serving_port(), answer=answer, now=self._clock(), random=self._random
        )

    def _multicast(self) -> None:
        keys = [peer.send_key for peer in self._peers.values()]
        if not keys:
            return
        sock = self._sock
        assert sock is not None
        packets = self._packets(keys)
        for index in self._interfaces():
            if index:
                try:
                    choice = struct.pack("4s4si", socket.inet_aton("0.0.0.0"), b"\0" * 4, index)
                    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, choice)
                except OSError as exc:
                    logger.debug("cannot send on interface %d: %s", index, exc)
                    continue
            self._send(packets, (self._group, self.settings.port))

    def _reprobe(self) -> None:
        for peer in self._peers.values():
            if peer.hosts:
                packets = self._packets([peer.send_key])
                for host in [h for h in peer.hosts if h not in self._own][:MAX_HOSTS]:
                    self._send(packets, (host, self.settings.port))

    # --- hearing ---------------------------------------------------------------------

    def received(self, data: bytes, source: tuple[str, int]) -> None:
        """One datagram from ``source``: hand up the peers it names, answer it."""
        if source[0] in self._own:
            return  # another home on this machine (its multicast never loops back)
        self._refresh()
        heard = self._listener.receive(data, source[0], self._clock())
        if heard.dropped:
            if not heard.quiet:
                logger.debug("LAN datagram from %s:%d dropped: %s", *source, heard.dropped)
            return
        for peer_id in heard.peers:
            peer = self._peers.get(peer_id)
            if peer is None:
                continue
            logger.debug("LAN: peer %s heard at %s (port %d)", peer_id[:12], source[0], heard.port)
            if heard.port:
                self._heard(peer_id, (source[0], heard.port))
            if (
                not heard.answer
                and self._serving_port()
                and self._answers.ready(peer_id, time.monotonic())
            ):
                self._send(self._packets([peer.send_key], answer=True), source)


class _Receiver(asyncio.DatagramProtocol):
    def __init__(self, discovery: LanDiscovery) -> None:
        self.discovery = discovery

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        host, port = str(addr[0]), addr[1]
        if not isinstance(port, int):
            return
        try:
            self.discovery.received(data, (host, port))
        except Exception:
            logger.debug("LAN datagram from %s not handled", host, exc_info=True)

    def error_received(self, exc: Exception) -> None:
        # An ICMP error for an earlier unicast (a peer's old address): nothing to do.
        logger.debug("LAN socket: %s", exc)


def is_lan_host(text: str) -> bool:
    """Whether ``text`` is an IPv4 address worth re-probing: a private or link-local
    one (a LAN's), not loopback (another home on this machine is not re-probed), and
    never a public one (a peer across the internet is no LAN peer)."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    return (
        address.version == 4
        and (address.is_private or address.is_link_local)
        and not address.is_loopback
        and not address.is_unspecified
        and not address.is_multicast
    )
