"""LAN discovery: from two nodes starting to a ``lan`` path, next to a ``connect`` to
the right stored address, side by side in one run.

Needs root (network namespaces). The lab of ``tests/integration/lanlab.py``: alice
in ``lana`` (10.77.0.1), bob in ``lanb`` (10.77.0.2), one bridge, no route
anywhere else. Two pairs of homes, paired both ways:

* ``connect``: bob knows alice's right address, ``lan_discovery`` is off on both.
  Each round starts alice's share (``gpumesh daemon run --share``) and bob's node
  process (``gpumesh daemon run``) at once, then asks bob's node process to
  connect to alice (``POST /api/v1/peers/alice-pc/connect``) over and over until
  it answers: the time from the start to that answer.
* ``lan``: bob knows alice at an address nobody has (another host, another
  port), ``lan_discovery`` on with its defaults (announcements every 30 s,
  re-probe every 60 s: the late starter's announcement is answered at once).
  Each round starts both the same way, then reads bob's peers
  (``GET /api/v1/peers``) every 20 ms until alice's path is ``lan`` at her
  right address: the time from the start to then. Alice's stored address is
  made stale again after each round.

The rounds alternate (connect, lan, ...), ``--rounds`` of each; medians, p90 and
the goal: lan <= connect + 1 s. Everything is removed on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._benchlib import exit_cleanly_on_sigterm, free_port, interrupted, print_rows, summarize
from tests.integration import lanlab

from gpumesh.client.views.peers import ConnectView
from gpumesh.daemon.client import NodeClient
from gpumesh.errors import GPUMeshError

ALICE_IP = lanlab.ip_of("a")
POLL = 0.02


def _homes(root: Path, kind: str, port: int) -> tuple[Path, Path]:
    alice, bob = root / f"{kind}-a", root / f"{kind}-b"
    stale = kind == "lan"
    host = "10.77.0.99" if stale else ALICE_IP
    discovery = {
        "lan_discovery": "on" if stale else "off",
        "lan_interval": "30s",
        "lan_reprobe": "60s",
    }
    node_a, code_a = lanlab.make_home(
        alice, "alice-pc", host, port + (1 if stale else 0), **discovery
    )
    node_b, code_b = lanlab.make_home(bob, "bob-laptop", lanlab.ip_of("b"), 47000, **discovery)
    node_b.pair(code_a)
    node_a.pair(code_b)
    node_a.close()
    node_b.close()
    lanlab.set_config(alice, listen_host="0.0.0.0", listen_port=str(port))
    return alice, bob


def _forget_alice(bob: Path) -> None:
    with sqlite3.connect(bob / "gpumesh.db") as db:
        db.execute("UPDATE peers SET last_address = '', last_path = ''")


def _connected(bob: Path) -> bool:
    try:
        NodeClient(bob).call(
            "POST", "/api/v1/peers/alice-pc/connect?pings=1&timeout=2", ConnectView, timeout=10
        )
    except GPUMeshError:
        return False
    return True


def _on_lan(running: lanlab.Running, port: int) -> bool:
    alice = running.peers().get("alice-pc")
    return alice is not None and (alice.last_path, alice.last_address) == (
        "lan",
        f"{ALICE_IP}:{port}",
    )


def _round(kind: str, alice: Path, bob: Path, port: int) -> float:
    started = time.monotonic()
    a = lanlab.start("a", alice, share=True)
    b = lanlab.start("b", bob, share=False)
    try:
        check = (lambda: _connected(bob)) if kind == "connect" else (lambda: _on_lan(b, port))
        lanlab.until(check, f"{kind} works", within=60, every=POLL)
        return time.monotonic() - started
    finally:
        b.stop()
        a.stop()
        if kind == "lan":
            _forget_alice(bob)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    try:
        with tempfile.TemporaryDirectory() as tmp, lanlab.bridge():
            port = free_port(kind=2)
            homes = {kind: _homes(Path(tmp), kind, port) for kind in ("connect", "lan")}
            times: dict[str, list[float]] = {"connect": [], "lan": []}
            for n in range(args.rounds):
                for kind in ("connect", "lan") if n % 2 == 0 else ("lan", "connect"):
                    times[kind].append(_round(kind, *homes[kind], port))
                    print(f"  round {n + 1} {kind}: {times[kind][-1]:.2f} s", flush=True)
    except KeyboardInterrupt:
        return interrupted()
    connect, found = summarize(times["connect"]), summarize(times["lan"])
    print()
    print_rows(
        ["from both nodes starting to", "median s", "p90 s", "min-max s"],
        [
            [label, f"{s.p50:.2f}", f"{s.p90:.2f}", f"{s.low:.2f}-{s.high:.2f}"]
            for label, s in (("connect to the right address", connect), ("a lan path", found))
        ],
    )
    met = found.p50 <= connect.p50 + 1.0
    print(
        f"\n  lan / connect: {found.p50 / connect.p50:.2f}x; lan - connect: "
        f"{found.p50 - connect.p50:+.2f} s (goal <= +1 s: {'met' if met else 'NOT met'})"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
