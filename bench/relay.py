"""Bulk transfer across NATs: a hole-punched direct path vs the relay, in one run.

Needs root (it builds the NAT lab of scripts/natlab.sh in network namespaces:
two nodes, each behind its own MASQUERADE router, and `gpumesh-relay` on the
"public" segment between them).

What is measured, ``--repeat`` times, alternating the two set-ups:

* direct: routers that drop unsolicited packets, so hole punching works.
  ``gpumesh connect PEER --speed SIZE`` from host A to the provider on host B
  dials, reaches B through the relay, punches a direct path, and pushes SIZE
  bytes (default 256 MiB) over one QUIC stream. Also reported: how long
  punching took from the moment the relay connected the two nodes to a
  working direct path (``punch_ms``), and the whole ``connect`` set-up (a
  ``gpumesh connect PEER --fresh`` before the push: a new dial, timed whole).
* relayed: the same routers with ``--random-fully`` (symmetric NAT), so
  punching fails and every byte goes through the relay.

Figures are MB/s (10^6 bytes per second) of the whole throughput call,
medians of the runs, and the ratio relayed/direct. Every ``gpumesh`` command
goes through its home's node process, which the first command starts in that
host's namespace; both homes are new each run, so each run's node processes
dial afresh, and they are stopped before the lab is torn down. The lab and
every process in it are removed on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _benchlib import exit_cleanly_on_sigterm, interrupted, print_rows, source_note, summarize

ROOT = Path(__file__).resolve().parents[1]
NATLAB = ROOT / "scripts" / "natlab.sh"
PREFIX = "gmb"
RELAY = "203.0.113.1:4799"
BIN = Path(sys.executable).parent


def _natlab(*args: str) -> None:
    env = dict(os.environ, GPUMESH_NATLAB_PREFIX=PREFIX)
    subprocess.run(["bash", str(NATLAB), *args], env=env, check=True, capture_output=True)


def _in(ns: str, home: Path | None, *args: str, timeout: float = 300) -> str:
    env = dict(os.environ)
    env.pop("GPUMESH_LOG", None)
    if home is not None:
        env["GPUMESH_HOME"] = str(home)
    result = subprocess.run(
        ["ip", "netns", "exec", f"{PREFIX}{ns}", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])}: {result.stderr.strip()}")
    return result.stdout


def _gpumesh(ns: str, home: Path, *args: str) -> str:
    return _in(ns, home, str(BIN / "gpumesh"), *args)


def _measure(work: Path, mode: list[str], size: str) -> dict[str, object]:
    """Build the lab in ``mode``, run one throughput test, tear it down."""
    _natlab("up", *mode)
    processes: list[subprocess.Popen[bytes]] = []
    a, b = work / "a", work / "b"
    try:
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)
        for home, ns, name in ((a, "A", "consumer"), (b, "B", "provider")):
            _gpumesh(ns, home, "init", "--name", name)
            _gpumesh(ns, home, "config", "set", "relay", RELAY)
            # The provider shares from a namespace apart from the engine's: job
            # network rules made there would filter nothing.
            _gpumesh(ns, home, "config", "set", "job_network", "bridge")
        _gpumesh("A", a, "pair", _gpumesh("B", b, "pair-code").strip())
        _gpumesh("B", b, "pair", _gpumesh("A", a, "pair-code").strip())
        relay = [str(BIN / "gpumesh-relay"), "--listen", RELAY, "--open", "--log-level", "warning"]
        processes.append(
            subprocess.Popen(
                ["ip", "netns", "exec", f"{PREFIX}P", *relay], stdout=subprocess.DEVNULL
            )
        )
        # B's node process shares; a SIGINT to this command (below) ends the share.
        env = dict(os.environ, GPUMESH_HOME=str(b))
        processes.append(
            subprocess.Popen(
                ["ip", "netns", "exec", f"{PREFIX}B", str(BIN / "gpumesh"), "share"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        deadline = time.monotonic() + 20
        while "registered" not in (
            json.loads(_gpumesh("B", b, "status", "--json")).get("relay_state") or ""
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the provider did not register with the relay")
            time.sleep(0.2)
        connect = json.loads(_gpumesh("A", a, "connect", "provider", "--fresh", "--json"))
        speed = json.loads(_gpumesh("A", a, "connect", "provider", "--json", "--speed", size))
        return {
            "path": speed["path"],
            "mb_per_s": speed["upload_mb_per_s"],
            "connect_ms": connect["connect_ms"],
            "punch_ms": connect["punch_ms"],
        }
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
        # No node process outlives the lab (nor keeps its namespace alive).
        for ns, home in (("A", a), ("B", b)):
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _in(ns, home, str(BIN / "gpumesh"), "daemon", "stop", timeout=60)
        _natlab("down")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB", help="bytes per transfer (default 256MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each set-up (default 3)")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    if os.geteuid() != 0:
        print("bench/relay.py needs root (network namespaces)", file=sys.stderr)
        return 2
    if note := source_note():
        print(note, file=sys.stderr)
    direct: list[dict[str, object]] = []
    relayed: list[dict[str, object]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-relay-") as tmp:
            _run_all(Path(tmp), args.repeat, args.size, direct, relayed)
    except KeyboardInterrupt:
        return interrupted()
    _report(args.size, args.repeat, direct, relayed)
    return 0


def _run_all(
    work: Path,
    repeat: int,
    size: str,
    direct: list[dict[str, object]],
    relayed: list[dict[str, object]],
) -> None:
    for run in range(repeat):
        order = [("direct", ["drop"]), ("relayed", ["drop", "--random-fully"])]
        if run % 2:
            order.reverse()
        for label, mode in order:
            result = _measure(work, mode, size)
            (direct if label == "direct" else relayed).append(result)
            print(
                f"  run {run + 1} {label}: {result['path']}, {result['mb_per_s']} MB/s",
                flush=True,
            )


def _report(
    size: str, repeat: int, direct: list[dict[str, object]], relayed: list[dict[str, object]]
) -> None:
    for label, results, expect in (
        ("direct", direct, "direct (hole-punched)"),
        ("relayed", relayed, "relayed"),
    ):
        wrong = [r["path"] for r in results if not str(r["path"]).startswith(expect)]
        if wrong:
            print(f"warning: {label} runs took another path: {wrong}", file=sys.stderr)
    d = summarize([float(str(r["mb_per_s"])) for r in direct])
    r = summarize([float(str(x["mb_per_s"])) for x in relayed])
    punch = summarize(
        [float(str(x["punch_ms"])) for x in direct if x["punch_ms"] is not None] or [0.0]
    )
    setup = summarize([float(str(x["connect_ms"])) for x in direct])
    print(f"\nBulk transfer of {size} across two NATs, medians of {repeat} runs:")
    print_rows(
        ["path", "MB/s p50", "low", "high"],
        [
            ["direct (hole-punched)", f"{d.p50:.1f}", f"{d.low:.1f}", f"{d.high:.1f}"],
            ["relayed", f"{r.p50:.1f}", f"{r.low:.1f}", f"{r.high:.1f}"],
        ],
    )
    print(f"\nrelayed / direct: {r.p50 / d.p50:.2f}x (goal: at least 0.7x)")
    print(
        f"hole punching: direct path {punch.p50:.0f} ms after the relay connected the nodes "
        f"(connect set-up {setup.p50:.0f} ms in all, relay fallback delay included)"
    )


if __name__ == "__main__":
    sys.exit(main())
