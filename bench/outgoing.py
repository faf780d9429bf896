"""A re-dial through a relay: the node process's kept registration vs. a fresh one.

What is measured: the wall time from "dial the peer" to "its answer to one
``Ping``" for a session that only the relay reaches (the dialer knows no address
of the peer), then the session is closed, as a re-dial after a dropped warm
session does. Two ways, interleaved (alternating which goes first), ``--repeat``
times each:

* fresh: what every dial from outside the node process does (a script's
  ``gpumesh.Mesh(in_process=True)``): a new UDP socket, a new registration
  with the relay (Hello, Challenge, Register, Registered), the relay's
  connect, hole punching, QUIC and the proof;
* kept: the node process's one socket (``transport/outgoing.py``), registered
  once before the timing starts: the relay's connect, punching, QUIC and the proof.

Everything runs on 127.0.0.1: a real `gpumesh-relay` process and a provider
agent in this process. On loopback a round trip costs next to nothing, so the
gap is the registration's CPU and packets; across the internet it is one more
round trip to the relay per dial (two with a Retry-like challenge), which this
does not add. Punching succeeds at once on loopback, so both pay the same short
wait for it.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _benchlib import exit_cleanly_on_sigterm, free_port, interrupted, print_rows, summarize
from gpumesh.agent.server import Agent
from gpumesh.client.node import Node
from gpumesh.protocol.messages import Ping, Pong
from gpumesh.transport.outgoing import OutgoingSocket
from gpumesh.transport.session import RelayHint, open_session


def _start_relay(work: Path) -> tuple[subprocess.Popen[str], str]:
    port = free_port(kind=2)  # SOCK_DGRAM
    log = work / "relay.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpumesh.relay.main", "--listen", f"127.0.0.1:{port}", "--open"],
            stdout=out,
            stderr=out,
            text=True,
        )
    deadline = time.monotonic() + 20
    while "listening on" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gpumesh-relay did not start: {log.read_text()}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port}"


async def _run(work: Path, relay: str, repeat: int) -> dict[str, list[float]]:
    alice, bob = Node(work / "a"), Node(work / "b")
    alice.init("alice")
    bob.init("bob")
    alice.home.config.set("listen_host", "127.0.0.1")
    alice.home.config.set("relay", relay)
    agent = Agent(alice.home, host="127.0.0.1", port=0)
    await agent.start()
    outgoing = OutgoingSocket(lambda: bob.home.identity)
    try:
        bob.pair(alice.pairing_code())
        alice.pair(bob.pairing_code())
        assert agent.relay is not None
        await agent.relay.wait_registered(20)
        hint = RelayHint(relay)
        key = alice.home.identity.public_key

        async def dial(via: OutgoingSocket | None) -> float:
            started = time.perf_counter()
            session = await open_session(
                bob.home.identity, "bob", [], key, relays=[hint], via=via, peer_label="alice"
            )
            try:
                reply = await session.request(Ping(sent=started))
                assert isinstance(reply, Pong)
                return (time.perf_counter() - started) * 1000
            finally:
                session.close()

        await dial(None)  # untimed warm-ups: imports, first-use caches
        await dial(outgoing)
        samples: dict[str, list[float]] = {"fresh": [], "kept": []}
        for index in range(repeat):
            order = ("fresh", "kept") if index % 2 == 0 else ("kept", "fresh")
            for kind in order:
                samples[kind].append(await dial(None if kind == "fresh" else outgoing))
        return samples
    finally:
        outgoing.close()
        agent.stop()
        alice.close()
        bob.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="dials of each kind")
    parser.add_argument("--quick", action="store_true", help="3 of each: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.repeat = 3
    exit_cleanly_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as tmp:
        work = Path(tmp)
        proc, relay = _start_relay(work)
        try:
            samples = asyncio.run(_run(work, relay, args.repeat))
        except KeyboardInterrupt:
            return interrupted()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    fresh, kept = summarize(samples["fresh"]), summarize(samples["kept"])
    print(f"relayed dial + one Ping on 127.0.0.1, {args.repeat} of each, interleaved")
    print_rows(
        ["", "p50 ms", "p90 ms"],
        [
            ["fresh socket + registration", f"{fresh.p50:.1f}", f"{fresh.p90:.1f}"],
            ["kept registration (node)", f"{kept.p50:.1f}", f"{kept.p90:.1f}"],
        ],
    )
    print(f"kept / fresh (p50): {kept.p50 / fresh.p50:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
