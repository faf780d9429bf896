"""UDP hole punching for one relayed session, as a state machine without I/O.

Both ends of a relayed session learn, through the relay, the other's public
address as the relay saw it plus the addresses it listens on. Each end then
sends :class:`~gpumesh.protocol.relay.Probe` packets straight to every
candidate; the first probes open the NAT mappings on the way out, so the
other side's probes get in. A path counts as direct once a probe sent to an
address is answered *from that same address* (both directions proven). The
session then moves there underneath QUIC; the relay stays as the fallback.

::

    probing --(answer from the address probed)--> direct
       |                                            |
       | (nothing within `give_up`)                 | (silent for `dead_after`)
       v                                            v
    relayed <-------------------------------------- probing (again)

Probes carry an HMAC made with the session secret only the two ends (and
the relay) know, so nobody else can pull the session elsewhere, and even the
relay can only redirect encrypted QUIC packets, never read them.

Time is passed in; nothing here reads a clock or touches a socket.
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpumesh.protocol.addresses import Address
from gpumesh.protocol.relay import Probe, encode_packet, probe_mac

__all__ = ["PunchConfig", "PunchEvent", "Puncher"]

Outgoing = list[tuple[bytes, Address]]


@dataclass(frozen=True)
class PunchConfig:
    interval: float = 0.2
    """Seconds between rounds of probes while probing."""
    give_up: float = 8.0
    """Seconds of probing without an answer before settling on the relay."""
    keepalive: float = 5.0
    """Seconds between probes on a direct path (keeps NAT mappings open)."""
    dead_after: float = 16.0
    """A direct path silent this long is abandoned (back to the relay, probing again)."""
    max_candidates: int = 16


@dataclass(frozen=True)
class PunchEvent:
    """What changed: ``direct`` (with the address) or ``lost`` or ``gave_up``."""

    kind: str
    address: Address | None = None


class Puncher:
    """Hole punching for one session: which probes to send, and which path is live."""

    def __init__(
        self,
        session: int,
        secret: bytes,
        candidates: Iterable[Address],
        now: float,
        *,
        random_tx: Callable[[], int],
        config: PunchConfig | None = None,
    ) -> None:
        self.session = session
        self._secret = secret
        self._random_tx = random_tx
        self.config = config or PunchConfig()
        self.candidates: list[Address] = []
        self.add_candidates(candidates)
        self.state = "probing"
        self.direct: Address | None = None
        self.started = now
        self.direct_after: float | None = None
        """Seconds from the start of punching to the first direct path."""
        self.rtt: float | None = None
        self._deadline = now + self.config.give_up
        self._next_send = now
        self._last_inbound = now
        self._sent: OrderedDict[int, tuple[Address, float]] = OrderedDict()
        self.heard_from: set[Address] = set()
        """Addresses an authentic probe came from: the peer is there (inbound proven)."""
        self.events: list[PunchEvent] = []

    # --- inputs ------------------------------------------------------------------

    def add_candidates(self, candidates: Iterable[Address]) -> None:
        for address in candidates:
            if address not in self.candidates and len(self.candidates) < self.config.max_candidates:
                self.candidates.append(address)

    def on_probe(self, probe: Probe, source: Address, now: float) -> Outgoing:
        """A probe or answer arrived from ``source``; returns what to send back."""
        if probe.session != self.session:
            return []
        expected = probe_mac(self._secret, probe.session, probe.tx, probe.reply)
        if not hmac.compare_digest(expected, probe.mac):
            return []
        self.heard_from.add(source)
        if not probe.reply:
            # Answer where it came from, and probe it back at once: its probe
            # just opened our side's mapping, so ours should get through now.
            # It may be an address we did not know (a port the peer's NAT picked).
            out = [(self._packet(probe.tx, reply=True), source)]
            self.add_candidates([source])
            if self.state != "direct":
                out.extend(self._probe([source], now))
            return out
        sent = self._sent.pop(probe.tx, None)
        if sent is None or sent[0] != source:
            return []
        self._last_inbound = now
        if self.state != "direct" or self.direct != source:
            self.state = "direct"
            self.direct = source
            if self.direct_after is None:
                self.direct_after = now - self.started
            self.events.append(PunchEvent("direct", source))
            self._next_send = now + self.config.keepalive
        self.rtt = now - sent[1]
        return []

    def on_inbound(self, now: float) -> None:
        """Any packet arrived over the direct path: it is alive."""
        self._last_inbound = now

    # --- timers ------------------------------------------------------------------

    def next_wakeup(self) -> float | None:
        if self.state == "relayed":
            return None
        if self.state == "direct":
            return min(self._next_send, self._last_inbound + self.config.dead_after)
        return min(self._next_send, self._deadline)

    def poll(self, now: float) -> Outgoing:
        """Probes due at ``now`` (and state changes recorded in :attr:`events`)."""
        if self.state == "direct":
            if now - self._last_inbound >= self.config.dead_after:
                lost = self.direct
                self.state = "probing"
                self.direct = None
                self._deadline = now + self.config.give_up
                self._next_send = now
                self.events.append(PunchEvent("lost", lost))
            elif now >= self._next_send:
                assert self.direct is not None
                self._next_send = now + self.config.keepalive
                return self._probe([self.direct], now)
            else:
                return []
        if self.state != "probing":
            return []
        if now >= self._deadline:
            self.state = "relayed"
            self.events.append(PunchEvent("gave_up"))
            return []
        if now < self._next_send:
            return []
        self._next_send = now + self.config.interval
        return self._probe(self.candidates, now)

    def take_events(self) -> list[PunchEvent]:
        events, self.events = self.events, []
        return events

    # --- helpers -----------------------------------------------------------------

    def _probe(self, addresses: Iterable[Address], now: float) -> Outgoing:
        out: Outgoing = []
        for address in addresses:
            tx = self._random_tx()
            self._sent[tx] = (address, now)
            out.append((self._packet(tx, reply=False), address))
        while len(self._sent) > 256:
            self._sent.popitem(last=False)
        return out

    def _packet(self, tx: int, *, reply: bool) -> bytes:
        mac = probe_mac(self._secret, self.session, tx, reply)
        return encode_packet(Probe(session=self.session, tx=tx, reply=reply, mac=mac))
