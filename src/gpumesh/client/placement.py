"""Placing a job on a group: probe the members, skip the unfit, pick the roomiest GPU.

:func:`choose` is pure (no I/O, no clock): it takes probe results and returns
the choice and a reason for every member. :func:`probe` asks every member for
its status in parallel, each within a short timeout, so a dead member costs at
most that timeout and never delays the others.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpumesh.errors import GPUMeshError, LimitError, NotPairedError, UnreachableError
from gpumesh.protocol.messages import GpuReport, StatusReply, StatusRequest
from gpumesh.store.peers import Peer
from gpumesh.transport.reach import unreachable
from gpumesh.units import format_size

if TYPE_CHECKING:
    from gpumesh.client.node import Node

__all__ = [
    "BUSY_UTILIZATION",
    "PROBE_PATIENCE",
    "PROBE_TIMEOUT",
    "Candidate",
    "Placement",
    "Probe",
    "choose",
    "evaluate",
    "place",
    "probe",
]

PROBE_TIMEOUT = 1.0
"""Seconds a member has to answer a placement probe."""
PROBE_PATIENCE = 5.0
"""Seconds a probe waits for its first answer when no member answered within
:data:`PROBE_TIMEOUT` (a loaded machine, or a path still being dialled): the
members that are merely slow are then not all called unreachable at once."""
BUSY_UTILIZATION = 80
"""A GPU above this utilisation (percent) counts as busy."""


@dataclass(frozen=True)
class Probe:
    """What one member said (or why it said nothing)."""

    name: str
    peer: Peer | None
    """None when the member is not paired with this node."""
    status: StatusReply | None = None
    error: str = ""
    rtt_ms: float = 0.0
    unreachable: bool = False
    """No answer came (no path, or too slow), as opposed to an answer refusing or failing."""


@dataclass(frozen=True)
class Candidate:
    name: str
    eligible: bool
    reason: str
    """Why it was chosen or skipped, for people."""
    gpu: GpuReport | None = None
    """The GPU this member would give the job (None: CPU only, or skipped)."""
    headroom: int = 0
    """Bytes of GPU memory left after the job."""
    rtt_ms: float = 0.0
    jobs: int = 0
    """GPUMesh jobs queued or running there (on a GPU or not)."""
    gpus_busy: bool = False
    """Every GPU it has is running jobs or above :data:`BUSY_UTILIZATION`."""

    @property
    def busy(self) -> bool:
        """Whether it is doing GPUMesh work now, or all its GPUs are busy."""
        return self.jobs > 0 or self.gpus_busy


@dataclass(frozen=True)
class Placement:
    chosen: Candidate | None
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def peer_name(self) -> str | None:
        return self.chosen.name if self.chosen else None


def evaluate(probe_result: Probe, gpu_memory: int) -> Candidate:
    name = probe_result.name
    if probe_result.peer is None:
        return Candidate(name, False, "not paired with you: ask for its `gpumesh pair-code`")
    if probe_result.status is None:
        return Candidate(name, False, probe_result.error or "unreachable")
    status = probe_result.status
    if not status.sharing:
        return Candidate(name, False, "not sharing")
    if status.paused:
        return Candidate(name, False, "paused by its owner")
    gpus = status.gpus
    rtt_ms, jobs = probe_result.rtt_ms, status.running_jobs
    if not gpus or not status.container_gpus:
        # Its jobs get no GPU: no NVIDIA GPU, or its Docker cannot give them.
        lacks = "no NVIDIA GPU" if not gpus else "its Docker cannot give GPUs to containers"
        if gpu_memory:
            return Candidate(name, False, lacks, rtt_ms=rtt_ms, jobs=jobs)
        if jobs:
            # A CPU-only node's only room is its CPUs, and GPUMesh jobs hold them.
            return Candidate(name, False, f"busy ({_jobs(jobs)})", rtt_ms=rtt_ms, jobs=jobs)
        reason = "CPU only" if not gpus else f"CPU only ({lacks})"
        return Candidate(name, True, reason, rtt_ms=rtt_ms)
    idle = [
        g for g in gpus if not g.owner and g.jobs == 0 and (g.utilization or 0) <= BUSY_UTILIZATION
    ]
    if not idle:
        busiest = ", ".join(_busy(g) for g in gpus)
        return Candidate(name, False, f"busy ({busiest})", rtt_ms=rtt_ms, jobs=jobs, gpus_busy=True)
    best = max(idle, key=lambda g: g.available)
    if best.available < gpu_memory:
        return Candidate(
            name,
            False,
            f"not enough GPU memory ({format_size(best.available)} free on its idlest GPU, "
            f"{format_size(gpu_memory)} needed)",
            rtt_ms=rtt_ms,
            jobs=jobs,
        )
    return Candidate(
        name,
        True,
        f"GPU {best.index} {best.name}, {format_size(best.available)} free"
        + (f", {_jobs(jobs)} on its other GPUs or CPUs" if jobs else ""),
        gpu=best,
        headroom=best.available - gpu_memory,
        rtt_ms=rtt_ms,
        jobs=jobs,
    )


def _busy(gpu: GpuReport) -> str:
    """Why ``gpu`` takes no job now, for people."""
    if gpu.owner:
        return f"GPU {gpu.index} in use by its owner ({gpu.owner})"
    return f"GPU {gpu.index} at {gpu.utilization if gpu.utilization is not None else '?'}%" + (
        f" with {gpu.jobs} job(s)" if gpu.jobs else ""
    )


def _jobs(count: int) -> str:
    return f"{count} GPUMesh job{'s' if count != 1 else ''} running"


def choose(probes: list[Probe], gpu_memory: int) -> Placement:
    """Pick the idle GPU with the most headroom; GPU members before CPU-only ones,
    and among those the members running the fewest GPUMesh jobs first."""
    candidates = [evaluate(p, gpu_memory) for p in probes]
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        return Placement(None, candidates)
    chosen = max(eligible, key=lambda c: (c.gpu is not None, -c.jobs, c.headroom, -c.rtt_ms))
    return Placement(chosen, candidates)


async def _probe_one(node: Node, name: str, peer: Peer | None, timeout: float) -> Probe:
    if peer is None:
        return Probe(name, None)
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with node.session(peer.node_id, timeout=timeout) as session:
                reply = await session.request(StatusRequest(), timeout=timeout)
    except TimeoutError:
        where = ", ".join(peer.dial_addresses()) or f"{name}'s relay"
        error = unreachable(where, waited=timeout)
        return Probe(name, peer, error=f"unreachable: {error.message}", unreachable=True)
    except NotPairedError:
        return Probe(name, peer, error="has not paired you: send it your `gpumesh pair-code`")
    except UnreachableError as exc:
        return Probe(name, peer, error=f"unreachable: {exc.message}", unreachable=True)
    except GPUMeshError as exc:
        return Probe(name, peer, error=exc.message)
    if not isinstance(reply, StatusReply):
        return Probe(name, peer, error="answered status with something else")
    return Probe(name, peer, reply, rtt_ms=(time.perf_counter() - started) * 1000)


async def probe(
    node: Node,
    members: list[tuple[str, Peer | None]],
    timeout: float = PROBE_TIMEOUT,
    patience: float = PROBE_PATIENCE,
) -> list[Probe]:
    """Ask every member for its status at once; each has ``timeout`` seconds.

    When no member has answered by then, the probe waits on, up to ``patience``
    seconds in all, for the first answer; a member still silent when the probe
    stops is unreachable, said with the seconds it was given.
    """
    patience = max(patience, timeout)
    tasks = [asyncio.create_task(_probe_one(node, name, peer, patience)) for name, peer in members]
    started = time.monotonic()
    waited = timeout
    try:
        pending = {t for t in tasks if not t.done()}
        if pending:
            _, pending = await asyncio.wait(pending, timeout=timeout)
        while pending and not any(t.done() and t.result().status for t in tasks):
            left = patience - (time.monotonic() - started)
            if left <= 0:
                break
            _, pending = await asyncio.wait(
                pending, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
        waited = max(timeout, time.monotonic() - started)
    finally:
        silent = [t for t in tasks if not t.done()]
        for task in silent:
            task.cancel()
        await asyncio.gather(*silent, return_exceptions=True)
    probes = []
    for (name, peer), task in zip(members, tasks, strict=True):
        if not task.cancelled():
            probes.append(task.result())
            continue
        assert peer is not None  # an unpaired member's probe never waits
        where = ", ".join(peer.dial_addresses()) or f"{name}'s relay"
        error = unreachable(where, waited=waited)
        probes.append(Probe(name, peer, error=f"unreachable: {error.message}", unreachable=True))
    return probes


async def place(
    node: Node,
    members: list[tuple[str, Peer | None]],
    gpu_memory: int,
    *,
    timeout: float = PROBE_TIMEOUT,
) -> Placement:
    """Probe and choose.

    Raises :class:`LimitError` carrying the table of reasons when nothing fits (a
    job that may wait then waits in the node process's queue, which asks again).
    """
    if not members:
        raise LimitError("the group has no other members to run on: add peers to it first")
    placement = choose(await probe(node, members, timeout), gpu_memory)
    if placement.chosen is not None:
        return placement
    table = "; ".join(f"{c.name}: {c.reason}" for c in placement.candidates)
    need = f" with {format_size(gpu_memory)} of GPU memory" if gpu_memory else ""
    raise LimitError(f"no member can take the job{need}: {table}")
