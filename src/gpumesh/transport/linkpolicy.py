"""What a QUIC link decides on its own counters and times, with no I/O: when parity
starts, which datagrams go twice before it can, what an unvalidated peer may be
sent, and when QUIC's losses make a burst worth logging.

:class:`~gpumesh.transport.quic.QuicLink` reads the clock and qh3's recovery state
and asks a :class:`LinkPolicy`; the policy never reads a clock or touches a socket.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

__all__ = ["EARLY_COPIES", "FEC_LONG_RTT", "LOSS_BURST", "LinkPolicy"]

FEC_LONG_RTT = 0.025
"""Seconds of round trip from which ``auto`` sends parity from the start: on such a
link one random loss in slow start costs QUIC seconds of a small window."""
EARLY_COPIES = 64
"""Most datagrams each side of a link sends twice before parity can start (see
:meth:`LinkPolicy.copies`)."""
LOSS_BURST = 8
"""Packets declared lost in one go from which a link logs it (debug)."""


class LinkPolicy:
    """One link's decisions, over the numbers its connection gives it.

    ``mode``: ``auto``, ``on`` or ``off`` (:func:`~gpumesh.transport.quicsetup.fec_mode`);
    ``is_client``: the dialing side; ``validated``: the accepting side already knows
    the peer receives at its address.
    """

    def __init__(self, mode: str, *, is_client: bool, validated: bool = False) -> None:
        self.fec_mode = mode
        """Whether the link offers FEC and when it sends parity."""
        self.is_client = is_client
        self.validated = validated
        """Accepting side: the peer is known to receive at its address (it echoed a
        Retry token, came through a relay session, or finished the QUIC handshake)."""
        self.fec_peer = False
        """Whether the peer said it takes FEC frames (:meth:`peer_takes_fec`)."""
        self.min_rtt = float("inf")
        """The least round trip seen so far (:meth:`least_rtt`)."""
        self.early_copies = EARLY_COPIES if self.fec_offered else 0
        """Datagrams the link may still send twice (:meth:`copies`)."""
        self.early_duplicates = 0
        """Datagrams sent twice so far."""
        self.allowance = 0
        """Accepting side, until the peer's address is validated: bytes the link may
        still send there (three times what came from it, less what went to it)."""
        self.losses_seen = 0
        """QUIC's loss count when :meth:`loss_burst` last looked."""

    @property
    def fec_offered(self) -> bool:
        """Whether to tell the peer that this end takes FEC frames."""
        return self.fec_mode != "off"

    def peer_takes_fec(self) -> bool:
        """The peer said it takes FEC frames: whether parity may go to it from now on
        (only when this end offered FEC)."""
        if self.fec_offered:
            self.fec_peer = True
        return self.fec_peer

    def least_rtt(self, sample: float | None) -> float:
        """The least round trip so far, ``sample`` (QUIC's latest, None before the
        first) included: the link's own, not what queues add under bulk."""
        if sample is not None and sample < self.min_rtt:
            self.min_rtt = sample
        return self.min_rtt

    def parity_due(self, least_rtt: float, losses: int) -> bool:
        """Whether parity should start now, with ``least_rtt`` the least round trip
        (inf before a sample) and ``losses`` the packets QUIC declared lost so far:
        only once the peer takes FEC; ``on``: at once; ``auto``: on a link of
        :data:`FEC_LONG_RTT` or more, else from its first loss."""
        if not self.fec_peer:
            return False
        long_link = least_rtt != float("inf") and least_rtt >= FEC_LONG_RTT
        return self.fec_mode == "on" or long_link or losses > 0

    @property
    def unvalidated(self) -> bool:
        """Accepting side, the peer's address not yet validated."""
        return not self.validated and not self.is_client

    def received(self, size: int) -> None:
        """``size`` bytes came from the peer (what an unvalidated answer may send grows)."""
        if self.unvalidated:
            self.allowance += 3 * size

    def sending(self, size: int) -> None:
        """``size`` bytes go to the peer."""
        if self.unvalidated:
            self.allowance -= size

    def copies(self, sizes: Sequence[int], least_rtt: float) -> int:
        """How many of the first datagrams about to go (of ``sizes`` bytes each) to
        send twice, before parity can start.

        Parity starts once the peer's Welcome says it takes FEC frames, two round
        trips in; a loss before that (an Initial, the Finished, the proof or the
        first flight of an upload) is one QUIC takes for congestion, and qh3 then
        leaves slow start at a window of a few datagrams for the whole connection
        (an upload's dialer sends some 25 datagrams before parity: at 0.5% loss,
        1 - 0.995^25, about one dial in eight loses one). A copy lost on its own
        costs nothing: QUIC drops the one that comes second as a duplicate. Only
        on a link not known to be short (``least_rtt`` inf, or :data:`FEC_LONG_RTT`
        or more; ``on``: any), for at most :data:`EARLY_COPIES` datagrams. The
        accepting side copies its handshake flight too (a lost ServerHello or
        certificate costs the same), but until the peer's address is validated
        what it sends there, copies included, stays within three times what it
        received (RFC 9000, 8.1): a copy that would pass it is left out.
        """
        if self.fec_mode != "on" and least_rtt < FEC_LONG_RTT:
            self.early_copies = 0
            return 0
        count = min(len(sizes), self.early_copies)
        if self.unvalidated:  # the first copies whose bytes together fit the allowance
            spare = self.allowance - sum(sizes)
            count = sum(1 for copied in accumulate(sizes[:count]) if copied <= spare)
        self.early_copies -= count
        self.early_duplicates += count
        return count

    def loss_burst(self, losses: int) -> int | None:
        """``losses``: QUIC's count of packets declared lost so far. The packets lost
        since the last look when they are :data:`LOSS_BURST` or more, else None."""
        burst, self.losses_seen = losses - self.losses_seen, losses
        return burst if burst >= LOSS_BURST else None
