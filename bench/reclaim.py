"""How long the owner waits for a GPU back: from their process appearing on it to
the guests' containers gone.

alice's agent runs in this script's event loop (as in ``first_request.py``) with
one GPU; bob runs a detached job on it (``sleep``, under a shell that ignores
SIGTERM by default, so every trial waits out the whole grace: the worst case).
Then the owner's process appears on the GPU; measured from then until the job's
container no longer runs (and, beside it, until the job's record says
``preempted``). The process goes away, the GPU is offered again after the grace,
and the next trial starts: ``--trials`` in all. Goal: container gone within
grace + 2 s at p95.

Without NVIDIA hardware the GPU is simulated (``GPUMESH_TEST_SIMULATED_GPUS``)
and its processes are a file the script writes
(``GPUMESH_TEST_SIMULATED_GPU_PROCESSES``); the agent's runtime then makes the
job's container without its device request (Docker has no NVIDIA runtime here),
so the job runs and is stopped as a GPU job would be. The look at the GPUs, the
tracker, the allocator and the preemption are the product's own.

``--trigger pause`` times the owner's ``gpumesh pause --grace`` the same way,
through :func:`start_pause` (``--trigger pause``: what ``gpumesh pause --grace``
runs, timed from the owner's command).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _benchlib import (
    ensure_bytecode,
    exit_cleanly_on_sigterm,
    free_port,
    interrupted,
    print_rows,
    source_note,
)
from bulk import make_nodes
from dispatch import docker_ready, remove_containers
from gpumesh.agent.server import Agent
from gpumesh.client.jobs import run_job
from gpumesh.client.jobspec import JobSpec
from gpumesh.client.node import Node
from gpumesh.errors import NotFoundError
from gpumesh.gpu.inventory import ENV_SIMULATED_PROCESSES, SimulatedInventory
from gpumesh.runtime.base import LABEL_NODE, ContainerSpec
from gpumesh.runtime.docker import DockerRuntime
from gpumesh.units import parse_duration

GOAL_OVER_GRACE = 2.0
"""Seconds past the grace the guests' containers may take to be gone (p95)."""
OWNER_PID = 4242
"""The owner's simulated process (a game) on the GPU."""


class _NoDeviceRequests(DockerRuntime):
    """Docker without NVIDIA's runtime: containers are made without their GPUs."""

    def create(self, spec: ContainerSpec) -> str:
        return super().create(dataclasses.replace(spec, gpu_ids=[]))


def _p95(samples: list[float]) -> float:
    """The nearest-rank 95th percentile (the 19th of 20)."""
    ordered = sorted(samples)
    return ordered[max(0, -(-95 * len(ordered) // 100) - 1)]


def _running(runtime: DockerRuntime, container_id: str) -> bool:
    """Whether the container still runs (one removed already does not: a pause
    returns after the job's end, by when its container may be gone)."""
    try:
        state = runtime.inspect(container_id)
    except NotFoundError:
        return False
    return state.status == "running"


async def _until(check: Callable[[], object], what: str, within: float = 180.0) -> None:
    """Poll ``check`` every 20 ms until it is true; stop the run after ``within`` s."""
    for _ in range(int(within / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise SystemExit(f"{what} did not happen within {within:g} s")


async def start_reclaim(agent: Agent, processes: Path, grace: float) -> None:
    """The owner's game starts on GPU 0."""
    del agent, grace
    await asyncio.to_thread(processes.write_text, f"0 {OWNER_PID} game graphics\n")


async def end_reclaim(agent: Agent, processes: Path) -> None:
    """The game ends; returns once GPU 0 is offered again (after the grace)."""
    await asyncio.to_thread(processes.write_text, "")
    await _until(lambda: not agent.gpus.withheld(), "the GPU offered again")


async def start_pause(agent: Agent, processes: Path, grace: float) -> None:
    """The owner types ``gpumesh pause --grace``: what its route runs (returns once
    the guests are stopped)."""
    del processes
    await agent.pause(grace)


async def end_pause(agent: Agent, processes: Path) -> None:
    """``gpumesh resume``: the pause is the store's."""
    del processes
    agent.store.resume()


TRIGGERS = {"reclaim": (start_reclaim, end_reclaim), "pause": (start_pause, end_pause)}


async def one_trial(
    agent: Agent,
    bob: Node,
    runtime: DockerRuntime,
    processes: Path,
    grace: float,
    args: argparse.Namespace,
) -> tuple[float, float]:
    """(container gone, job preempted), seconds from the trigger."""
    how = args.job
    command = (
        ["sh", "-c", "trap '' TERM; sleep 600 & wait; wait"]
        if how == "trap"
        else [
            "sleep",
            "600",
        ]
    )
    spec = JobSpec(None, command, {}, None, 1000**3, 0, 0.0, "alice", None)
    job = await run_job(bob, spec, detach=True)
    store = agent.store

    def started() -> bool:
        record = store.job("hosted", job.job_id)
        return record is not None and record.state == "running"

    await _until(started, f"job {job.job_id} running")
    container_id = store.job("hosted", job.job_id).container_id  # type: ignore[union-attr]
    assert container_id is not None
    start, end = TRIGGERS[args.trigger]
    began = time.monotonic()
    await start(agent, processes, grace)
    gone = preempted = None
    while gone is None or preempted is None:
        now = time.monotonic() - began
        if preempted is None and store.job("hosted", job.job_id).state == "preempted":  # type: ignore[union-attr]
            preempted = now
        if gone is None and not await asyncio.to_thread(_running, runtime, container_id):
            gone = now
        if now > grace + 120:
            raise SystemExit("the job was not stopped within 2 minutes past the grace")
        await asyncio.sleep(0.01)
    await end(agent, processes)
    return gone, preempted


async def run(args: argparse.Namespace, tmp: Path) -> list[tuple[float, float]]:
    alice, bob = make_nodes(tmp, free_port(kind=socket.SOCK_DGRAM))
    for node in (alice, bob):
        node.home.config.set("image", args.image)
    alice.home.config.set("job_memory", "64MB")
    alice.home.config.set("reclaim_grace", args.grace)
    alice.home.config.save()
    bob.home.config.save()
    processes = tmp / "gpu-processes"
    os.environ[ENV_SIMULATED_PROCESSES] = str(processes)
    grace = parse_duration(args.grace)
    runtime = _NoDeviceRequests()
    agent = Agent(
        alice.home,
        host="127.0.0.1",
        runtime=runtime,
        inventory=SimulatedInventory("BENCH-GPU:24GB"),
    )
    await agent.start()
    rows: list[tuple[float, float]] = []
    try:
        for number in range(1 if args.quick else args.trials):
            rows.append(await one_trial(agent, bob, runtime, processes, grace, args))
            gone, preempted = rows[-1]
            print(
                f"  trial {number + 1}: container gone {gone:.2f} s, job preempted "
                f"{preempted:.2f} s (grace {grace:g} s)",
                flush=True,
            )
    finally:
        agent.stop()
        runtime.close()
        remove_containers(f"{LABEL_NODE}={alice.info().node_id}")
        alice.close()
        bob.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="trials (default 20)")
    parser.add_argument("--grace", default="2s", help="reclaim_grace (default 2s)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 trial")
    parser.add_argument(
        "--trigger",
        choices=sorted(TRIGGERS),
        default="reclaim",
        help="what takes the GPU back: the owner's process (default) or `gpumesh pause`",
    )
    parser.add_argument(
        "--job",
        choices=("trap", "plain"),
        default="trap",
        help="trap: the job ignores SIGTERM and waits out the grace (default); plain: "
        "a sleep that ends at SIGTERM",
    )
    parser.add_argument(
        "--image",
        default=os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1"),
        help="an image with a static busybox (default the offline test image)",
    )
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()
    ensure_bytecode()
    docker_ready(args.image)
    if (note := source_note()) is not None:
        print(note)
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as folder:
            rows = asyncio.run(run(args, Path(folder)))
    except KeyboardInterrupt:
        return interrupted()
    grace = parse_duration(args.grace)
    what = (
        "the owner's process appearing on the GPU"
        if args.trigger == "reclaim"
        else "the owner's `gpumesh pause`"
    )
    print(f"\nfrom {what}, {len(rows)} trials, grace {grace:g} s, job: {args.job}")
    table = []
    for name, index in (("guests' containers gone", 0), ("job preempted (record)", 1)):
        samples = [row[index] for row in rows]
        table.append(
            (
                name,
                f"{sorted(samples)[len(samples) // 2]:.2f}",
                f"{_p95(samples):.2f}",
                f"{max(samples):.2f}",
                f"{_p95(samples) - grace:+.2f}",
            )
        )
    print_rows(("measured", "p50 s", "p95 s", "max s", "p95 - grace"), table)
    p95 = _p95([row[0] for row in rows])
    verdict = "met" if p95 <= grace + GOAL_OVER_GRACE else "NOT met"
    print(f"  goal: containers gone within grace + {GOAL_OVER_GRACE:g} s at p95: {verdict}")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
