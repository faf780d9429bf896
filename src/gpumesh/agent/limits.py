"""How much of this machine peers share, and what one peer may hold of it.

Owns the sharing limits (config ``job_cpus``, ``job_memory``, ``share_memory``,
``max_jobs_per_peer``, ``max_shells_per_peer``, ``max_requests_per_link``,
``link_buffer``), their ``auto`` defaults worked out from the machine's size,
and the admission of jobs, shells and CUDA sessions: each one promised memory
is a :class:`Claim`, and one that would take a peer past its count, or all
peers past ``share_memory``, is refused with the numbers.

Everything here but :func:`machine_size` and :func:`return_free_memory` is
pure: the machine's size, the configuration and the claims are passed in, so
the defaults are tested for machines of any size.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import gc
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from gpumesh.errors import LimitError
from gpumesh.store.config import AUTO, NO_LIMIT, Config
from gpumesh.units import format_size, parse_size

__all__ = [
    "Admission",
    "Claim",
    "Kind",
    "MachineSize",
    "ShareLimits",
    "check_admission",
    "check_share_memory",
    "default_job_cpus",
    "default_job_memory",
    "default_share_memory",
    "machine_size",
    "return_free_memory",
]

MB = 1000**2
GB = 1000**3
OWNER_RESERVE = 2 * GB
"""The least memory a sharing machine keeps for its owner (a quarter, when that is more)."""
JOBS_IN_SHARE = 8
"""``job_memory`` auto is share_memory divided by this: with the default counts (4 jobs
and 2 shells per peer) one peer holds at most 6/8 of what is shared, and another peer
always finds room for two containers."""
SMALLEST_AUTO_JOB = 256 * MB
"""``job_memory`` auto never goes below this (unless less than that is shared at all)."""
UNKNOWN_MACHINE_JOB = 4 * GB
"""``job_memory`` auto where the machine's memory cannot be read."""


class Kind(enum.StrEnum):
    JOB = "job"
    SHELL = "shell"
    CUDA = "CUDA session"


@dataclass(frozen=True)
class MachineSize:
    """What the machine has."""

    cpus: int
    """Logical CPUs."""
    memory: int
    """Bytes of physical memory; 0 when it could not be read."""


def machine_size() -> MachineSize:
    """This machine's CPUs and memory (``os.sysconf``: Linux, macOS and the BSDs)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        memory = 0
    return MachineSize(cpus=os.cpu_count() or 1, memory=max(0, memory))


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


def default_job_cpus(machine: MachineSize) -> float:
    """``job_cpus`` auto: every core but one, which stays the owner's; at least 1."""
    return float(max(1, machine.cpus - 1))


def default_share_memory(machine: MachineSize) -> int:
    """``share_memory`` auto: the machine's memory less what its owner keeps (the larger
    of 2GB and a quarter); still a quarter on a machine of 2.7GB or less. 0 (no cap)
    when the memory is not known."""
    total = machine.memory
    if total <= 0:
        return 0
    shared = max(total - max(OWNER_RESERVE, total // 4), total // 4)
    return shared // MB * MB


def default_job_memory(share_memory: int) -> int:
    """``job_memory`` auto: an eighth of what is shared (whole MB), at least 256MB."""
    if share_memory <= 0:
        return UNKNOWN_MACHINE_JOB
    return max(share_memory // JOBS_IN_SHARE // MB * MB, min(share_memory, SMALLEST_AUTO_JOB))


@dataclass(frozen=True)
class ShareLimits:
    """The sharing limits in force, ``auto`` worked out. 0 means no limit."""

    job_cpus: float
    job_memory: int
    """Bytes of memory (swap included) of each job or shell container."""
    share_memory: int
    """Bytes of memory all running jobs and shells may be promised together."""
    max_jobs_per_peer: int
    max_shells_per_peer: int
    max_links_per_peer: int
    """Connections one peer may hold at once (each with the per-connection limits)."""
    max_requests_per_link: int
    link_buffer: int
    """Bytes the agent holds for one connection (unread and unsent)."""

    @classmethod
    def from_config(cls, config: Config, machine: MachineSize) -> ShareLimits:
        cpus = config.get("job_cpus")
        share = str(config.get("share_memory"))
        if share == AUTO:
            share_memory = default_share_memory(machine)
        else:
            share_memory = 0 if share == NO_LIMIT else parse_size(share)
        memory = str(config.get("job_memory"))
        if memory == AUTO:
            job_memory = default_job_memory(share_memory or default_share_memory(machine))
        else:
            job_memory = parse_size(memory)
        buffer = str(config.get("link_buffer"))
        return cls(
            job_cpus=default_job_cpus(machine) if cpus == AUTO else float(cpus),
            job_memory=job_memory,
            share_memory=share_memory,
            max_jobs_per_peer=int(config.get("max_jobs_per_peer")),
            max_shells_per_peer=int(config.get("max_shells_per_peer")),
            max_links_per_peer=int(config.get("max_links_per_peer")),
            max_requests_per_link=int(config.get("max_requests_per_link")),
            link_buffer=0 if buffer == NO_LIMIT else parse_size(buffer),
        )

    def describe(self) -> str:
        """One line for the log: what every container gets and what a peer may hold."""

        def count(value: int) -> str:
            return str(value) if value else "no limit"

        def size(value: int) -> str:
            return format_size(value) if value else "no limit"

        if not self.job_cpus:
            cpus = "no CPU limit"
        else:
            cpus = f"{self.job_cpus:g} CPU" + ("" if self.job_cpus == 1 else "s")
        return (
            f"containers {size(self.job_memory)} memory and {cpus} each, "
            f"{size(self.share_memory)} memory in all; per peer "
            f"{count(self.max_jobs_per_peer)} jobs, {count(self.max_shells_per_peer)} "
            f"shells and {count(self.max_links_per_peer)} connections; per connection "
            f"{count(self.max_requests_per_link)} requests and "
            f"{size(self.link_buffer)} held"
        )


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
    ) -> None:
        self._limits = limits
        self._jobs = jobs
        self._provider = provider
        self._held: dict[object, Claim] = {}
        """Open shells and CUDA sessions."""

    def claims(self) -> list[Claim]:
        """Everything promised memory now: unfinished jobs, open shells and CUDA sessions."""
        return [*self._jobs(self._limits()), *self._held.values()]

    def admit_job(self, peer_id: str) -> None:
        """Refuse a new job of ``peer_id`` that would go past a limit."""
        limits = self._limits()
        held = [*self._jobs(limits), *self._held.values()]
        check_admission(Kind.JOB, peer_id, held, limits, self._provider)

    @contextlib.contextmanager
    def shell(self, peer_id: str) -> Iterator[None]:
        """Hold a shell of ``peer_id`` for the block (refused past a limit)."""
        limits = self._limits()
        held = [*self._jobs(limits), *self._held.values()]
        check_admission(Kind.SHELL, peer_id, held, limits, self._provider)
        with self._holding(Claim(peer_id, Kind.SHELL, limits.job_memory)):
            yield

    @contextlib.contextmanager
    def cuda(self, peer_id: str, memory: int) -> Iterator[None]:
        """Hold a CUDA session of ``memory`` bytes for ``peer_id`` for the block (refused
        past ``share_memory``; its count per peer is the CUDA service's)."""
        limits = self._limits()
        held = [*self._jobs(limits), *self._held.values()]
        check_share_memory(Kind.CUDA, memory, held, limits, self._provider)
        with self._holding(Claim(peer_id, Kind.CUDA, memory)):
            yield

    @contextlib.contextmanager
    def _holding(self, claim: Claim) -> Iterator[None]:
        token = object()
        self._held[token] = claim
        try:
            yield
        finally:
            del self._held[token]
