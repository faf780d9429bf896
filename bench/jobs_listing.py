"""``gpumesh jobs`` while a provider of an unfinished job is down, next to the same
listing with every provider up.

Set-up, all on this machine: two providers sharing (``gpumesh share`` processes
on 127.0.0.1, free UDP ports), each with its own paired consumer; each consumer
runs one detached ``sleep`` job on its provider, so each listing has one
unfinished submitted job to ask about. Then the second provider goes away the
way a machine that was switched off does: its share stops and a socket that
never answers takes its UDP port (packets are dropped, not refused). The first
listing of its consumer after that waits for it (the listing's 3 s at most) and
is reported on its own line; every listing after it is what this measures.

Side by side, in one loop: ``gpumesh jobs`` of the consumer whose provider is
up, and of the consumer whose provider is down, taking turns (the order
alternates every round), a new CLI process each time as a user's shell runs
it, both answered by their home's node process. Figures are medians and p90 of
``--runs`` runs each. The goal reported: a listing with a provider down takes
at most 1.2x one with every provider up. It is never turned into a pass/fail
exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _benchlib import exit_cleanly_on_sigterm, free_port, interrupted, print_rows, summarize
from bulk import gpumesh_command, make_nodes, running_agent
from dispatch import docker_ready, remove_containers
from gpumesh.runtime.base import LABEL_NODE

GOAL = 1.2
IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ, GPUMESH_HOME=str(home))
    for name in ("GPUMESH_LOG", "GPUMESH_PEER", "GPUMESH_IMAGE"):
        env.pop(name, None)
    return env


def _gpumesh(home: Path, *args: str) -> tuple[float, str]:
    """Seconds ``gpumesh ARGS`` took for ``home``, and its stdout; stops on a failure."""
    began = time.perf_counter()
    done = subprocess.run(
        [*gpumesh_command(), *args],
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"gpumesh {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return took, done.stdout


@contextlib.contextmanager
def _pair(root: Path) -> Iterator[tuple[Path, Path, str, int]]:
    """A sharing provider and its consumer, with one detached job running there:
    (provider home, consumer home, the provider's node id, its UDP port)."""
    port = free_port(kind=socket.SOCK_DGRAM)
    provider, consumer = make_nodes(root, port)
    node_id = str(provider.info().node_id)
    provider.close()
    consumer.close()
    try:
        with running_agent(root / "a", root / "agent.log"):
            job = ("run", "--peer", "alice", "--image", IMAGE, "--detach", "--", "sleep", "900")
            _gpumesh(root / "b", *job)
            yield root / "a", root / "b", node_id, port
    finally:
        remove_containers(f"{LABEL_NODE}={node_id}")
        for home in (root / "a", root / "b"):
            with contextlib.suppress(SystemExit):
                _gpumesh(home, "daemon", "stop")


def _listed(stdout: str) -> dict[str, object]:
    (job,) = json.loads(stdout)
    return dict(job)


def measure(runs: int, tmp: Path) -> None:
    with (
        _pair(tmp / "up") as (_a, up, _id, _port),
        _pair(tmp / "down") as (down_provider, down, _, port),
    ):
        _gpumesh(down_provider, "share", "stop")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
            silent.bind(("127.0.0.1", port))  # its port, never answering: switched off
            first, out = _gpumesh(down, "jobs", "--json")
            why = _listed(out).get("unknown_reason")
            for _ in range(2):  # warm-ups
                _gpumesh(up, "jobs", "--json")
                _gpumesh(down, "jobs", "--json")
            times: dict[str, list[float]] = {"up": [], "down": []}
            for round_ in range(runs):
                order = ("up", "down") if round_ % 2 == 0 else ("down", "up")
                for which in order:
                    took, out = _gpumesh(up if which == "up" else down, "jobs", "--json")
                    job = _listed(out)
                    if (job["unknown_since"] is None) != (which == "up"):
                        raise SystemExit(f"the {which} listing said {job}")
                    times[which].append(took)
    report(runs, times, first, str(why))


def report(runs: int, times: dict[str, list[float]], first: float, why: str) -> None:
    up, down = summarize(times["up"]), summarize(times["down"])
    print(f"gpumesh jobs --json, one unfinished job each, {runs} runs each, alternating")
    rows = [
        ["every provider up", f"{up.p50 * 1000:.1f}", f"{up.p90 * 1000:.1f}", "1.00x"],
        [
            "its provider down",
            f"{down.p50 * 1000:.1f}",
            f"{down.p90 * 1000:.1f}",
            f"{down.p50 / up.p50:.2f}x",
        ],
        ["  (the first listing after it went away)", f"{first * 1000:.1f}", "", ""],
    ]
    print_rows(["", "p50 ms", "p90 ms", "vs up"], rows)
    print(f"  the down provider's jobs said: {why}")
    met = "met" if down.p50 <= GOAL * up.p50 else "NOT met"
    print(f"  goal: provider down <= {GOAL}x every provider up: {down.p50 / up.p50:.2f}x, {met}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="listings of each kind")
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()
    docker_ready(IMAGE)
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-jobs-") as tmp:
            measure(args.runs, Path(tmp))
    except KeyboardInterrupt:
        return interrupted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
