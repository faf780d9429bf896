"""Who may start a connection, and how refusals are reported; without I/O
(the clock is injected).

A new connection holds a slot until its dialer has proven a paired, allowed
identity. Budgets keep strangers from taking every slot:

* An Initial from an address nobody has validated may be forged, so it is
  never charged to, nor held against, the address it claims. Such
  connections share one small allowance for the whole endpoint (``quiet_rate``,
  ``quiet_burst``, at most ``max_unvalidated`` at once); past it, the dialer
  is asked to validate its address with a QUIC Retry (no state is kept).
* A validated address (it echoed a Retry token, or it finished a QUIC
  handshake) has a bucket of its own (``rate``, ``burst``) and at most
  ``per_source_pending`` connections mid-proof.
* A validated address whose connection fails or abandons the identity proof
  goes to the penalty box: its new connections are dropped for ``penalty``
  seconds, doubling with each further failure up to ``max_penalty``.
* Strangers share ``max_pending - reserved`` slots; an address that proved a
  paired identity lately may also use the ``reserved`` ones, and is not held
  to ``per_source_pending``, until it fails a proof.

:class:`RefusalTally` turns refusals into one summary line per interval
instead of a line per packet.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from gpumesh.protocol.admission import Admission, DropReason

__all__ = ["ConnectionLimiter", "Outcome", "RefusalSummary", "RefusalTally", "Slot"]

_MAX_SOURCES = 10_000


class Outcome(Enum):
    """How a connection's identity proof ended."""

    PROVEN = "proven"
    """A paired, allowed peer: its address is trusted for a while."""
    FAILED = "failed"
    """Failed or abandoned by a sender known to receive at its address: a penalty."""
    UNATTRIBUTED = "unattributed"
    """Ended before the address was validated (it may have been forged): no penalty."""
    REFUSED = "refused"
    """A paired peer the owner denied: its proof was good, so no penalty (its address
    may be shared with allowed peers), and no trust either."""


@dataclass(slots=True)
class _Source:
    tokens: float
    last: float
    """When ``tokens`` was last brought up to date (also: last activity)."""
    pending: int = 0
    strikes: int = 0
    boxed_until: float = 0.0
    trusted_until: float = 0.0


@dataclass(frozen=True, slots=True)
class Slot:
    """A connection mid-proof, as counted: give it back with :meth:`ConnectionLimiter.closed`."""

    host: str
    validated: bool


class ConnectionLimiter:
    """Budgets for connections that have not proven an identity yet (see the module)."""

    def __init__(
        self,
        *,
        rate: float = 5.0,
        burst: int = 20,
        max_pending: int = 128,
        reserved: int | None = None,
        per_source_pending: int = 4,
        quiet_rate: float = 4.0,
        quiet_burst: int = 16,
        max_unvalidated: int = 16,
        penalty: float = 2.0,
        max_penalty: float = 60.0,
        trust_for: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.max_pending = max_pending
        self.reserved = max_pending // 4 if reserved is None else min(reserved, max_pending)
        """Slots strangers cannot take (default a quarter: 32 of 128)."""
        self.per_source_pending = per_source_pending
        self.quiet_rate = quiet_rate
        self.quiet_burst = quiet_burst
        """0: every new connection must validate its address first (always Retry)."""
        self.max_unvalidated = max_unvalidated
        self.penalty = penalty
        self.max_penalty = max_penalty
        self.trust_for = trust_for
        self.pending = 0
        """Connections mid-proof, validated or not."""
        self.unvalidated = 0
        """Of which made without a validated address."""
        self._clock = clock
        self._quiet_tokens = float(quiet_burst)
        self._quiet_last = clock()
        self._sources: dict[str, _Source] = {}

    # --- decisions ------------------------------------------------------------------------

    def admit(self, host: str, validated: bool) -> Admission | DropReason:
        """Whether a new connection from ``host`` may start now.

        ``ACCEPT`` has charged the budget it came from; then call :meth:`opened`
        when the connection exists (or :meth:`failed` when its Initial was junk).
        """
        now = self._clock()
        source = self._sources.get(host)
        if not validated:
            if source is not None and now < source.boxed_until:
                return Admission.RETRY  # so the box applies, if the address is really its own
            return self._admit_unvalidated(now)
        if source is None:
            source = self._remember(host, now)
        if now < source.boxed_until:
            return DropReason.PENALIZED
        trusted = now < source.trusted_until
        if not trusted and source.pending >= self.per_source_pending:
            return DropReason.ADDRESS_BUSY
        if self.pending >= (self.max_pending if trusted else self.max_pending - self.reserved):
            return DropReason.BUSY
        source.tokens = min(float(self.burst), source.tokens + (now - source.last) * self.rate)
        source.last = now
        if source.tokens < 1:
            return DropReason.OVER_RATE
        source.tokens -= 1
        return Admission.ACCEPT

    def _admit_unvalidated(self, now: float) -> Admission:
        if (
            self.unvalidated >= self.max_unvalidated
            or self.pending >= self.max_pending - self.reserved
        ):
            return Admission.RETRY
        refill = (now - self._quiet_last) * self.quiet_rate if self.quiet_rate else 0.0
        self._quiet_tokens = min(float(self.quiet_burst), self._quiet_tokens + refill)
        self._quiet_last = now
        if self._quiet_tokens < 1:
            return Admission.RETRY
        self._quiet_tokens -= 1
        return Admission.ACCEPT

    # --- bookkeeping ----------------------------------------------------------------------

    def opened(self, host: str, validated: bool) -> Slot:
        """A connection admitted by :meth:`admit` now exists and holds a slot."""
        self.pending += 1
        if validated:
            source = self._sources.get(host) or self._remember(host, self._clock())
            source.pending += 1
        else:
            self.unvalidated += 1
        return Slot(host, validated)

    def closed(self, slot: Slot, outcome: Outcome) -> None:
        """The connection in ``slot`` finished its proof, or gave up."""
        self.pending -= 1
        source = self._sources.get(slot.host)
        if slot.validated:
            if source is not None:
                source.pending = max(0, source.pending - 1)
        else:
            self.unvalidated -= 1
        if outcome is Outcome.PROVEN:
            source = source or self._remember(slot.host, self._clock())
            source.strikes = 0
            source.trusted_until = self._clock() + self.trust_for
        elif outcome is Outcome.FAILED:
            self.failed(slot.host)

    def failed(self, host: str) -> None:
        """A validated ``host`` failed (or abandoned) a connection: into the penalty box."""
        now = self._clock()
        source = self._sources.get(host) or self._remember(host, now)
        source.strikes += 1
        source.trusted_until = 0.0
        box = min(self.max_penalty, self.penalty * 2 ** min(source.strikes - 1, 30))
        source.boxed_until = max(source.boxed_until, now + box)
        source.last = max(source.last, now)

    def _remember(self, host: str, now: float) -> _Source:
        if len(self._sources) >= _MAX_SOURCES:
            self._forget_some(now)
        source = _Source(tokens=float(self.burst), last=now)
        self._sources[host] = source
        return source

    def _forget_some(self, now: float) -> None:
        # The quietest half goes, idle addresses first: one mid-proof, boxed or trusted
        # keeps what it holds through a flood of others for as long as possible.
        def keep(item: tuple[str, _Source]) -> tuple[bool, float]:
            source = item[1]
            busy = source.boxed_until > now or source.trusted_until > now
            return busy, source.last

        ordered = sorted(self._sources.items(), key=keep)
        for host, source in ordered[: len(ordered) // 2]:
            if not source.pending:  # its slot must find it again
                del self._sources[host]


@dataclass(frozen=True, slots=True)
class RefusalSummary:
    text: str
    refused: int
    """Packets refused in the interval (0 when it only reports Retries or failed proofs)."""


@dataclass
class RefusalTally:
    """Counts refused packets, Retries and failed proofs for a summary line per interval.

    The first refusal after a quiet interval is reported at once, so a flood
    shows up when it starts; then at most one line per ``interval``.
    """

    interval: float = 10.0
    clock: Callable[[], float] = time.monotonic
    max_addresses: int = 4096
    individually: int = 3
    """Failed proofs per interval logged one by one (peers' mistakes are worth a line)."""
    totals: Counter[DropReason] = field(default_factory=Counter)
    """Every refusal since start, by reason (never reset: for tests and diagnostics)."""
    retries_total: int = 0
    _counts: Counter[DropReason] = field(default_factory=Counter)
    _hosts: set[str] = field(default_factory=set)
    _retries: int = 0
    _failed: int = 0
    _since: float | None = None
    _reported: float = -math.inf

    def note(self, host: str, reason: DropReason) -> None:
        self._start()
        self._counts[reason] += 1
        self.totals[reason] += 1
        if len(self._hosts) < self.max_addresses:
            self._hosts.add(host)

    def retried(self) -> None:
        self._start()
        self._retries += 1
        self.retries_total += 1

    def failed_proof(self) -> bool:
        """Count one failed proof; True while this interval's are few enough to log each."""
        self._start()
        self._failed += 1
        return self._failed <= self.individually

    def due(self, flush: bool = False) -> RefusalSummary | None:
        """The summary since the last one, once ``interval`` has passed since it
        (``flush``: now, if there is anything to say)."""
        now = self.clock()
        if self._since is None or (now - self._reported < self.interval and not flush):
            return None
        seconds = max(1, round(now - self._since))
        refused = sum(self._counts.values())
        parts = []
        if self._retries:
            parts.append(f"sent {_plural(self._retries, 'Retry', 'Retries')} (address validation)")
        if self._failed:
            parts.append(
                f"{_plural(self._failed, 'connection')} failed or abandoned the identity proof"
            )
        if refused:
            hosts = _plural(len(self._hosts), "address", "addresses")
            if len(self._hosts) >= self.max_addresses:
                hosts = f"{self.max_addresses}+ addresses"
            reasons = ", ".join(f"{n} {reason.value}" for reason, n in self._counts.most_common())
            text = (
                f"refused {_plural(refused, 'packet')} from {hosts} in the last {seconds} s: "
                f"{reasons}"
            )
            if parts:
                text += "; also " + "; ".join(parts)
        else:
            text = f"in the last {seconds} s: " + "; ".join(parts)
        self._counts.clear()
        self._hosts.clear()
        self._retries = self._failed = 0
        self._since = None
        self._reported = now
        return RefusalSummary(text, refused)

    def _start(self) -> None:
        if self._since is None:
            self._since = self.clock()


def _plural(count: int, singular: str, plural: str | None = None) -> str:
    return f"{count} {singular if count == 1 else plural or singular + 's'}"
