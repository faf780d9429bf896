"""Bulk through a friend that relays for its peers, next to `gpumesh-relay` on the
same host, alternated in one run.

Needs root (it builds the NAT lab of scripts/natlab.sh: two hosts, each behind a
symmetric NAT, ``up drop --random-fully``, so punching fails and every byte is
relayed). On the public segment (203.0.113.1) run both relays: a ``gpumesh-relay``
on UDP 4799 and carol, a node sharing on UDP 47000 with ``relay_for_peers = true``
(``relay_for_peers_rate`` raised to 10GB/s here so that the setting's default,
10MB/s, does not decide the figure). Host B holds the provider (alice, sharing,
registered with both); host A holds two consumer homes: one with ``relay`` set and
unaware of carol, one paired with carol, with no ``relay`` set and alice's pairing
code from before she set hers. Each turn, ``gpumesh connect alice --json --speed
SIZE`` (default 64 MiB over one QUIC stream, its session kept warm between turns)
runs from one consumer then the other, the order rotating, ``--rounds`` times; the
path each reports must be ``relayed via 203.0.113.1:4799`` and ``relayed (peer
carol-box)``. Figures: median MB/s (10^6 bytes/s) and the ratio friend /
gpumesh-relay. Goal: at least 0.9x.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _benchlib import exit_cleanly_on_sigterm, interrupted, print_rows, source_note, summarize

ROOT = Path(__file__).resolve().parents[1]
NATLAB = ROOT / "scripts" / "natlab.sh"
PREFIX = "gmpb"
RELAY = "203.0.113.1:4799"
BIN = Path(sys.executable).parent


def _natlab(*args: str) -> None:
    env = dict(os.environ, GPUMESH_NATLAB_PREFIX=PREFIX)
    subprocess.run(["bash", str(NATLAB), *args], env=env, check=True, capture_output=True)


def _gpumesh(ns: str, home: Path, *args: str, timeout: float = 300) -> str:
    env = dict(os.environ, GPUMESH_HOME=str(home))
    env.pop("GPUMESH_LOG", None)
    result = subprocess.run(
        ["ip", "netns", "exec", f"{PREFIX}{ns}", str(BIN / "gpumesh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"gpumesh {' '.join(args[:2])}: {result.stderr.strip()}")
    return result.stdout


def _until(what: str, check: object) -> None:
    deadline = time.monotonic() + 30
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within 30 s: {what}")
        time.sleep(0.2)


def _set_up(work: Path) -> dict[str, tuple[str, Path]]:
    """The homes, by role: (namespace, home)."""
    nodes = {
        "via-relay": ("A", work / "bob"),
        "via-friend": ("A", work / "dave"),
        "alice": ("B", work / "alice"),
        "carol": ("P", work / "carol"),
    }
    names = {"via-relay": "bob", "via-friend": "dave", "alice": "alice", "carol": "carol-box"}
    for role, (ns, home) in nodes.items():
        _gpumesh(ns, home, "init", "--name", names[role])
        _gpumesh(ns, home, "config", "set", "job_network", "bridge")
    codes = {role: _gpumesh(*nodes[role], "pair-code").strip() for role in nodes}
    # dave has alice's code from before she set her relay: he does not know of it.
    for role in ("via-relay", "alice"):
        _gpumesh(*nodes[role], "config", "set", "relay", RELAY)
    codes["alice-with-relay"] = _gpumesh(*nodes["alice"], "pair-code").strip()
    carol = nodes["carol"]
    _gpumesh(*carol, "config", "set", "relay_for_peers", "true")
    _gpumesh(*carol, "config", "set", "relay_for_peers_rate", "10GB/s")
    _gpumesh(*carol, "share", "--detach")
    _gpumesh(*nodes["alice"], "share", "--detach")
    _gpumesh(*nodes["via-relay"], "pair", "--offline", codes["alice-with-relay"])
    _gpumesh(*nodes["alice"], "pair", "--offline", codes["via-relay"])
    for one, other in (
        ("via-friend", "alice"),
        ("via-friend", "carol"),
        ("alice", "carol"),
    ):
        _gpumesh(*nodes[one], "pair", "--offline", codes[other])
        _gpumesh(*nodes[other], "pair", "--offline", codes[one])
    # Each learns from carol's Welcome that she relays; alice registers with her.
    for role in ("via-friend", "alice"):
        _gpumesh(*nodes[role], "connect", "carol-box")

    def registered() -> bool:
        view = json.loads(_gpumesh(*carol, "status", "--json", "--offline"))
        return "alice" in (view.get("relaying") or {}).get("registered", [])

    _until("alice registered with carol", registered)
    return nodes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="64MiB", help="bytes per push (default 64MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="pushes through each (default 5)")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    if os.geteuid() != 0:
        print("bench/peer_relay.py needs root (network namespaces)", file=sys.stderr)
        return 2
    if note := source_note():
        print(note, file=sys.stderr)
    speeds: dict[str, list[float]] = {"via-relay": [], "via-friend": []}
    paths: dict[str, set[str]] = {"via-relay": set(), "via-friend": set()}
    relay: subprocess.Popen[bytes] | None = None
    _natlab("up", "drop", "--random-fully")
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-peer-relay-") as tmp:
            command = [str(BIN / "gpumesh-relay"), "--listen", RELAY, "--open"]
            relay = subprocess.Popen(
                ["ip", "netns", "exec", f"{PREFIX}P", *command, "--log-level", "warning"],
                stdout=subprocess.DEVNULL,
            )
            nodes = _set_up(Path(tmp))
            for role in speeds:  # untimed: the dial and the relay's session
                _gpumesh(*nodes[role], "connect", "alice")
            for turn in range(args.rounds):
                order = list(speeds) if turn % 2 == 0 else list(reversed(speeds))
                for role in order:
                    view = json.loads(
                        _gpumesh(*nodes[role], "connect", "alice", "--json", "--speed", args.size)
                    )
                    speeds[role].append(float(view["upload_mb_per_s"]))
                    paths[role].add(view["path"])
                    print(f"  {turn + 1} {role}: {view['path']}, {view['upload_mb_per_s']} MB/s")
            for ns, home in nodes.values():
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    _gpumesh(ns, home, "daemon", "stop", timeout=60)
    except KeyboardInterrupt:
        return interrupted()
    finally:
        if relay is not None and relay.poll() is None:
            relay.kill()
        _natlab("down")
    expected = {"via-relay": f"relayed via {RELAY}", "via-friend": "relayed (peer carol-box)"}
    for role, want in expected.items():
        if paths[role] != {want}:
            print(f"warning: {role} took {sorted(paths[role])}, not {want}", file=sys.stderr)
    relayed, friend = summarize(speeds["via-relay"]), summarize(speeds["via-friend"])
    print(f"\nBulk of {args.size} through a relay, symmetric NAT on both sides, medians:")
    rows = [[f"gpumesh-relay {RELAY}", relayed], ["peer carol-box (relay_for_peers)", friend]]
    print_rows(
        ["through", "MB/s p50", "low", "high"],
        [[name, f"{s.p50:.1f}", f"{s.low:.1f}", f"{s.high:.1f}"] for name, s in rows],
    )
    print(f"\nfriend / gpumesh-relay: {friend.p50 / relayed.p50:.2f}x (goal: at least 0.9x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
