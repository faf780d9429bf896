"""Which GPU memory this provider has promised, and to whom.

Owns the reservations on this node's GPUs: each holder (a job today; a CUDA
session or a shell with a GPU later: a :class:`Holder` is a kind and an id)
is promised an amount of memory on one or more GPUs until it is released.
Everything that tells peers about the GPUs reads it: the ``status`` reply
(each GPU's free memory for a new holder, and how many hold it), so
placement's inputs, and the ``max_vram`` cap.

What a new holder may ask for on a GPU is the memory free there now (as the
inventory reports it) minus what is promised there, capped by ``max_vram``.
Choosing a GPU and recording the promise happen with nothing awaited in
between, so two requests never both take the last room on a GPU.

A GPU the owner took back (``reclaim_on_gpu_use``: :mod:`gpumesh.agent.reclaimer`)
is withheld: no new holder lands on it, and peers are told whose it is now.

It never decides who may hold GPU memory (the services' admission does) and
never starts anything: it only keeps the books. The inventory is read on a
worker thread (``nvidia-smi`` may take a while); the books are kept on the
event loop.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpumesh.blocking import in_thread
from gpumesh.errors import LimitError
from gpumesh.gpu.inventory import GpuInfo, GpuInventory
from gpumesh.protocol.messages import GpuReport
from gpumesh.units import format_size

__all__ = ["GpuAllocator", "GpuFigures", "Holder", "HolderKind", "Reservation"]


class HolderKind(enum.StrEnum):
    """What holds GPU memory."""

    JOB = "job"
    """A hosted job: from its acceptance until it ends (or is discarded)."""
    SHELL = "shell"
    """A shell with a GPU (`exec --gpu-memory`): while it is open."""
    CUDA = "cuda"
    """A CUDA session (not offered yet)."""


_NOUNS = {HolderKind.JOB: "the job", HolderKind.SHELL: "the shell", HolderKind.CUDA: "the session"}
"""How refusals name what asked."""


@dataclass(frozen=True)
class Holder:
    """Who GPU memory is promised to: one job, one session, one shell."""

    kind: HolderKind
    id: str


@dataclass(frozen=True)
class Reservation:
    """Memory promised to one holder."""

    holder: Holder
    gpus: tuple[str, ...]
    """The GPU indexes it holds (as text, as job records keep them)."""
    memory: int
    """Bytes promised on each of them (0: the GPU without a memory figure)."""


@dataclass(frozen=True)
class GpuFigures:
    """One GPU as the allocator sees it."""

    gpu: GpuInfo
    reserved: int
    """Bytes promised to holders on it."""
    holders: int
    """How many hold it."""
    available: int
    """Bytes a new holder may still ask for on it (0 while it is the owner's)."""
    owner: str = ""
    """The owner's processes using it, while it is the owner's (reclaimed)."""


class GpuAllocator:
    """The books of one provider's GPU memory."""

    def __init__(
        self,
        inventory: Callable[[], GpuInventory],
        *,
        max_vram: int = 0,
        provider: str,
    ) -> None:
        self._make_inventory = inventory
        """Finds the inventory on first use (detecting it may take a while)."""
        self._inventory: GpuInventory | None = None
        self.max_vram = max_vram
        """Most bytes one holder may have on a GPU (``--max-vram``); 0: no cap."""
        self._provider = provider
        self._held: dict[Holder, Reservation] = {}
        self._withheld: dict[str, str] = {}
        """GPU index -> the owner's processes using it (it is the owner's until offered)."""

    @property
    def inventory(self) -> GpuInventory:
        """Where the GPU facts come from."""
        if self._inventory is None:
            self._inventory = self._make_inventory()
        return self._inventory

    # --- the owner's GPUs -------------------------------------------------------------------

    def withhold(self, index: str, owner: str) -> None:
        """GPU ``index`` is the owner's now (``owner`` names the processes using it):
        no new holder is given it until :meth:`offer`."""
        self._withheld[index] = owner

    def offer(self, index: str) -> None:
        """GPU ``index`` is offered to holders again."""
        self._withheld.pop(index, None)

    def withheld(self) -> dict[str, str]:
        """The GPUs the owner holds now -> the owner's processes on each."""
        return dict(self._withheld)

    def _owners_say(self, indexes: list[str]) -> str:
        """Why ``indexes`` (withheld GPUs) cannot be had, in one line."""
        owned = " and ".join(f"GPU {i} ({self._withheld[i]})" for i in indexes)
        verb = "is" if len(indexes) == 1 else "are"
        return f"{owned} of {self._provider} {verb} in use by its owner"

    # --- the books --------------------------------------------------------------------------

    def reservations(self) -> list[Reservation]:
        return list(self._held.values())

    def hold(self, holder: Holder, gpus: Iterable[str], memory: int) -> None:
        """Record a promise already decided (a job's record after a restart), unchecked;
        it replaces what ``holder`` held before."""
        self._held[holder] = Reservation(holder, tuple(gpus), memory)

    def release(self, holder: Holder) -> None:
        """``holder`` gives back what it held (nothing happens when it held nothing)."""
        self._held.pop(holder, None)

    async def reserve(self, holder: Holder, memory: int, preferred: str = "") -> list[str]:
        """Choose a GPU with ``memory`` bytes for ``holder`` and promise them; the GPU
        indexes (none on a machine without a GPU, for a holder that asks for no
        memory). Replaces what ``holder`` held before. Refused, with the numbers,
        past ``max_vram`` or when no GPU has the room."""
        self._check_cap(holder.kind, memory)
        gpus = await in_thread(self.inventory.gpus)
        # Nothing awaited from here on: the choice and the promise are one step.
        chosen = self.choose(gpus, holder, memory, preferred)
        self.hold(holder, chosen, memory)
        return chosen

    def choose(
        self, gpus: list[GpuInfo], holder: Holder, memory: int, preferred: str = ""
    ) -> list[str]:
        """The GPU ``reserve`` would give ``holder`` out of ``gpus`` (without promising it)."""
        self._check_cap(holder.kind, memory)
        name, noun = self._provider, _NOUNS[holder.kind]
        if not gpus:
            if memory:
                advice = (
                    "; run without --gpu-memory for a CPU-only job"
                    if holder.kind is HolderKind.JOB
                    else ""
                )
                raise LimitError(f"{name} has no NVIDIA GPU{advice}")
            return []
        reserved = self._reserved(exclude=holder)
        owned = [str(g.index) for g in gpus if str(g.index) in self._withheld]
        later = "; try again later or another peer"
        if preferred:
            matching = [g for g in gpus if str(g.index) == preferred]
            if not matching:
                raise LimitError(f"{name} has no GPU {preferred}")
            if preferred in self._withheld:
                raise LimitError(self._owners_say([preferred]) + later)
            best = matching[0]
        else:
            offered = [g for g in gpus if str(g.index) not in self._withheld]
            if not offered:
                if not memory:
                    return []  # asks for no GPU memory: it runs on the CPUs meanwhile
                raise LimitError(self._owners_say(owned) + later)
            best = max(offered, key=lambda gpu: self._available(gpu, reserved))
        available = self._available(best, reserved)
        if available < memory:
            where = "on" if not preferred else f"on GPU {preferred} of"
            also = f"; {self._owners_say(owned)}" if owned and not preferred else ""
            raise LimitError(
                f"{noun} asks for {format_size(memory)} of GPU memory; the most free {where} "
                f"{name} is {format_size(available)} (GPU {best.index} {best.name}, "
                f"{format_size(best.memory_used)} used of {format_size(best.memory_total)})"
                f"{also}"
            )
        return [str(best.index)]

    # --- what peers are told ----------------------------------------------------------------

    def figures(self, gpus: list[GpuInfo]) -> list[GpuFigures]:
        """Each of ``gpus`` with what is promised on it and what is left for a new holder."""
        reserved = self._reserved()
        holders = Counter(index for held in self._held.values() for index in held.gpus)
        return [
            GpuFigures(
                gpu=gpu,
                reserved=reserved.get(str(gpu.index), 0),
                holders=holders[str(gpu.index)],
                available=0 if str(gpu.index) in self._withheld else self._available(gpu, reserved),
                owner=self._withheld.get(str(gpu.index), ""),
            )
            for gpu in gpus
        ]

    async def report(self) -> tuple[list[GpuReport], str]:
        """This provider's GPUs as placement sees them, and where the facts come from."""
        gpus = await in_thread(self.inventory.gpus)
        report = [
            GpuReport(
                index=figures.gpu.index,
                name=figures.gpu.name[:64],
                memory_total=figures.gpu.memory_total,
                memory_used=figures.gpu.memory_used,
                available=figures.available,
                utilization=figures.gpu.utilization,
                jobs=figures.holders,
                owner=figures.owner[:255],
            )
            for figures in self.figures(gpus)
        ]
        return report, self.inventory.source

    # --- arithmetic -------------------------------------------------------------------------

    def _check_cap(self, kind: HolderKind, memory: int) -> None:
        if self.max_vram and memory > self.max_vram:
            raise LimitError(
                f"{_NOUNS[kind]} asks for {format_size(memory)} of GPU memory; "
                f"{self._provider} shares at most {format_size(self.max_vram)} (--max-vram)"
            )

    def _reserved(self, exclude: Holder | None = None) -> dict[str, int]:
        """Bytes promised per GPU index (all but ``exclude``'s)."""
        reserved: dict[str, int] = {}
        for reservation in list(self._held.values()):
            if reservation.holder == exclude:
                continue
            for index in reservation.gpus:
                reserved[index] = reserved.get(index, 0) + reservation.memory
        return reserved

    def _available(self, gpu: GpuInfo, reserved: dict[str, int]) -> int:
        """What a new holder may still ask for on ``gpu``."""
        available = gpu.memory_free - reserved.get(str(gpu.index), 0)
        if self.max_vram:
            available = min(available, self.max_vram)
        return max(0, available)
