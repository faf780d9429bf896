"""A paired peer's connects while strangers flood the share port with Initials.

What is measured: a paired peer (bob, this process) opens a fresh session to
alice (dial, QUIC handshake, identity proof) and sends one Ping, every
``--every`` seconds; each connect counts as a success when the Pong is back
within ``--timeout``. First ``--quiet`` seconds without a flood, then
``--seconds`` with one. Reported per phase: connect success rate, p50/p90 of
the successes' connect time, and the agent's CPU use and RSS.

* The agent is a separate ``gpumesh share`` process (as in real use, and so
  its CPU time and RSS can be read from /proc), alice's home on a free UDP
  port of 127.0.0.1 (bulk.py's ``make_nodes`` and ``running_agent``).
* The flood is another process: ``--rate`` junk Initials per second (a
  version 1 Initial header with random ids over random bytes, 1200 bytes,
  never decryptable) spread over 16 source addresses, 127.0.0.2-17 (Linux
  loopback takes all of 127/8), plus ``--stalls`` per second real first
  flights that echo the agent's Retry and then never go on (each makes a
  connection from a validated address that holds a slot until the identity
  proof times out, then puts that address in the penalty box). The flooder
  drains the Retries sent back to it.
* bob's pace (2.5 connects/s by default) stays under both the allowance for
  unvalidated connections (4/s) and the per-address rate (5/s): without the
  flood its connects need no Retry; with it, each takes the Retry round trip.

Goals: success rate >= 99% and p50 <= 2x the quiet p50 during the flood; the
agent's RSS grows by <= 20 MB. The agent's own summary lines (what it refused
and how many Retries it sent) are shown at the end.

``--http``: the local HTTP flood instead. A `gpumesh-control` process (the node
process in the foreground) on a free loopback port; rounds alternate an
authorised request (``GET /api/v1/node`` with the home's bearer token, a fresh
connection each) with no connection held and the same request while a holder
process keeps ``--held`` connections open on that port from the same address,
half idle, half with a head never finished (it reopens at once those the
server closes). Goals: the held p50 <= 2x the quiet p50, and no request over 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import re
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from _benchlib import (
    exit_cleanly_on_sigterm,
    free_port,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from bulk import make_nodes, running_agent
from gpumesh.client.node import Node
from gpumesh.protocol.messages import Ping, Pong

SOURCES = [f"127.0.0.{i}" for i in range(2, 18)]
TICK = 0.005
JUNK_POOL = 4096
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --- the flooder (its own process) --------------------------------------------------------


def junk_initial() -> bytes:
    """A version 1 Initial header with random ids over random bytes: parses, never decrypts."""
    header = b"\xc3\x00\x00\x00\x01\x08" + os.urandom(8) + b"\x08" + os.urandom(8) + b"\x00\x44\xb0"
    return header + os.urandom(1200 - len(header))


def flood(target: tuple[str, int], rate: float, stalls: float, seconds: float) -> dict[str, float]:
    """Send for ``seconds``; returns what was sent."""
    from qh3 import QuicConnection

    from gpumesh.transport.quicsetup import client_configuration

    def first_flight() -> tuple[QuicConnection, list[bytes]]:
        client = QuicConnection(configuration=client_configuration())
        client.connect(target, time.monotonic())
        return client, [data for data, _ in client.datagrams_to_send(time.monotonic())]

    sockets = []
    for host in SOURCES:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((host, 0))
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sockets.append(sock)
    pool = [junk_initial() for _ in range(JUNK_POOL)]
    flights = [first_flight() for _ in range(8)]
    waiting: dict[bytes, QuicConnection] = {}
    sent = junk = stalled = echoed = retries = 0
    started = time.monotonic()
    end = started + seconds
    while (now := time.monotonic()) < end:
        elapsed = now - started
        for _ in range(int(rate * elapsed) - junk):
            sock = sockets[junk % len(sockets)]
            with contextlib.suppress(BlockingIOError):
                sock.sendto(pool[junk % JUNK_POOL], target)
                sent += 1
            junk += 1
        for _ in range(int(stalls * elapsed) - stalled):
            client, flight = flights.pop() if flights else first_flight()
            waiting[client.host_cid] = client
            sock = sockets[stalled % len(sockets)]
            for data in flight:
                with contextlib.suppress(BlockingIOError):
                    sock.sendto(data, target)
                    sent += 1
            stalled += 1
        for sock in sockets:
            for _ in range(256):
                try:
                    packet = sock.recv(2048)
                except BlockingIOError:
                    break
                if packet[0] & 0xF0 != 0xF0:
                    continue  # the agent's handshake packets: never answered
                retries += 1
                client = waiting.pop(packet[6 : 6 + packet[5]], None)
                if client is None:
                    continue
                client.receive_datagram(packet, target, time.monotonic())
                for data, _ in client.datagrams_to_send(time.monotonic()):
                    with contextlib.suppress(BlockingIOError):
                        sock.sendto(data, target)
                        sent += 1
                echoed += 1
        if len(flights) < 8:
            flights.append(first_flight())
        time.sleep(TICK)
    seconds_taken = time.monotonic() - started
    for sock in sockets:
        sock.close()
    return {
        "sent": sent,
        "junk": junk,
        "stalled": stalled,
        "echoed": echoed,
        "retries_seen": retries,
        "seconds": seconds_taken,
    }


# --- the agent, from /proc -----------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# --- the peer -----------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    times: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    cpu: float = 0.0
    wall: float = 0.0
    rss_start: float = 0.0
    rss_end: float = 0.0
    rss_peak: float = 0.0

    @property
    def attempts(self) -> int:
        return len(self.times) + len(self.failures)


async def connect_once(node: Node, timeout: float) -> float:
    started = time.perf_counter()
    async with asyncio.timeout(timeout), node.session("alice") as session:
        reply = await session.request(Ping(sent=time.time()))
    if not isinstance(reply, Pong):
        raise RuntimeError(f"alice answered Ping with {type(reply).__name__}")
    return time.perf_counter() - started


async def connects(
    node: Node, phase: Phase, pid: int, seconds: float, args: argparse.Namespace
) -> None:
    """Connect every ``args.every`` seconds for ``seconds``; sample the agent meanwhile."""
    loop = asyncio.get_running_loop()
    phase.rss_start = phase.rss_peak = rss_mb(pid)
    cpu_start, wall_start = cpu_seconds(pid), loop.time()
    end = wall_start + seconds
    next_at = wall_start
    while (now := loop.time()) < end:
        if now < next_at:
            await asyncio.sleep(next_at - now)
        next_at += args.every
        try:
            phase.times.append(await connect_once(node, args.timeout))
        except Exception as exc:  # a failed connect is a figure, not the end of the run
            phase.failures.append(f"{type(exc).__name__}: {exc}")
        phase.rss_peak = max(phase.rss_peak, rss_mb(pid))
    phase.cpu = cpu_seconds(pid) - cpu_start
    phase.wall = loop.time() - wall_start
    phase.rss_end = rss_mb(pid)


async def measure(args: argparse.Namespace, bob: Node, pid: int, port: int) -> list[Phase]:
    for _ in range(3):  # untimed warm-up: imports, first-use caches
        await connect_once(bob, args.timeout)
    quiet = Phase("without flood")
    await connects(bob, quiet, pid, args.quiet, args)
    flooded = Phase("during flood")
    flooder = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--flooder",
        f"127.0.0.1:{port}:{args.rate}:{args.stalls}:{args.seconds}",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        await connects(bob, flooded, pid, args.seconds, args)
        out, _ = await asyncio.wait_for(flooder.communicate(), args.seconds + 60)
    finally:
        if flooder.returncode is None:
            flooder.kill()
            await flooder.wait()
    flooded.name += " " + flood_line(json.loads(out))
    await asyncio.sleep(12)  # the agent's last summary line of the flood
    after = Phase("after flood")
    await connects(bob, after, pid, min(args.quiet, 5.0), args)
    return [quiet, flooded, after]


def flood_line(sent: dict[str, float]) -> str:
    pps = sent["sent"] / sent["seconds"]
    return (
        f"({pps:,.0f} packets/s for {sent['seconds']:.0f} s: {sent['junk']:,.0f} junk Initials, "
        f"{sent['stalled']:,.0f} stalled handshakes, {sent['echoed']:,.0f} of them echoing a "
        f"Retry; {sent['retries_seen']:,.0f} Retries came back)"
    )


# --- forged FEC frames (--fec-frames) -------------------------------------------------------
#
# A transfer over a link with parity on while another process sends forged FEC frames
# from the dialer's address (spoofed: a raw socket writes its own UDP header), next to
# the same transfer while the same process sends the same frames to a closed port.
# Goal: throughput during the forgery >= 0.9x throughput beside it.


def fec_forge(target: tuple[str, int], source_port: int, rate: float, seconds: float) -> None:
    """Send forged FEC frames (random group ids, full size, data and parity alike) to
    ``target`` from ``source_port`` of the same host for ``seconds`` or until SIGTERM;
    print how many."""
    from gpumesh.protocol import fec

    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    sock.setblocking(False)
    frames: list[bytes] = []
    for i in range(JUNK_POOL):
        marker = fec.PARITY if i % 9 == 8 else fec.DATA
        body = struct.pack("!BIB", marker, int.from_bytes(os.urandom(4), "big"), i % 16)
        body += os.urandom(1400 + fec.TAG)
        # UDP header: ports, length, checksum 0 (none, which IPv4 allows)
        frames.append(struct.pack("!HHHH", source_port, target[1], 8 + len(body), 0) + body)
    sent = 0
    started = time.monotonic()
    end = started + seconds
    try:
        while (now := time.monotonic()) < end:
            for _ in range(int(rate * (now - started)) - sent):
                with contextlib.suppress(BlockingIOError):
                    sock.sendto(frames[sent % JUNK_POOL], (target[0], 0))
                sent += 1
            time.sleep(TICK)
    finally:
        sock.close()
        print(sent, flush=True)


async def fec_transfer(size: int, forged_to: str | None, rate: float) -> tuple[float, int, int]:
    """One upload of ``size`` bytes over a fresh link with parity on, while forged
    frames go to the provider (``forged_to="provider"``) or to a closed port; returns
    MB/s, frames sent by the forger, and frames the provider dropped as forged."""
    from gpumesh.identity.keys import Identity
    from gpumesh.transport.endpoint import QuicEndpoint
    from gpumesh.transport.quic import QuicLink
    from gpumesh.transport.session import accept_session, open_session
    from gpumesh.transport.stream import Stream

    provider, dialer = Identity.generate(), Identity.generate()
    payload = os.urandom(1024 * 1024)
    done: asyncio.Future[QuicLink] = asyncio.get_running_loop().create_future()
    tasks: set[asyncio.Future[None]] = set()

    async def serve(link: QuicLink) -> None:
        accepted = await accept_session(link, provider, "provider", lambda key: None)
        link.buffer_limit = 0

        async def sink(stream: Stream) -> None:
            while await stream.read_data():
                pass
            done.set_result(link)

        link.on_stream = lambda stream: tasks.add(asyncio.ensure_future(sink(stream)))
        for stream in accepted.early:
            link.on_stream(stream)

    endpoint = QuicEndpoint.listen(
        provider, "127.0.0.1", 0, on_link=lambda link: tasks.add(asyncio.ensure_future(serve(link)))
    )
    port = endpoint.local_address[1]
    session = await open_session(dialer, "dialer", [("127.0.0.1", port)], provider.public_key)
    await session.established()
    closed = free_port(kind=socket.SOCK_DGRAM)
    # Aimed at a closed port, the frames come from that port too: the kernel's ICMP
    # answer then goes nowhere instead of to the dialer's socket.
    target, source = (port, session.link.local_port) if forged_to else (closed, closed)
    forger = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--fec-forger",
        f"127.0.0.1:{target}:{source}:{rate}:600",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        await asyncio.sleep(0.5)  # the forger is sending by now
        started = time.perf_counter()
        stream = session.open_stream()
        for _ in range(size // len(payload)):
            await stream.send_data(payload)
        stream.end_data()
        provider_link = await asyncio.wait_for(done, 600)
        elapsed = time.perf_counter() - started
    finally:
        forger.terminate()
        out, _ = await forger.communicate()
    decoder = provider_link.fec_decoder
    dropped = 0 if decoder is None else decoder.counters.forged
    session.close()
    endpoint.close()
    sent = int(out.decode().strip() or 0)
    return size / elapsed / 1e6, sent, dropped


def fec_frames_main(args: argparse.Namespace) -> int:
    """Alternate transfers beside and under forged FEC frames; print the medians."""
    if os.geteuid() != 0:
        print("--fec-frames sends spoofed frames through a raw socket: run it as root")
        return 2
    os.environ["GPUMESH_FEC"] = "on"  # parity from the first datagram, loopback or not
    size = args.fec_mib * 1024 * 1024
    beside: list[float] = []
    under: list[float] = []
    sent = dropped = 0
    print(
        f"{args.fec_repeat} x 2 uploads of {args.fec_mib} MiB with parity on, "
        f"{args.fec_rate:,.0f} forged FEC frames/s to the provider or to a closed port..."
    )
    for _ in range(args.fec_repeat):  # alternated, so load drifts hit both alike
        beside.append(asyncio.run(fec_transfer(size, None, args.fec_rate))[0])
        speed, forged_sent, forged_dropped = asyncio.run(
            fec_transfer(size, "provider", args.fec_rate)
        )
        under.append(speed)
        sent, dropped = sent + forged_sent, dropped + forged_dropped
    a, b = summarize(beside), summarize(under)
    print_rows(
        ["MB/s", "median", "low", "high"],
        [
            ["forged frames to a closed port", f"{a.p50:.1f}", f"{a.low:.1f}", f"{a.high:.1f}"],
            ["forged frames to the provider", f"{b.p50:.1f}", f"{b.low:.1f}", f"{b.high:.1f}"],
        ],
    )
    print(
        f"ratio {b.p50 / a.p50:.2f}x (goal >= 0.9x); {sent:,} frames forged at the provider, "
        f"{dropped:,} dropped as forged; load average {os.getloadavg()[0]:.2f}"
    )
    return 0


# --- report ---------------------------------------------------------------------------------


def report(phases: list[Phase], log: str) -> None:
    rows = []
    for phase in phases:
        ok = len(phase.times)
        rate = 100.0 * ok / phase.attempts if phase.attempts else 0.0
        p50 = p90 = "-"
        if phase.times:
            summary = summarize(phase.times)
            p50, p90 = f"{summary.p50 * 1e3:.1f}", f"{summary.p90 * 1e3:.1f}"
        rows.append(
            [
                phase.name.split(" (")[0],
                f"{ok}/{phase.attempts}",
                f"{rate:.1f}",
                p50,
                p90,
                f"{100 * phase.cpu / phase.wall:.0f}" if phase.wall else "-",
                f"{phase.rss_end - phase.rss_start:+.1f}",
                f"{phase.rss_peak:.1f}",
            ]
        )
    print()
    print_rows(
        ["", "connects", "success %", "p50 ms", "p90 ms", "agent CPU %", "RSS MB +/-", "RSS peak"],
        rows,
    )
    quiet, flooded = phases[0], phases[1]
    print(f"  flood: {flooded.name.split(' (', 1)[1].rstrip(')')}")
    if quiet.times and flooded.times:
        ratio = summarize(flooded.times).p50 / summarize(quiet.times).p50
        print(f"  p50 during flood / without: {ratio:.2f}x (goal <= 2x)")
    growth = flooded.rss_peak - flooded.rss_start
    print(
        f"  agent RSS: {flooded.rss_start:.1f} MB when the flood starts, peak "
        f"{flooded.rss_peak:.1f} MB during it (+{growth:.1f} MB; goal <= 20 MB)"
    )
    for phase in phases:
        for failure in sorted(set(phase.failures))[:3]:
            print(f"  {phase.name.split(' (')[0]} failure: {failure}")
    lines = [line for line in log.splitlines() if re.search(r"refused \d+ packet|Retr", line)]
    print(f"  the agent's summary lines ({len(lines)}):")
    for line in lines[-6:]:
        print(f"    {line.strip()}")


# --- the local HTTP flood (--http) ---------------------------------------------------------


HALF_HEAD = b"POST /api/v1/auth/session HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n"
"""A head that never ends."""


class Holder:
    """A thread that keeps ``count`` connections to ``port`` open, half idle and half
    half-sent, reopening those the server closes, while :attr:`holding` is set.
    It runs in a process of its own (:func:`hold_main`), so the client timed does
    not share an interpreter with it."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.count = count
        self.holding = threading.Event()
        self.done = threading.Event()
        self.closed_by_server = 0
        self.open_now = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _connect(self, index: int) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            if index % 2:
                sock.sendall(HALF_HEAD)
        except OSError:
            return None
        return sock

    def _run(self) -> None:
        held: dict[int, socket.socket] = {}
        while not self.done.is_set():
            if not self.holding.is_set():
                for sock in held.values():
                    sock.close()
                held.clear()
                self.open_now = 0
                self.holding.wait(0.05)
                continue
            for index in range(self.count):
                if index not in held and (sock := self._connect(index)) is not None:
                    held[index] = sock
            self.open_now = len(held)
            ready, _, _ = select.select(list(held.values()), [], [], 0.05)
            for sock in ready:
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if data and not data.endswith(b"}"):
                    continue
                index = next(i for i, s in held.items() if s is sock)
                sock.close()
                del held[index]
                self.closed_by_server += 1
        for sock in held.values():
            sock.close()

    def stop(self) -> None:
        self.done.set()
        self.holding.set()
        self._thread.join(timeout=10)


def hold_main(port: int, count: int) -> int:
    """The holder process: ``hold`` and ``release`` lines on stdin, each answered
    with the connections open once done; at the end, how many the server closed."""
    holder = Holder(port, count)
    for line in sys.stdin:
        if line.strip() == "hold":
            holder.holding.set()
            start = time.monotonic()
            while holder.open_now < count and time.monotonic() - start < 5:
                time.sleep(0.02)
        else:
            holder.holding.clear()
            while holder.open_now:
                time.sleep(0.02)
        print(holder.open_now, flush=True)
    holder.stop()
    print(holder.closed_by_server, flush=True)
    return 0


def http_request(port: int, token: str) -> float:
    """Seconds for one authorised request on a fresh connection (inf when it failed)."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/api/v1/node", headers={"Authorization": f"Bearer {token}"})
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            return float("inf")
    except OSError:
        return float("inf")
    finally:
        connection.close()
    return time.perf_counter() - start


def http_flood(args: argparse.Namespace) -> int:
    """The ``--http`` mode: alternate rounds, then the table."""
    with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as folder:
        home = Path(folder) / "home"
        env = dict(os.environ, GPUMESH_HOME=str(home))
        env.pop("GPUMESH_API_TOKEN", None)
        subprocess.run(
            [sys.executable, "-m", "gpumesh", "init", "--name", "bench-http"],
            env=env,
            check=True,
            capture_output=True,
        )
        port = free_port()
        control = Path(sys.executable).parent / "gpumesh-control"
        proc = subprocess.Popen(
            [str(control), "--listen", f"127.0.0.1:{port}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        holder = subprocess.Popen(
            [sys.executable, __file__, "--hold", f"{port}:{args.held}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdin is not None and holder.stdout is not None

        def tell(what: str) -> int:
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write(what + "\n")
            holder.stdin.flush()
            return int(holder.stdout.readline())

        closed = 0
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if "OpenAPI" in line:
                    break
            token = (home / "api.token").read_text().strip()
            print(
                f"{args.rounds} rounds of {args.per_round} authorised requests each: none held, "
                f"then {args.held} held (half idle, half half-sent)...",
                flush=True,
            )
            quiet: list[float] = []
            held: list[float] = []
            held_counts: list[int] = []
            for _ in range(args.rounds):
                tell("release")
                time.sleep(0.2)
                quiet += [http_request(port, token) for _ in range(args.per_round)]
                held_counts.append(tell("hold"))
                held += [http_request(port, token) for _ in range(args.per_round)]
            holder.stdin.close()
            closed = int(holder.stdout.readline() or 0)
        finally:
            holder.kill()
            holder.wait(timeout=30)
            proc.terminate()
            proc.wait(timeout=30)
    http_report(quiet, held, held_counts, closed)
    return 0


def http_report(quiet: list[float], held: list[float], counts: list[int], closed: int) -> None:
    rows = []
    for name, samples in (("none held", quiet), ("held", held)):
        done = [s for s in samples if s != float("inf")]
        summary = summarize(done) if done else None
        rows.append(
            [
                name,
                f"{len(done)}/{len(samples)}",
                f"{summary.p50 * 1000:.1f}" if summary else "-",
                f"{summary.p90 * 1000:.1f}" if summary else "-",
                f"{summary.high * 1000:.1f}" if summary else "-",
            ]
        )
    print_rows(["phase", "answered", "p50 ms", "p90 ms", "max ms"], rows)
    ok_quiet = [s for s in quiet if s != float("inf")]
    ok_held = [s for s in held if s != float("inf")]
    if ok_quiet and ok_held:
        ratio = summarize(ok_held).p50 / summarize(ok_quiet).p50
        slowest = max(held + quiet)
        print(
            f"  held p50 / none-held p50: {ratio:.2f}x (goal <= 2x); slowest {slowest:.3f} s "
            f"(goal <= 2 s); connections held at each round's start: min {min(counts)}, "
            f"max {max(counts)}; closed by the server meanwhile: {closed}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="A paired peer's connects to a separate `gpumesh share` process, without "
        "and during a flood of junk and stalled Initials from 16 loopback addresses.",
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="flood length (default 30)")
    parser.add_argument(
        "--rate", type=float, default=2500.0, help="junk Initials per second (default 2500)"
    )
    parser.add_argument(
        "--stalls",
        type=float,
        default=20.0,
        help="handshakes per second that echo the Retry then stall (default 20)",
    )
    parser.add_argument(
        "--quiet", type=float, default=15.0, help="seconds of connects without flood (default 15)"
    )
    parser.add_argument(
        "--every", type=float, default=0.4, help="seconds between bob's connects (default 0.4)"
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="a connect's limit (default 10 s)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 s of each")
    parser.add_argument("--flooder", help=argparse.SUPPRESS)
    parser.add_argument(
        "--fec-frames",
        action="store_true",
        help="instead: an upload under forged FEC frames from the dialer's address, "
        "beside the same frames sent to a closed port (needs root)",
    )
    parser.add_argument("--fec-mib", type=int, default=32, help="--fec-frames: MiB per upload")
    parser.add_argument("--fec-rate", type=float, default=10_000.0, help="--fec-frames: frames/s")
    parser.add_argument("--fec-repeat", type=int, default=5, help="--fec-frames: uploads each")
    parser.add_argument("--fec-forger", help=argparse.SUPPRESS)
    parser.add_argument(
        "--http",
        action="store_true",
        help="the local HTTP flood instead: connections held on a gpumesh-control port",
    )
    parser.add_argument("--hold", help=argparse.SUPPRESS)
    parser.add_argument(
        "--held", type=int, default=300, help="--http: connections held (default 300)"
    )
    parser.add_argument(
        "--rounds", type=int, default=20, help="--http: alternated rounds (default 20)"
    )
    parser.add_argument(
        "--per-round", type=int, default=10, help="--http: requests per phase (default 10)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.quiet = 5.0, 5.0
        args.rounds = min(args.rounds, 5)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fec_forger:
        host, port, source, rate, seconds = args.fec_forger.split(":")
        exit_cleanly_on_sigterm()
        fec_forge((host, int(port)), int(source), float(rate), float(seconds))
        return 0
    if args.fec_frames:
        return fec_frames_main(args)
    if args.flooder:
        host, port, rate, stalls, seconds = args.flooder.split(":")
        print(json.dumps(flood((host, int(port)), float(rate), float(stalls), float(seconds))))
        return 0
    if args.hold:
        port, count = args.hold.split(":")
        return hold_main(int(port), int(count))
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    if args.http:
        try:
            return http_flood(args)
        except KeyboardInterrupt:
            return interrupted()
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as folder:
            tmp = Path(folder)
            port = free_port(kind=socket.SOCK_DGRAM)
            alice, bob = make_nodes(tmp, port)
            alice.close()  # the agent process owns alice's home from here on
            log = tmp / "agent.log"
            try:
                with running_agent(tmp / "a", log) as agent:
                    print(
                        f"Connecting every {args.every:g} s: {args.quiet:g} s without flood, "
                        f"{args.seconds:g} s with {args.rate:g} junk Initials/s and "
                        f"{args.stalls:g} stalled handshakes/s from {len(SOURCES)} addresses...",
                        flush=True,
                    )
                    phases = asyncio.run(measure(args, bob, agent.pid, port))
                    report(phases, log.read_text(errors="replace"))
            finally:
                bob.close()
    except KeyboardInterrupt:
        return interrupted()
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
