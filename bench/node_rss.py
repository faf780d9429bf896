"""Memory of the node process: idle, and holding warm sessions to many peers.

What is measured: the resident set (``VmRSS`` in ``/proc/PID/status``, Linux
only) and its peak (``VmHWM``) of a home's node process, the background
process the thin CLI starts: once idle (started, nothing asked of it yet),
then with a warm session open to each of ``--peers`` provider agents on
loopback (each opened by the control API's ``POST /api/v1/peers/NAME/connect``
on the home's control socket, as ``gpumesh connect`` does), and again after
the sessions' keep-alive pings have run (a little over ``KEEPALIVE`` seconds).

Side by side, in the same run: ``python -c pass`` (the interpreter's floor)
and a Python that only imports what the node process imports, both measured
the same way, so the table says how much of the node's memory is imports and
how much is its state (sessions, the API server, the store). The CPU time the
node process spends while it only holds the sessions (keep-alives, its checks
of the store for denies) is shown too.

Set-up: the providers run in ONE separate child process (``placement.py
--serve-providers``: one event loop, each agent with its own home, UDP port and
simulated GPUs; no NVIDIA hardware is involved), paired both ways with the
consumer home. The node process, the child and the temporary homes are removed
on any exit, Ctrl-C included.

Goals: idle <= 80 MB; with warm sessions to 200 peers <= 150 MB. Reported, never
turned into a pass/fail exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _benchlib import exit_cleanly_on_sigterm, interrupted, print_rows, source_note
from gpumesh.client.node import Node
from gpumesh.client.pool import KEEPALIVE
from gpumesh.control.views import NodeProcessView
from gpumesh.daemon.client import NoAnswer, NodeClient, connect, stop

LOOPBACK = "127.0.0.1"
PLACEMENT = Path(__file__).resolve().with_name("placement.py")
START_TIMEOUT = 300.0
MB = 2**20
GOAL_IDLE_MB = 80.0
GOAL_WARM_MB = 150.0
GOAL_PEERS = 200
SETTLE = 2.0
"""Seconds the node process is left alone before its idle figure is read."""
NODE_MODULES = (
    "import gpumesh.daemon.process, gpumesh.control.app, gpumesh.client.node, "
    "gpumesh.transport.session, uvicorn, starlette"
)
"""What a node process imports, for the imports-only row."""


def memory_kb(pid: int) -> tuple[int, int]:
    """VmRSS and VmHWM of ``pid`` in KiB."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def python_memory(code: str) -> tuple[int, int]:
    """VmRSS and VmHWM of a Python that runs ``code``, read by itself at its end."""
    probe = (
        f"{code}\nfrom pathlib import Path\n"
        "s = {l.split(':')[0]: int(l.split()[1]) for l in "
        "Path('/proc/self/status').read_text().splitlines() if l.startswith(('VmRSS', 'VmHWM'))}\n"
        "print(s['VmRSS'], s['VmHWM'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    rss, hwm = out.split()
    return int(rss), int(hwm)


def provider_name(index: int) -> str:
    return f"provider-{index:02d}"


def start_providers(root: Path, count: int, consumer: Node) -> subprocess.Popen[str]:
    """The child hosting ``count`` agents, paired both ways with ``consumer``."""
    log = (root / "providers.log").open("w")
    child = subprocess.Popen(
        [
            sys.executable,
            str(PLACEMENT),
            "--serve-providers",
            str(root / "providers"),
            "--count",
            str(count),
            "--burst",
            "50",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(consumer.pairing_code() + "\n")
    child.stdin.flush()
    for _ in range(count):
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the provider process exited; see {root / 'providers.log'}")
        consumer.pair(json.loads(line)["code"])
    if (ready := child.stdout.readline().strip()) != "ready":
        raise RuntimeError(f"the provider process said {ready!r}")
    return child


def stop_providers(child: subprocess.Popen[str]) -> None:
    if child.stdin is not None:
        child.stdin.close()
    try:
        child.wait(20)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def warm_up(home: Path, names: list[str], workers: int) -> float:
    """Open a warm session to each peer through the node process; seconds it took."""

    def one(name: str) -> None:
        path = f"/api/v1/peers/{name}/connect?pings=1"
        NodeClient(home).call("POST", path, NoAnswer, timeout=120)

    began = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, names))
    return time.perf_counter() - began


def node_view(client: NodeClient) -> NodeProcessView:
    return client.call("GET", "/api/v1/node", NodeProcessView)


def measure(root: Path, peers: int, workers: int) -> list[tuple[str, int, int, str]]:
    rows: list[tuple[str, int, int, str]] = []
    rows.append(("python -c pass (floor)", *python_memory("pass"), ""))
    rows.append(("python importing the node's modules", *python_memory(NODE_MODULES), ""))
    home = root / "consumer"
    consumer = Node(home)
    consumer.init("consumer")
    consumer.home.config.set("listen_host", LOOPBACK)
    consumer.home.config.save()
    child = start_providers(root, peers, consumer) if peers else None
    consumer.close()
    client = None
    try:
        client = connect(home)
        pid = node_view(client).pid
        time.sleep(SETTLE)
        rows.append(("node process, idle", *memory_kb(pid), "goal <= 80 MB"))
        if peers:
            names = [provider_name(index) for index in range(peers)]
            took = warm_up(home, names, workers)
            count = len(node_view(client).warm_sessions)
            note = f"{count} warm, opened in {took:.1f} s"
            rows.append((f"node process, {peers} warm sessions", *memory_kb(pid), note))
            cpu_before, began = cpu_seconds(pid), time.monotonic()
            time.sleep(KEEPALIVE + 2 * SETTLE)
            busy = (cpu_seconds(pid) - cpu_before) / (time.monotonic() - began)
            after = f"  ... after a keep-alive round ({KEEPALIVE:g} s)"
            rows.append((after, *memory_kb(pid), f"CPU meanwhile: {busy:.1%} of a core"))
    finally:
        if client is not None:
            stop(home, client)
        if child is not None:
            stop_providers(child)
    return rows


def report(rows: list[tuple[str, int, int, str]], peers: int) -> None:
    print(f"Node process memory (VmRSS / VmHWM), {peers} provider agents on loopback")
    print_rows(
        ["", "RSS MB", "peak MB", ""],
        [[name, f"{rss / 1024:.1f}", f"{hwm / 1024:.1f}", note] for name, rss, hwm, note in rows],
    )
    by_name = {name: rss / 1024 for name, rss, _hwm, _note in rows}
    idle = by_name.get("node process, idle")
    if idle is not None:
        verdict = "met" if idle <= GOAL_IDLE_MB else "missed"
        print(f"  goal: idle <= {GOAL_IDLE_MB:.0f} MB: {idle:.1f} MB, {verdict}")
    warm = by_name.get(f"node process, {peers} warm sessions")
    if warm is not None:
        verdict = "met" if warm <= GOAL_WARM_MB else "missed"
        scale = "" if peers == GOAL_PEERS else f" (goal is for {GOAL_PEERS} peers)"
        goal = f"{peers} warm sessions <= {GOAL_WARM_MB:.0f} MB"
        print(f"  goal: {goal}: {warm:.1f} MB, {verdict}{scale}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Resident memory of the node process, idle and with warm sessions to "
        "many provider agents on loopback (hosted in one child process), next to a bare "
        "interpreter and one that only imports the node's modules.",
    )
    parser.add_argument(
        "--peers", type=int, default=GOAL_PEERS, help=f"provider agents (default {GOAL_PEERS})"
    )
    parser.add_argument(
        "--workers", type=int, default=8, help="connects in flight at once (default 8)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 peers")
    args = parser.parse_args(argv)
    if args.quick:
        args.peers = 10
    if args.peers < 0 or args.workers < 1:
        parser.error("--peers must be >= 0 and --workers >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path("/proc/self/status").exists():
        print("error: this benchmark reads /proc (Linux only)", file=sys.stderr)
        return 1
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as tmp:
            rows = measure(Path(tmp), args.peers, args.workers)
    except KeyboardInterrupt:
        return interrupted()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report(rows, args.peers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
