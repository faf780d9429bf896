"""The owner comes first: which GPUs the owner's own processes took back, without I/O.

With ``reclaim_on_gpu_use`` a GPU used by a process that is not GPUMesh's (a
game, a render, the owner's own training run) is reclaimed: the allocator
withholds it and the guest jobs on it are preempted. It is offered again once
no such process has used it for ``reclaim_grace``.

This module holds the rules: which of a GPU's processes are the owner's
(:func:`owner_processes`, given which process ids are GPUMesh's), which
containers a process belongs to (:func:`container_ids`, from the text of
``/proc/PID/cgroup``), and when a GPU is reclaimed and offered again
(:class:`ReclaimTracker`, time passed in). It reads no file, no clock and no
GPU; :mod:`gpumesh.agent.reclaimer` does, and acts on what comes out.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from gpumesh.gpu.inventory import GpuProcess
from gpumesh.store.config import DESKTOP, DESKTOP_PROCESSES

__all__ = [
    "ReclaimChanges",
    "ReclaimTracker",
    "container_ids",
    "ignored_names",
    "owner_processes",
]

_CONTAINER_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
"""A full Docker container id, as cgroup paths spell it under every driver:
``/docker/ID`` (cgroupfs), ``/system.slice/docker-ID.scope`` (systemd),
``.../cri-containerd-ID.scope``."""


def container_ids(cgroup: str) -> set[str]:
    """The container ids named by the cgroup paths in ``cgroup`` (the text of
    ``/proc/PID/cgroup``, v1 or v2): empty for a process in no container."""
    found: set[str] = set()
    for line in cgroup.splitlines():
        path = line.split(":", 2)[-1]
        found.update(_CONTAINER_ID.findall(path))
    return found


def ignored_names(text: str) -> frozenset[str]:
    """The process names in ``reclaim_ignore`` (comma-separated, as config keeps it),
    ``@desktop`` spelled out."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    if DESKTOP in names:
        names = (names - {DESKTOP}) | set(DESKTOP_PROCESSES)
    return frozenset(names)


def owner_processes(
    processes: Iterable[GpuProcess], ours: Collection[int], ignore: Collection[str]
) -> dict[int, list[str]]:
    """GPU index -> the sorted names of the owner's processes on it: every process
    but GPUMesh's (pids in ``ours``) and those whose name is in ``ignore`` (compared
    as ``/proc/PID/comm`` gives it, case and all). A GPU with none is left out; a
    process without a name counts as ``pid N``."""
    owners: dict[int, set[str]] = {}
    for process in processes:
        if process.pid in ours or process.name in ignore:
            continue
        owners.setdefault(process.gpu, set()).add(process.name or f"pid {process.pid}")
    return {gpu: sorted(names) for gpu, names in sorted(owners.items())}


@dataclass(frozen=True)
class ReclaimChanges:
    """What one look at the GPUs changed."""

    reclaimed: dict[int, list[str]] = field(default_factory=dict)
    """GPUs the owner just took back -> the names of the owner's processes on them."""
    offered: list[int] = field(default_factory=list)
    """GPUs offered again: no process of the owner's used them for the grace."""

    def __bool__(self) -> bool:
        return bool(self.reclaimed or self.offered)


class ReclaimTracker:
    """Which GPUs the owner holds, fed what each look at the GPUs found.

    A GPU is reclaimed at the first look that finds a process of the owner's on
    it, and offered again at the first look at least ``grace`` seconds after the
    last one that found any. Times are any monotonic seconds the caller chooses.
    """

    def __init__(self, grace: float) -> None:
        self.grace = grace
        """Seconds without an owner's process before a GPU is offered again (the
        caller may change it between looks: ``reclaim_grace`` is read live)."""
        self._held: dict[int, list[str]] = {}
        self._last_seen: dict[int, float] = {}

    @property
    def held(self) -> dict[int, list[str]]:
        """The GPUs the owner holds now -> the names last seen on each."""
        return {gpu: list(names) for gpu, names in self._held.items()}

    def observe(self, now: float, owners: dict[int, list[str]]) -> ReclaimChanges:
        """One look: ``owners`` maps each GPU index to the names of the owner's
        processes on it now (a GPU without any may be left out or map to [])."""
        reclaimed: dict[int, list[str]] = {}
        for gpu, names in owners.items():
            if not names:
                continue
            if gpu not in self._held:
                reclaimed[gpu] = list(names)
            self._held[gpu] = list(names)
            self._last_seen[gpu] = now
        offered = [
            gpu
            for gpu in sorted(self._held)
            if not owners.get(gpu) and now - self._last_seen[gpu] >= self.grace
        ]
        for gpu in offered:
            del self._held[gpu]
            del self._last_seen[gpu]
        return ReclaimChanges(reclaimed, offered)

    def release_all(self) -> list[int]:
        """Forget every GPU held (reclaim was switched off): those to offer again."""
        released = sorted(self._held)
        self._held.clear()
        self._last_seen.clear()
        return released
