"""The sharing limits the configuration sets, with their ``auto`` worked out.

Config ``job_cpus``, ``job_memory``, ``share_memory``, ``max_jobs_per_peer``,
``max_shells_per_peer``, ``max_links_per_peer``, ``max_requests_per_link`` and
``link_buffer`` as one :class:`ShareLimits`; ``auto`` comes from the machine's
size. The agent admits jobs, shells and CUDA sessions within them
(:mod:`gpumesh.agent.limits`); ``gpumesh doctor`` reads them too.

Everything here but :func:`machine_size` is pure: the machine's size and the
configuration are passed in, so the defaults are tested for machines of any size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpumesh.store.config import AUTO, NO_LIMIT, Config
from gpumesh.units import format_size, parse_size

__all__ = [
    "MachineSize",
    "ShareLimits",
    "default_job_cpus",
    "default_job_memory",
    "default_share_memory",
    "machine_size",
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
