"""What one peer may hold of what this machine shares.

The admission of jobs, shells and CUDA sessions within the sharing limits
(:class:`~gpumesh.store.limits.ShareLimits`): each one promised memory is a
:class:`Claim`, and one that would take a peer past its count, or all peers
past ``share_memory``, is refused with the numbers.

Everything here but :func:`return_free_memory` is pure: the limits and the
claims are passed in.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import gc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from gpumesh.errors import LimitError
from gpumesh.store.limits import ShareLimits
from gpumesh.units import format_size

__all__ = [
    "Admission",
    "Claim",
    "Kind",
    "check_admission",
    "check_share_memory",
    "return_free_memory",
]


class Kind(enum.StrEnum):
    JOB = "job"
    SHELL = "shell"
    CUDA = "CUDA session"


def return_free_memory() -> None:
    """Hand memory the process freed back to the system (glibc's ``malloc_trim``).

    glibc keeps freed heap memory for reuse, so the buffers of a connection that
    closed would otherwise stay in the agent's RSS; elsewhere this does nothing.
    """
    trim = _malloc_trim()
    if trim is not None:
        gc.collect()  # what reference cycles (tracebacks) still hold
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None
    return trim


@dataclass(frozen=True)
class Claim:
    """Memory promised to one container: a job's from its acceptance to its end (retry
    backoffs included: it will run again), a shell's while it is open."""

    peer_id: str
    kind: Kind
    memory: int


def check_admission(
    kind: Kind,
    peer_id: str,
    claims: Iterable[Claim],
    limits: ShareLimits,
    provider: str,
) -> None:
    """Refuse (LimitError, one line with the numbers) a new ``kind`` container for
    ``peer_id`` that would go past the peer's count or past ``share_memory``."""
    held = list(claims)
    own = sum(1 for claim in held if claim.peer_id == peer_id and claim.kind is kind)
    if kind is Kind.JOB:
        cap, key, what, then = (
            limits.max_jobs_per_peer,
            "max_jobs_per_peer",
            "unfinished jobs",
            "wait for one to end, or cancel one",
        )
    else:
        cap, key, what, then = (
            limits.max_shells_per_peer,
            "max_shells_per_peer",
            "shells open",
            "close one first",
        )
    if cap and own >= cap:
        raise LimitError(
            f"{provider} refused the {kind}: you have {own} {what} there, and its {key} "
            f"is {cap}; {then}"
        )
    check_share_memory(kind, limits.job_memory, held, limits, provider)


def check_share_memory(
    kind: Kind, memory: int, claims: Iterable[Claim], limits: ShareLimits, provider: str
) -> None:
    """Refuse (LimitError, one line with the numbers) a new ``kind`` that would hold
    ``memory`` more than ``share_memory`` leaves beside ``claims``."""
    if not limits.share_memory:
        return
    promised = sum(claim.memory for claim in claims)
    if promised + memory <= limits.share_memory:
        return
    if kind is Kind.CUDA:
        size, then = format_size(memory), "ask for less (--memory) or try again when one ends"
    else:
        size, then = f"{format_size(memory)} (job_memory)", "try again when one of them ends"
    raise LimitError(
        f"{provider} refused the {kind}: {format_size(promised)} of memory is promised to its "
        f"running jobs, shells and CUDA sessions, and this {kind}'s {size} would go over "
        f"its share_memory of {format_size(limits.share_memory)}; {then}"
    )


class Admission:
    """Admits jobs and shells on this provider (no I/O: jobs' claims come from a callable).

    Jobs are claimed by their records (every unfinished job), so admitting one is a
    check made just before its record is written, with nothing awaited in between.
    Shells and CUDA sessions are held here while they last: a CUDA session's
    worker may hold its whole memory in host memory (the fallback's device
    memory, or the driver's copy of an allocation on its way to the consumer).
    """

    def __init__(
        self,
        limits: Callable[[], ShareLimits],
        jobs: Callable[[ShareLimits], list[Claim]],
        provider: str,
        paused: Callable[[], bool] = lambda: False,
    ) -> None:
        """``paused``: whether the owner took the machine back (`gpumesh pause`): then
        nothing is admitted."""
        self._limits = limits
        self._jobs = jobs
        self._provider = provider
        self._paused = paused
        self._held: dict[object, Claim] = {}
        """Open shells and CUDA sessions."""

    def claims(self) -> list[Claim]:
        """Everything promised memory now: unfinished jobs, open shells and CUDA sessions."""
        return [*self._jobs(self._limits()), *self._held.values()]

    def admit_job(self, peer_id: str) -> None:
        """Refuse a new job of ``peer_id`` that would go past a limit."""
        self._check_paused("jobs")
        limits = self._limits()
        held = [*self._jobs(limits), *self._held.values()]
        check_admission(Kind.JOB, peer_id, held, limits, self._provider)

    @contextlib.contextmanager
    def shell(self, peer_id: str) -> Iterator[None]:
        """Hold a shell of ``peer_id`` for the block (refused past a limit)."""
        self._check_paused("shells")
        limits = self._limits()
        held = [*self._jobs(limits), *self._held.values()]
        check_admission(Kind.SHELL, peer_id, held, limits, self._provider)
        with self._holding(Claim(peer_id, Kind.SHELL, limits.job_memory)):
            yield

    @contextlib.contextmanager
    def cuda(self, peer_id: str, memory: int) -> Iterator[None]:
        """Hold a CUDA session of ``memory`` bytes for ``peer_id`` for the block (refused
        past ``share_memory``; its count per peer is the CUDA service's)."""
        self._check_paused("CUDA sessions")
        limits = self._limits()
        held = [*self._jobs(limits), *self._held.values()]
        check_share_memory(Kind.CUDA, memory, held, limits, self._provider)
        with self._holding(Claim(peer_id, Kind.CUDA, memory)):
            yield

    def _check_paused(self, what: str) -> None:
        if self._paused():
            raise LimitError(
                f"{self._provider} is paused by its owner: it takes no {what} until its owner "
                "resumes sharing; try later, or another peer (`gpumesh run --group`)"
            )

    @contextlib.contextmanager
    def _holding(self, claim: Claim) -> Iterator[None]:
        token = object()
        self._held[token] = claim
        try:
            yield
        finally:
            del self._held[token]
