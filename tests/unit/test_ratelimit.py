"""agent/ratelimit: budgets for unauthenticated connections, the penalty box, and the
refusal summary, with an injected clock."""

from __future__ import annotations

from gpumesh.agent.ratelimit import ConnectionLimiter, Outcome, RefusalTally
from gpumesh.protocol.admission import Admission, DropReason

ACCEPT = Admission.ACCEPT


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _accepted(limiter: ConnectionLimiter, host: str, attempts: int, validated: bool = True) -> int:
    return sum(limiter.admit(host, validated) is ACCEPT for _ in range(attempts))


# --- a validated address's bucket ---------------------------------------------------------


def test_burst_then_refusal() -> None:
    limiter = ConnectionLimiter(rate=5.0, burst=20, clock=FakeClock())
    assert _accepted(limiter, "198.51.100.1", 20) == 20
    assert limiter.admit("198.51.100.1", True) is DropReason.OVER_RATE


def test_tokens_refill_at_the_rate() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(rate=5.0, burst=20, clock=clock)
    _accepted(limiter, "h", 20)
    clock.now += 1.0  # 5 tokens
    assert _accepted(limiter, "h", 10) == 5


def test_a_partial_token_is_not_enough_but_accumulates() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(rate=1.0, burst=1, clock=clock)
    assert limiter.admit("h", True) is ACCEPT
    clock.now += 0.5
    assert limiter.admit("h", True) is DropReason.OVER_RATE
    clock.now += 0.5
    assert limiter.admit("h", True) is ACCEPT


def test_refill_is_capped_at_the_burst() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(rate=5.0, burst=3, clock=clock)
    clock.now += 3600
    assert _accepted(limiter, "h", 10) == 3


def test_hosts_have_separate_buckets() -> None:
    limiter = ConnectionLimiter(rate=1.0, burst=2, clock=FakeClock())
    assert _accepted(limiter, "a", 5) == 2
    assert _accepted(limiter, "b", 5) == 2


def test_refused_attempts_do_not_consume_tokens() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(rate=1.0, burst=1, clock=clock)
    limiter.admit("h", True)
    for _ in range(100):
        assert limiter.admit("h", True) is DropReason.OVER_RATE
    clock.now += 1.0
    assert limiter.admit("h", True) is ACCEPT


# --- addresses nobody validated -------------------------------------------------------------


def test_unvalidated_connections_share_a_quiet_allowance_then_must_validate() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(quiet_rate=2.0, quiet_burst=3, clock=clock)
    verdicts = [limiter.admit(f"203.0.113.{i}", False) for i in range(5)]
    assert verdicts == [ACCEPT, ACCEPT, ACCEPT, Admission.RETRY, Admission.RETRY]
    clock.now += 0.5  # one more
    assert limiter.admit("203.0.113.9", False) is ACCEPT
    assert limiter.admit("203.0.113.9", False) is Admission.RETRY


def test_quiet_burst_zero_always_asks_for_validation() -> None:
    limiter = ConnectionLimiter(quiet_burst=0, clock=FakeClock())
    assert limiter.admit("h", False) is Admission.RETRY
    assert limiter.admit("h", True) is ACCEPT


def test_forged_sources_never_spend_or_box_the_address_they_claim() -> None:
    limiter = ConnectionLimiter(rate=0.001, burst=1, quiet_burst=1000, clock=FakeClock())
    for _ in range(500):  # someone forging the peer's address, never finishing anything
        assert limiter.admit("192.0.2.10", False) is ACCEPT
        limiter.closed(limiter.opened("192.0.2.10", False), Outcome.UNATTRIBUTED)
    assert limiter.admit("192.0.2.10", True) is ACCEPT  # the real peer, validated


def test_unvalidated_connections_are_capped_at_once() -> None:
    limiter = ConnectionLimiter(quiet_burst=100, max_unvalidated=2, clock=FakeClock())
    slots = []
    for i in range(2):
        assert limiter.admit(f"h{i}", False) is ACCEPT
        slots.append(limiter.opened(f"h{i}", False))
    assert limiter.admit("h9", False) is Admission.RETRY
    limiter.closed(slots[0], Outcome.UNATTRIBUTED)
    assert limiter.admit("h9", False) is ACCEPT
    assert limiter.pending == limiter.unvalidated == 1


# --- slots mid-proof ----------------------------------------------------------------------


def test_strangers_leave_the_reserve_to_trusted_addresses() -> None:
    limiter = ConnectionLimiter(max_pending=4, reserved=2, per_source_pending=10, clock=FakeClock())
    # peer proved itself once; now strangers take every slot they may.
    limiter.closed(limiter.opened("peer", True), Outcome.PROVEN)
    for host in ("s1", "s2"):
        assert limiter.admit(host, True) is ACCEPT
        limiter.opened(host, True)
    assert limiter.admit("s3", True) is DropReason.BUSY
    assert limiter.admit("s3", False) is Admission.RETRY
    assert limiter.admit("peer", True) is ACCEPT
    limiter.opened("peer", True)
    assert limiter.admit("peer", True) is ACCEPT
    limiter.opened("peer", True)
    assert limiter.admit("peer", True) is DropReason.BUSY  # the whole table is full


def test_one_address_holds_only_so_many_slots_unless_trusted() -> None:
    limiter = ConnectionLimiter(per_source_pending=2, clock=FakeClock())
    for _ in range(2):
        assert limiter.admit("s", True) is ACCEPT
        limiter.opened("s", True)
    assert limiter.admit("s", True) is DropReason.ADDRESS_BUSY
    limiter.closed(limiter.opened("peer", True), Outcome.PROVEN)
    for _ in range(5):
        assert limiter.admit("peer", True) is ACCEPT
        limiter.opened("peer", True)


# --- the penalty box --------------------------------------------------------------------------


def test_a_failed_proof_boxes_a_validated_address_for_longer_each_time() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(penalty=2.0, max_penalty=5.0, clock=clock)
    for box in (2.0, 4.0, 5.0, 5.0):  # doubling, up to the ceiling
        assert limiter.admit("m", True) is ACCEPT
        limiter.closed(limiter.opened("m", True), Outcome.FAILED)
        assert limiter.admit("m", True) is DropReason.PENALIZED
        clock.now += box - 0.01
        assert limiter.admit("m", True) is DropReason.PENALIZED
        clock.now += 0.02
    # Boxed, it cannot slip in through the allowance for unvalidated addresses either.
    limiter.failed("m")
    assert limiter.admit("m", False) is Admission.RETRY
    assert limiter.admit("someone-else", True) is ACCEPT


def test_a_proof_clears_the_strikes() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(penalty=2.0, clock=clock)
    for _ in range(3):
        limiter.failed("p")
    clock.now += 60
    limiter.closed(limiter.opened("p", True), Outcome.PROVEN)
    limiter.failed("p")  # a later mistake costs the first penalty again
    clock.now += 2.01
    assert limiter.admit("p", True) is ACCEPT


def test_a_failure_ends_trust() -> None:
    limiter = ConnectionLimiter(per_source_pending=1, penalty=0.0, clock=FakeClock())
    limiter.closed(limiter.opened("p", True), Outcome.PROVEN)
    limiter.closed(limiter.opened("p", True), Outcome.FAILED)
    limiter.opened("p", True)
    assert limiter.admit("p", True) is DropReason.ADDRESS_BUSY


def test_unattributed_failures_cost_nothing() -> None:
    limiter = ConnectionLimiter(clock=FakeClock())
    for _ in range(10):
        limiter.closed(limiter.opened("h", True), Outcome.UNATTRIBUTED)
    assert limiter.admit("h", True) is ACCEPT
    assert limiter.pending == 0


def test_memory_of_sources_stays_bounded_and_keeps_the_box() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(rate=1000.0, clock=clock)
    limiter.failed("boxed")
    slot = limiter.admit("busy", True), limiter.opened("busy", True)
    for i in range(30_000):
        clock.now += 0.00001
        host = f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}"
        assert limiter.admit(host, True) is ACCEPT
    assert len(limiter._sources) <= 10_000
    assert limiter.admit("boxed", True) is DropReason.PENALIZED
    limiter.closed(slot[1], Outcome.UNATTRIBUTED)
    assert limiter.pending == 0


# --- the refusal summary --------------------------------------------------------------------


def test_refusals_make_one_line_per_interval() -> None:
    clock = FakeClock()
    tally = RefusalTally(interval=10.0, clock=clock)
    assert tally.due() is None
    tally.note("a", DropReason.NOT_INITIAL)
    first = tally.due()  # the first refusal after a quiet spell shows at once
    assert first is not None and first.refused == 1
    for i in range(5000):
        tally.note(f"10.0.0.{i % 16}", DropReason.NOT_INITIAL if i % 5 else DropReason.OVER_RATE)
        tally.retried()
        assert tally.due() is None
    clock.now += 10
    summary = tally.due()
    assert summary is not None
    assert summary.refused == 5000
    assert summary.text == (
        "refused 5000 packets from 16 addresses in the last 10 s: 4000 not a QUIC Initial, "
        "1000 over their address's rate; also sent 5000 Retries (address validation)"
    )
    clock.now += 10
    assert tally.due() is None  # nothing new
    assert tally.totals[DropReason.NOT_INITIAL] == 4001


def test_failed_proofs_are_logged_one_by_one_only_while_few() -> None:
    clock = FakeClock()
    tally = RefusalTally(interval=10.0, clock=clock, individually=2)
    assert [tally.failed_proof() for _ in range(4)] == [True, True, False, False]
    summary = tally.due(flush=True)
    assert summary is not None and summary.refused == 0
    assert summary.text == "in the last 1 s: 4 connections failed or abandoned the identity proof"
    assert tally.failed_proof()


def test_the_summary_counts_at_most_so_many_addresses() -> None:
    clock = FakeClock()
    tally = RefusalTally(interval=10.0, clock=clock, max_addresses=100)
    for i in range(1000):
        tally.note(f"h{i}", DropReason.STRAY)
    summary = tally.due()
    assert summary is not None
    assert "refused 1000 packets from 100+ addresses" in summary.text
    assert len(tally._hosts) == 0
