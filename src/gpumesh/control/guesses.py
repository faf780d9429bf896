"""How fast one address may guess the control API's token: the rules, no I/O.

A token of the user's own (``$GPUMESH_API_TOKEN``, which ``--allow-remote``
needs) may be weaker than the home's random one, and without a bound a client
tried thousands a second. After :data:`FREE` wrong tokens in a row from one
address, every bearer request from it is refused (429) for :data:`FIRST`
seconds, and each wrong token after a wait doubles the next wait, up to
:data:`CEILING`. A right token clears the address. The refusal does not look at
the token at all, so a guess made while refused learns nothing. The clock is
injected and the first wait is a setting, so tests shorten them to seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gpumesh.errors import ConfigError
from gpumesh.settings import ENV_API_BACKOFF, env

__all__ = ["CEILING", "FIRST", "FREE", "TokenGuesses"]

FREE = 5
"""Wrong tokens in a row an address may send before it waits."""
FIRST = 1.0
"""Seconds of the first wait."""
CEILING = 60.0
"""Seconds the wait doubles up to."""
REMEMBERED = 4096
"""Addresses remembered at most; past that, those whose wait is long over go."""


@dataclass
class _Address:
    wrong: int = 0
    wait: float = 0.0
    until: float = 0.0


class TokenGuesses:
    """Wrong bearer tokens per client address, and the wait they earned."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        first: float = FIRST,
        ceiling: float = CEILING,
        free: int = FREE,
    ) -> None:
        self._clock = clock
        self.first = first
        self.ceiling = max(ceiling, first)
        self.free = free
        self._seen: dict[str, _Address] = {}

    @classmethod
    def from_env(cls, clock: Callable[[], float] = time.monotonic) -> TokenGuesses:
        """With ``$GPUMESH_API_BACKOFF`` seconds as the first wait (default 1)."""
        text = env(ENV_API_BACKOFF)
        if text is None:
            return cls(clock)
        try:
            first = float(text)
        except ValueError:
            first = -1.0
        if first <= 0:
            raise ConfigError(f"{ENV_API_BACKOFF}={text!r}: give seconds, such as 1")
        return cls(clock, first=first, ceiling=max(CEILING, first))

    def refusal(self, address: str) -> str | None:
        """Why a bearer request from ``address`` is refused now (one line), or None."""
        seen = self._seen.get(address)
        if seen is None:
            return None
        left = seen.until - self._clock()
        if left <= 0:
            return None
        return (
            f"{seen.wrong} wrong API tokens in a row from {address}, over the limit of "
            f"{self.free}: refused for {left:.1f} s more (each wrong token after a wait "
            f"doubles it, up to {self.ceiling:g} s)"
        )

    def wrong(self, address: str) -> None:
        """A wrong token from ``address`` (not while it is refused: those are not read)."""
        seen = self._seen.get(address)
        if seen is None:
            self._forget_old()
            seen = self._seen[address] = _Address()
        seen.wrong += 1
        if seen.wrong >= self.free:
            seen.wait = self.first if not seen.wait else min(self.ceiling, seen.wait * 2)
            seen.until = self._clock() + seen.wait

    def right(self, address: str) -> None:
        self._seen.pop(address, None)

    def _forget_old(self) -> None:
        if len(self._seen) < REMEMBERED:
            return
        now = self._clock()
        for address in [a for a, s in self._seen.items() if s.until + self.ceiling < now]:
            del self._seen[address]
        while len(self._seen) >= REMEMBERED:
            # The oldest entry goes first (dicts keep insertion order).
            del self._seen[next(iter(self._seen))]
