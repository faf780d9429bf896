"""CUDA remoting on loopback, next to the same QUIC session's plain requests and bulk.

What is measured, in one run, on one session to a provider running as its own
``gpumesh share`` process (with the host-memory fallback where there is no GPU,
the driver where there is one):

* call latency: the round trip of a CUDA call that answers (device count),
  p50 of ``--calls``, next to a plain request's round trip (Ping) on the same
  QUIC session; both start from this process's thread and cross to the
  session's event loop once, as a program's call does. Goal: <= 1.5x.
* host->device bandwidth: a ``--size`` copy (default 256 MiB) with the
  synchronize after it, next to the same session's bulk throughput (a
  ThroughputRequest stream of the same size, what ``connect --speed`` and
  bench/bulk.py measure). Goal: >= 0.8x. Device->host is shown too.
* small copies per second: 4 KiB host->device copies sent back to back (never
  waited for) with one synchronize at the end.
* vector add: GPUMesh's kernel on three vectors that fill the session (after
  the runs above), and the worker's peak RSS (``VmHWM``) over the whole
  session. Goal on the host-memory fallback: the peak within the session's
  memory + 64 MiB (the worker's own ceiling).

Figures are medians of ``--repeat`` runs, taken alternately.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _benchlib import exit_cleanly_on_sigterm, free_port, interrupted, print_rows, source_note
from bulk import make_nodes, running_agent
from gpumesh.client.cuda import cuda_sessions
from gpumesh.client.cudadevice import local_pair
from gpumesh.client.cudaremote import carry_socket
from gpumesh.client.node import Node
from gpumesh.cuda import RemoteDevice
from gpumesh.gpu.cudakernels import VADD_F32, VADD_PTX
from gpumesh.protocol.messages import Ping, ThroughputReply, ThroughputRequest

MIB = 1024 * 1024
HEADROOM = 64 * MIB
"""What the fallback worker may hold beyond its session's memory (gpumesh.agent.cudaconfine)."""


class Carried:
    """A RemoteDevice whose QUIC session this script can also send plain requests on."""

    def __init__(self, node: Node, peer: str, memory: int) -> None:
        mine, theirs = local_pair()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.session: Any = None
        ready = threading.Event()

        def hook(session: Any) -> None:
            self.session = session
            self.loop = asyncio.get_running_loop()
            ready.set()

        async def run() -> None:
            await carry_socket(node, peer, memory, theirs, on_session=hook)

        self.thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
        self.thread.start()
        self.device = RemoteDevice.over_socket(mine, peer)
        ready.wait(30)

    def run(self, coro: Any) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def ping(self) -> float:
        sent = time.perf_counter()
        self.run(self.session.request(Ping(sent=sent)))
        return time.perf_counter() - sent

    def bulk(self, size: int) -> float:
        async def push() -> float:
            stream = self.session.open_stream()
            chunk = bytes(MIB)
            started = time.perf_counter()
            stream.send_message(ThroughputRequest(size=size))
            left = size
            while left:
                part = chunk[: min(left, len(chunk))]
                await stream.send_data(part)
                left -= len(part)
            stream.end_data()
            stream.finish()
            await stream.expect(ThroughputReply)
            return time.perf_counter() - started

        seconds: float = self.run(push())
        return seconds

    def close(self) -> None:
        self.device.close()
        self.thread.join(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", type=int, default=256, help="MiB per bandwidth run")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--small", type=int, default=5000, help="4 KiB copies per run")
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args(argv)
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note, file=sys.stderr)
    size = options.size * MIB
    with tempfile.TemporaryDirectory(prefix="gpumesh-bench-cuda-") as tmp:
        alice, bob = make_nodes(Path(tmp), free_port(socket.SOCK_DGRAM))
        alice.home.store.set_cuda_share(True)
        # CUDA sessions need no job network, and a GPU machine may have no iptables.
        alice.home.config.set("job_network", "none")
        alice.home.config.save()
        alice.home.store.cuda_allow(str(bob.info().node_id))
        with running_agent(alice.home.path, Path(tmp) / "agent.log"):
            carried = Carried(bob, "alice", memory=size + MIB)
            device = carried.device
            try:
                calls, pings = [], []
                for _ in range(options.calls):  # alternately
                    sent = time.perf_counter()
                    device.device_count()
                    calls.append(time.perf_counter() - sent)
                    pings.append(carried.ping())
                ptr = device.alloc(size)
                data = bytes(size)
                up, down, bulk, small = [], [], [], []
                buffer = device.alloc(4096)
                chunk = bytes(4096)
                for run in range(options.repeat):
                    for first in (0, 1) if run % 2 == 0 else (1, 0):
                        if first == 0:
                            sent = time.perf_counter()
                            device.copy_to(ptr, data)
                            device.synchronize()
                            up.append(time.perf_counter() - sent)
                        else:
                            bulk.append(carried.bulk(size))
                    sent = time.perf_counter()
                    device.copy_from(ptr, size)
                    down.append(time.perf_counter() - sent)
                    sent = time.perf_counter()
                    for _ in range(options.small):
                        device.copy_to(buffer, chunk)
                    device.synchronize()
                    small.append(options.small / (time.perf_counter() - sent))
                device.free(ptr)
                device.free(buffer)
                n = size // 12  # three f32 vectors in the session's memory
                vectors = [device.alloc(n * 4) for _ in range(3)]
                device.copy_to(vectors[0], bytes(n * 4))
                device.copy_to(vectors[1], bytes(n * 4))
                sent = time.perf_counter()
                device.launch(
                    VADD_PTX, VADD_F32, grid=(n + 255) // 256, block=256, args=(*vectors, n)
                )
                device.synchronize()
                vadd = time.perf_counter() - sent
                [session] = cuda_sessions(alice.home)
                peak = _peak_rss(session.pid)
            finally:
                carried.close()
    call_ms, ping_ms = statistics.median(calls) * 1e3, statistics.median(pings) * 1e3
    up_mb = size / statistics.median(up) / 1e6
    down_mb = size / statistics.median(down) / 1e6
    bulk_mb = size / statistics.median(bulk) / 1e6
    print(f"CUDA remoting on loopback ({device.backend}: {device.name})")
    print_rows(
        ["measure", "CUDA", "same session", "ratio", "goal"],
        [
            [
                "call round trip p50",
                f"{call_ms:.3f} ms",
                f"{ping_ms:.3f} ms (Ping)",
                f"{call_ms / ping_ms:.2f}x",
                "<= 1.5x",
            ],
            [
                f"host->device {options.size} MiB",
                f"{up_mb:,.0f} MB/s",
                f"{bulk_mb:,.0f} MB/s (bulk)",
                f"{up_mb / bulk_mb:.2f}x",
                ">= 0.8x",
            ],
            [
                f"device->host {options.size} MiB",
                f"{down_mb:,.0f} MB/s",
                f"{bulk_mb:,.0f} MB/s (bulk)",
                f"{down_mb / bulk_mb:.2f}x",
                "",
            ],
            ["4 KiB copies", f"{statistics.median(small):,.0f}/s", "", "", ""],
            [
                f"vector add {n * 4 // MIB} MiB x3",
                f"{vadd:.2f} s",
                f"{n / vadd / 1e6:,.1f} M elements/s",
                "",
                "",
            ],
            [
                "worker peak RSS",
                f"{peak / MIB:,.0f} MiB",
                f"session {(size + MIB) // MIB} MiB",
                f"{peak / (size + MIB):.2f}x",
                f"<= {(size + MIB + HEADROOM) // MIB} MiB",
            ],
        ],
    )
    return 0


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(interrupted())
