"""Placement latency on a group: ``place()`` over 10 and 50 provider agents on loopback.

What is measured: the wall time of ``place(consumer, members, 16GB)``, the step
``gpumesh run --group`` takes before it submits: ask every member for its
status at once (a fresh QUIC dial, TLS 1.3 handshake with the member's key
pinned, the identity proof both ways and one ``StatusRequest`` each, every
member within the probe timeout), then choose the idle GPU with the most
free memory. Every placement dials every member afresh, as a new CLI process
would; the consumer is one warm process (imports done), so a real
``gpumesh run`` adds its start-up (see ``cli_startup.py``) and reading the
group from its store.

Set-up: N provider agents run in ONE separate child process (one event loop,
each agent with its own home, UDP port and declared GPUs), so the consumer's
event loop measures the protocol and not 50 agents sharing its CPU time. The
GPUs are simulated (``SimulatedInventory``: no NVIDIA hardware is involved);
the free memory differs from member to member, some are too small for the job
and some have no GPU, so placement has a real choice, and every placement is
checked to pick the one member that fits best. Each agent and the consumer
are paired both ways.

Figures, per size, taken interleaved (alternating which goes first):

* ``place()`` with every member answering;
* the baseline: the very same status probes, one member after another (what a
  naive loop over the members does, in-process, so without the CLI start a
  shell loop of ``gpumesh connect`` would add per member); each of those
  single probes is also shown, as the floor one member costs;
* then one member is stopped and its address replaced by a bound UDP socket
  that never answers (packets silently dropped, no ICMP: the worst case), and
  ``place()`` is timed again; the difference is what one dead member adds.

Also shown: the CPU time one placement costs the consumer (``process_time``)
and the provider process (``/proc``, Linux only, in clock ticks of usually
10 ms), next to its wall time: when the two add up to about the wall time on
a machine with few cores, the handshakes' CPU work, not waiting, is the cost.

Goals: 50 members placed in <= 0.5 s at p50; one dead member adds no more than
the probe timeout (1 s), checked at p50 and p90 (the verdict uses p90).

Each agent's per-IP connection limit (default: burst 20, then 5 new
connections/s) would refuse the benchmark's back-to-back dials from 127.0.0.1
(a defence, not latency), and past their allowance for addresses not yet
validated (burst 16, then 4/s) they would ask each dial for a Retry round trip,
as under a flood; so the agents get a ``ConnectionLimiter`` sized to the run.
The script says how, and counts refused packets in the agents' summary lines.

The child process, its agents and the temporary homes are removed on any exit,
Ctrl-C included; the child also exits by itself when this script goes away
(its stdin closes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from _benchlib import (
    Summary,
    exit_cleanly_on_sigterm,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from gpumesh.agent.ratelimit import ConnectionLimiter
from gpumesh.agent.server import Agent
from gpumesh.client.node import Node
from gpumesh.client.placement import PROBE_TIMEOUT, Placement, place, probe
from gpumesh.errors import GPUMeshError
from gpumesh.gpu.inventory import SimulatedInventory
from gpumesh.store.peers import Peer

LOOPBACK = "127.0.0.1"
GB = 10**9
GPU_MEMORY = 16 * GB
"""What each placement asks for."""
START_TIMEOUT = 120.0
"""Seconds the child has to start its agents."""
WARMUP = 2
"""Untimed placements per size before the timed ones (first-use costs)."""
SCRIPT = Path(__file__).resolve()
GOAL_MEMBERS = 50
GOAL_PLACE_P50 = 0.5
GOAL_DEAD_ADDS = PROBE_TIMEOUT


# --- the providers (child process) -------------------------------------------------------


def provider_name(index: int) -> str:
    return f"provider-{index:02d}"


def declaration(index: int, count: int) -> str:
    """The simulated GPUs of provider ``index``: varied, with one clear best fit.

    Every sixth has no GPU and every sixth a 16GB T4 that is partly used (too
    small for the job); the others have 80GB GPUs with 2-61GB in use (some a
    second, smaller GPU too); provider ``2n/3`` alone has 79GB free.
    """
    if index == (2 * count) // 3:
        return "H100:80GB:1GB"
    if index % 6 == 5:
        return ""
    if index % 6 == 4:
        return f"T4:16GB:{1 + index % 7}GB"
    used = 2 + (index * 13) % 60
    big = f"A100:80GB:{used}GB"
    return f"L4:24GB:4GB,{big}" if index % 3 == 0 else big


def free_memory(declared: str) -> int:
    """Bytes free on the roomiest GPU of a declaration (0: none)."""
    inventory = SimulatedInventory(declared)
    return max((gpu.memory_free for gpu in inventory.gpus()), default=0)


def expected_choice(count: int) -> str:
    best = max(range(count), key=lambda index: free_memory(declaration(index, count)))
    return provider_name(best)


async def serve_providers(root: Path, count: int, burst: int) -> None:
    """Child: start ``count`` agents, pair them with the consumer, obey stdin.

    Reads the consumer's pairing code as the first line of stdin, prints one
    JSON line per agent (name, pairing code) and then ``ready``; afterwards
    ``stop NAME`` stops that agent, and the end of stdin ends everything.
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    consumer_code = (await reader.readline()).decode().strip()
    if not consumer_code:
        return
    agents: dict[str, Agent] = {}
    nodes: list[Node] = []
    try:
        for index in range(count):
            name = provider_name(index)
            node = Node(root / name)
            nodes.append(node)
            node.init(name)
            config = node.home.config
            config.set("listen_host", LOOPBACK)
            # They run no job: no job network, and no network holders made for
            # it in Docker (two per agent, which a stop after the 20 s the
            # consumer waits would leave running).
            config.set("job_network", "none")
            config.save()
            node.home.reload_config()
            agent = Agent(
                node.home,
                host=LOOPBACK,
                port=0,
                limiter=ConnectionLimiter(
                    rate=1000.0, burst=burst, quiet_rate=1000.0, quiet_burst=burst
                ),
                inventory=SimulatedInventory(declaration(index, count)),
            )
            # Started before the pairing code is made: the code carries the bound port.
            await agent.start()
            agents[name] = agent
            node.pair(consumer_code)
            print(json.dumps({"name": name, "code": node.pairing_code()}), flush=True)
        print("ready", flush=True)
        while line := (await reader.readline()).decode():
            command, _, name = line.strip().partition(" ")
            if command == "stop" and name in agents:
                agents[name].stop()
                print(f"stopped {name}", flush=True)
    finally:
        for agent in agents.values():
            agent.stop()
        for node in nodes:
            node.close()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Providers:
    """The child process hosting the agents, seen from the consumer."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc = proc
        self.log = log

    async def line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        try:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            raise RuntimeError(self.failure(f"no answer within {timeout:g}s")) from None
        if not raw:
            raise RuntimeError(self.failure("exited"))
        return raw.decode().strip()

    async def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        await self.proc.stdin.drain()

    def failure(self, what: str) -> str:
        tail = self.log.read_text(errors="replace").strip().splitlines()[-20:]
        return "the provider process " + what + "; its log ends:\n" + "\n".join(tail)

    def rate_limit_refusals(self) -> int:
        """Packets the agents refused, as their summary lines (one per 10 s) count them."""
        text = self.log.read_text(errors="replace")
        return sum(int(n) for n in re.findall(r"refused (\d+) packets? from", text))


@contextlib.asynccontextmanager
async def providers_process(root: Path, count: int, burst: int) -> AsyncIterator[Providers]:
    """Run the child until the block ends; then close its stdin, then signal it."""
    log = root / "providers.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(SCRIPT),
            "--serve-providers",
            str(root),
            "--count",
            str(count),
            "--burst",
            str(burst),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            # Its own session: Ctrl-C reaches only us, and we stop it in order.
            start_new_session=True,
        )
    try:
        yield Providers(proc, log)
    finally:
        await stop_process(proc)


async def stop_process(proc: asyncio.subprocess.Process) -> None:
    if proc.stdin is not None and not proc.stdin.is_closing():
        proc.stdin.close()
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if proc.returncode is not None:
            return
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 10)


# --- the measurements ----------------------------------------------------------------------


@dataclass
class SizeResult:
    members: int
    expected: str
    dead: str
    place_alive: list[float] = field(default_factory=list)
    place_dead: list[float] = field(default_factory=list)
    sequential: list[float] = field(default_factory=list)
    single_probe: list[float] = field(default_factory=list)
    slowest_member_ms: list[float] = field(default_factory=list)
    """Per alive placement: the slowest member's probe time as ``place`` saw it."""
    consumer_cpu: list[float] = field(default_factory=list)
    provider_cpu: list[float] = field(default_factory=list)
    """Per alive placement: CPU seconds of each process during the call."""
    startup: float = 0.0
    refusals: int = 0


def make_consumer(path: Path) -> Node:
    consumer = Node(path)
    consumer.init("consumer")
    config = consumer.home.config
    config.set("listen_host", LOOPBACK)
    config.save()
    consumer.home.reload_config()
    return consumer


def check(placement: Placement, expected: str, dead: str | None) -> None:
    if placement.peer_name != expected:
        raise RuntimeError(f"placement chose {placement.peer_name}, expected {expected}")
    if dead is not None:
        reasons = {c.name: c.reason for c in placement.candidates}
        if not reasons[dead].startswith("unreachable"):
            raise RuntimeError(f"the dead member {dead} was judged {reasons[dead]!r}")


async def timed_place(
    consumer: Node, members: list[tuple[str, Peer | None]], expected: str, dead: str | None
) -> tuple[float, Placement]:
    started = time.perf_counter()
    placement = await place(consumer, members, GPU_MEMORY)
    elapsed = time.perf_counter() - started
    check(placement, expected, dead)
    return elapsed, placement


async def sequential_probes(
    consumer: Node, members: list[tuple[str, Peer | None]], result: SizeResult
) -> None:
    """The baseline: the same probes, one member after another."""
    started = time.perf_counter()
    for member in members:
        began = time.perf_counter()
        (answer,) = await probe(consumer, [member])
        result.single_probe.append(time.perf_counter() - began)
        if answer.status is None:
            raise RuntimeError(f"{answer.name} did not answer the baseline probe: {answer.error}")
    result.sequential.append(time.perf_counter() - started)


async def measure_size(args: argparse.Namespace, root: Path, count: int) -> SizeResult:
    consumer = make_consumer(root / "consumer")
    names = [provider_name(index) for index in range(count)]
    # Not the winner, so the choice stays the same with it gone.
    result = SizeResult(count, expected_choice(count), dead=names[1])
    try:
        began = time.perf_counter()
        async with providers_process(root, count, burst=args.burst) as providers:
            await providers.send(consumer.pairing_code())
            for _ in range(count):
                offer = json.loads(await providers.line(START_TIMEOUT))
                consumer.pair(offer["code"])
            if (ready := await providers.line(START_TIMEOUT)) != "ready":
                raise RuntimeError(providers.failure(f"said {ready!r}"))
            result.startup = time.perf_counter() - began
            try:
                await alive_rounds(args, consumer, names, providers.proc.pid, result)
                await dead_rounds(args, consumer, names, providers, result)
            except (GPUMeshError, RuntimeError) as exc:
                refused = providers.rate_limit_refusals()
                why = f" (the agents refused {refused} packet(s))"
                raise RuntimeError(f"{count} members: {exc}{why if refused else ''}") from exc
            result.refusals = providers.rate_limit_refusals()
    finally:
        consumer.close()
    return result


async def alive_rounds(
    args: argparse.Namespace, consumer: Node, names: list[str], pid: int, result: SizeResult
) -> None:
    """Placements with every member answering, interleaved with the sequential baseline."""
    members: list[tuple[str, Peer | None]] = [(n, consumer.peer(n)) for n in names]
    for _ in range(WARMUP):
        await timed_place(consumer, members, result.expected, None)
    for index in range(args.rounds):
        order = ("place", "sequential") if index % 2 == 0 else ("sequential", "place")
        for kind in order:
            if kind == "sequential":
                await sequential_probes(consumer, members, result)
                continue
            cpu_child, cpu_self = cpu_seconds(pid), time.process_time()
            elapsed, placement = await timed_place(consumer, members, result.expected, None)
            result.consumer_cpu.append(time.process_time() - cpu_self)
            if cpu_child is not None and (cpu_after := cpu_seconds(pid)) is not None:
                result.provider_cpu.append(cpu_after - cpu_child)
            result.place_alive.append(elapsed)
            result.slowest_member_ms.append(max(c.rtt_ms for c in placement.candidates))


async def dead_rounds(
    args: argparse.Namespace,
    consumer: Node,
    names: list[str],
    providers: Providers,
    result: SizeResult,
) -> None:
    """Stop one member, make its address swallow packets, and place again."""
    await providers.send(f"stop {result.dead}")
    if (stopped := await providers.line(30)) != f"stopped {result.dead}":
        raise RuntimeError(providers.failure(f"said {stopped!r}"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as blackhole:
        # Bound and never read: packets to it vanish, no ICMP comes back.
        blackhole.bind((LOOPBACK, 0))
        hole = f"{LOOPBACK}:{blackhole.getsockname()[1]}"
        peer = consumer.peer(result.dead)
        store = consumer.home.store
        store.save_peer(peer.public_key, peer.name, [hole], peer.relay)
        # The last address that worked is dialled first: make it the dead one too.
        store.touch_peer(peer.node_id, address=hole)
        members: list[tuple[str, Peer | None]] = [(n, consumer.peer(n)) for n in names]
        for _ in range(args.dead_rounds):
            elapsed, _placement = await timed_place(consumer, members, result.expected, result.dead)
            result.place_dead.append(elapsed)


async def measure(args: argparse.Namespace, tmp: Path) -> list[SizeResult]:
    results = []
    for count in args.sizes:
        print(f"{count} provider agents: starting them in a child process...", flush=True)
        result = await measure_size(args, tmp / f"n{count}", count)
        print(
            f"  ready after {result.startup:.1f}s; measured {args.rounds} placements, "
            f"{args.rounds} sequential baselines, {args.dead_rounds} with a dead member",
            flush=True,
        )
        results.append(result)
    return results


# --- the report ----------------------------------------------------------------------------


def _ms(summary: Summary) -> list[str]:
    return [
        f"{summary.p50 * 1e3:.1f}",
        f"{summary.p90 * 1e3:.1f}",
        f"{summary.low * 1e3:.1f}",
        f"{summary.high * 1e3:.1f}",
    ]


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(args: argparse.Namespace, results: list[SizeResult]) -> None:
    print(
        f"\nPlacement of a job asking {GPU_MEMORY // GB}GB of GPU memory: place(consumer, "
        f"members, ...) with probe timeout {PROBE_TIMEOUT:g}s, fresh connections each time,"
    )
    print(
        "providers in one separate process on 127.0.0.1. GPUs are SIMULATED (no NVIDIA "
        "hardware); dials, handshakes, identity proofs and status RPCs are real."
    )
    print(
        f"Agents' connection limiter sized to the run: rate 1000/s, burst {args.burst}, "
        "no Retry (default 5/s, burst 20 per source IP; Retry past 16, then 4/s)."
    )
    rows = []
    for r in results:
        rows += [
            [f"{r.members} members: place(), all answer", *_ms(summarize(r.place_alive))],
            ["  place(), one member dead (dropped)", *_ms(summarize(r.place_dead))],
            ["  baseline: same probes one by one", *_ms(summarize(r.sequential))],
            ["    one probe of that baseline", *_ms(summarize(r.single_probe))],
        ]
    print_rows(["", "p50 ms", "p90 ms", "min ms", "max ms"], rows)
    print()
    for r in results:
        alive, dead = summarize(r.place_alive), summarize(r.place_dead)
        sequential = summarize(r.sequential)
        slowest = summarize(r.slowest_member_ms)
        adds_p50, adds_p90 = dead.p50 - alive.p50, dead.p90 - alive.p90
        print(f"{r.members} members (chosen every time: {r.expected}):")
        print(
            f"  parallel vs one by one: {sequential.p50 / alive.p50:.1f}x faster at p50; "
            f"slowest member's probe inside place(): p50 {slowest.p50:.1f} ms"
        )
        if r.consumer_cpu:
            line = f"  CPU per placement: consumer {summarize(r.consumer_cpu).p50 * 1e3:.1f} ms"
            if r.provider_cpu:
                line += f", provider process {summarize(r.provider_cpu).p50 * 1e3:.1f} ms"
            print(line + f" (p50; wall p50 {alive.p50 * 1e3:.1f} ms)")
        print(
            f"  one dead member adds: p50 {adds_p50 * 1e3:+.0f} ms, p90 {adds_p90 * 1e3:+.0f} ms "
            f"(goal <= {GOAL_DEAD_ADDS * 1e3:.0f} ms): {_verdict(adds_p90 <= GOAL_DEAD_ADDS)}"
        )
        if r.refusals:
            print(f"  WARNING: the agents refused {r.refusals} packet(s) (see their log)")
    goal = [r for r in results if r.members == GOAL_MEMBERS]
    if goal:
        p50 = summarize(goal[0].place_alive).p50
        print(
            f"Goal: {GOAL_MEMBERS} members placed in <= {GOAL_PLACE_P50 * 1e3:.0f} ms at p50: "
            f"{p50 * 1e3:.1f} ms, {_verdict(p50 <= GOAL_PLACE_P50)}"
        )
    else:
        print(f"Goal for {GOAL_MEMBERS} members: not measured in this run")


# --- the command line -------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time placement on a group (parallel status probes of every member, then "
        "the choice) over 10 and 50 provider agents in a separate process, next to the same "
        "probes one by one, and with one member silently dead. GPUs are simulated.",
    )
    parser.add_argument(
        "--sizes",
        default="10,50",
        help="comma-separated numbers of provider agents (default 10,50)",
    )
    parser.add_argument(
        "--rounds", type=int, default=30, help="timed placements per size (default 30)"
    )
    parser.add_argument(
        "--dead-rounds",
        type=int,
        default=None,
        help="timed placements with one dead member, per size (default: --rounds)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 5 and 10 agents, 5 rounds (3 with a dead member)",
    )
    parser.add_argument("--serve-providers", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--burst", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_providers is not None:
        return args
    if args.quick:
        args.sizes, args.rounds = "5,10", 5
        args.dead_rounds = args.dead_rounds or 3
    try:
        args.sizes = [int(part) for part in args.sizes.split(",") if part.strip()]
    except ValueError:
        parser.error(f"--sizes must be numbers, e.g. 10,50 (got {args.sizes!r})")
    if not args.sizes or min(args.sizes) < 3:
        parser.error("--sizes must each be at least 3 (one dead member, one best fit)")
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    if args.dead_rounds is None:
        args.dead_rounds = args.rounds
    if args.dead_rounds < 2:
        parser.error("--dead-rounds must be at least 2")
    # Connections each agent accepts from 127.0.0.1 in one run, plus room to spare.
    args.burst = WARMUP + 2 * args.rounds + args.dead_rounds + 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    if args.serve_providers is not None:
        # The consumer stops us (stdin closes, then SIGTERM); a stray Ctrl-C must not.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        asyncio.run(serve_providers(args.serve_providers, args.count, args.burst))
        return 0
    if note := source_note():
        print(note)
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as tmp:
            for count in args.sizes:
                (Path(tmp) / f"n{count}").mkdir()
            results = asyncio.run(measure(args, Path(tmp)))
    except KeyboardInterrupt:
        return interrupted()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
