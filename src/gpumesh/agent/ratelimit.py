"""Limits on unauthenticated connections, without I/O (the clock is injected)."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ConnectionLimiter"]


class ConnectionLimiter:
    """Token bucket per source IP, plus a cap on connections still proving identity."""

    def __init__(
        self,
        *,
        rate: float = 5.0,
        burst: int = 20,
        max_pending: int = 128,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.max_pending = max_pending
        self.pending = 0
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, host: str) -> bool:
        """Whether ``host`` may start one more connection now."""
        if self.pending >= self.max_pending:
            return False
        now = self._clock()
        tokens, last = self._buckets.get(host, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens < 1:
            self._buckets[host] = (tokens, now)
            return False
        self._buckets[host] = (tokens - 1, now)
        if len(self._buckets) > 10_000:  # forget the quietest sources first
            for key in sorted(self._buckets, key=lambda k: self._buckets[k][1])[:5000]:
                del self._buckets[key]
        return True
