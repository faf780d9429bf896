"""agent/ratelimit: per-IP token bucket with an injected clock, and the pending cap."""

from __future__ import annotations

from gpumesh.agent.ratelimit import ConnectionLimiter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _allowed(limiter: ConnectionLimiter, host: str, attempts: int) -> int:
    return sum(limiter.allow(host) for _ in range(attempts))


def test_burst_then_refusal() -> None:
    limiter = ConnectionLimiter(rate=5.0, burst=20, clock=FakeClock())
    assert _allowed(limiter, "198.51.100.1", 20) == 20
    assert not limiter.allow("198.51.100.1")


def test_tokens_refill_at_the_rate() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(rate=5.0, burst=20, clock=clock)
    _allowed(limiter, "h", 20)
    clock.now += 1.0  # 5 tokens
    assert _allowed(limiter, "h", 10) == 5


def test_a_partial_token_is_not_enough_but_accumulates() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(rate=1.0, burst=1, clock=clock)
    assert limiter.allow("h")
    clock.now += 0.5
    assert not limiter.allow("h")
    clock.now += 0.5
    assert limiter.allow("h")


def test_refill_is_capped_at_the_burst() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(rate=5.0, burst=3, clock=clock)
    clock.now += 3600
    assert _allowed(limiter, "h", 10) == 3


def test_hosts_have_separate_buckets() -> None:
    limiter = ConnectionLimiter(rate=1.0, burst=2, clock=FakeClock())
    assert _allowed(limiter, "a", 5) == 2
    assert _allowed(limiter, "b", 5) == 2


def test_refused_attempts_do_not_consume_tokens() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(rate=1.0, burst=1, clock=clock)
    limiter.allow("h")
    for _ in range(100):
        assert not limiter.allow("h")
    clock.now += 1.0
    assert limiter.allow("h")


def test_max_pending_refuses_everyone() -> None:
    limiter = ConnectionLimiter(max_pending=2, clock=FakeClock())
    limiter.pending = 2
    assert not limiter.allow("fresh-host")
    limiter.pending = 1
    assert limiter.allow("fresh-host")


def test_memory_of_sources_stays_bounded() -> None:
    clock = FakeClock()
    limiter = ConnectionLimiter(clock=clock)
    for i in range(20_000):
        clock.now += 0.001
        assert limiter.allow(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}")
    assert len(limiter._buckets) <= 10_001
