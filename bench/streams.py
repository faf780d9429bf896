"""What one peer can make a provider hold: the agent's memory (RSS) while one
connection parks as many streams as it is allowed.

A `gpumesh share` provider (alice) runs in its own process; bob, in this
process, dials it once and parks requests on that one connection, each of
one kind:

* ``downloads``: a download of a 64 MiB file in bob's folder there that never
  returns flow-control credit: the provider sends one window (8 MiB), reads
  ahead from the file and waits (bob drops what arrives, unread, so his own
  memory stays flat and no credit goes back);
* ``downloads+unread``: the same, then bob sends a window of bulk bytes on each
  stream that the provider's handler never reads (it is waiting to send);
* ``follows+unread`` (with Docker and the test image): ``gpumesh logs -f`` of a
  job of bob's that prints nothing, then a window of unread bytes on each.

bob tries ``--streams`` streams (default 64). Each kind runs twice: with the
provider's defaults (``max_requests_per_link`` 16, ``link_buffer`` 32MB) and
with both limits off (``0`` / ``none``: how the provider behaved before them).
Printed for each: the agent's RSS before (after one warm-up request), while
bob holds his streams, and after bob's connection closed (5 s later: the
endpoint keeps a closed link 3 s), with how many streams were refused and why.
RSS is read from /proc (Linux). It is a figure for people; the test suite
asserts the events (`tests/integration/test_peer_limits.py`). Freed memory is
not always returned to the system by the allocator, so "after" can stay above
"before" while the agent holds nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from _benchlib import exit_cleanly_on_sigterm, free_port, interrupted, print_rows, source_note
from bulk import make_nodes, running_agent
from dispatch import remove_containers
from gpumesh.client.jobs import cancel_job, run_job
from gpumesh.client.jobspec import JobSpec
from gpumesh.client.node import Node
from gpumesh.errors import GPUMeshError, LimitError, error_from_code
from gpumesh.protocol.flow import DEFAULT_WINDOW
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import FileGet, JobLogs, Ping, Refusal, decode_message
from gpumesh.runtime.base import LABEL_NODE
from gpumesh.store.home import Home
from gpumesh.transport.session import Session
from gpumesh.transport.stream import Stream

MIB = 1024 * 1024
FILE_SIZE = 64 * MIB
SETTLE = 1.0
"""Seconds the agent gets to reach a steady state before its RSS is read."""
AFTER_CLOSE = 5.0
"""Seconds after bob's connection closed before the last reading (the endpoint keeps
a closed link 3 s to retransmit its close)."""
LIMITS_OFF = {"max_requests_per_link": "0", "link_buffer": "none"}


def rss(pid: int) -> int:
    """Resident memory of a process, bytes (Linux /proc; else `ps`)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    out = subprocess.run(
        ["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, check=False
    )
    return int(out.stdout.strip() or 0) * 1024


def mib(size: int) -> str:
    return f"{size / MIB:.0f} MiB"


@dataclass
class Held:
    """What bob managed to park, and how he was refused."""

    parked: int = 0
    refused_requests: int = 0
    """Streams refused with max_requests_per_link."""
    refused_bytes: int = 0
    """Streams refused or reset over link_buffer."""
    unread_sent: int = 0
    """Bulk bytes bob sent that the provider's handlers never read."""


def _without_credit(stream: Stream) -> None:
    """bob reads nothing back: what arrives is dropped at once, and no credit returns."""
    stream._release = lambda _count: None  # type: ignore[method-assign]
    stream._frames.clear()
    stream._queued = 0

    def drop(data: bytes, end_stream: bool, feed: Callable[[bytes, bool], None]) -> None:
        feed(data, end_stream)
        stream._frames.clear()
        stream._queued = 0

    original = stream.feed
    stream.feed = lambda data, end_stream: drop(data, end_stream, original)  # type: ignore[method-assign]


async def _first_answer(stream: Stream) -> bool:
    """True when the request was taken (an answer or bulk data), False when refused
    with max_requests_per_link; other refusals are raised."""
    frame = await asyncio.wait_for(stream.read_frame(), 20)
    assert frame is not None and frame.kind is FrameKind.MESSAGE
    message = decode_message(frame.body)
    if isinstance(message, Refusal):
        error = error_from_code(message.code, message.message)
        if isinstance(error, LimitError) and "max_requests_per_link" in error.message:
            return False
        raise error
    return True


async def park(
    session: Session, opener: Callable[[Stream], None], count: int, unread: bool
) -> Held:
    held = Held()
    streams: list[Stream] = []
    for _ in range(count):
        stream = session.open_stream()
        opener(stream)
        # One at a time, so "refused" means the connection was full.
        if await _first_answer(stream):
            _without_credit(stream)
            streams.append(stream)
        else:
            held.refused_requests += 1
    held.parked = len(streams)
    if unread:
        for stream in streams:
            with contextlib.suppress(GPUMeshError, TimeoutError):
                await asyncio.wait_for(stream.send_data(b"u" * DEFAULT_WINDOW), 30)
    await asyncio.sleep(SETTLE)
    for stream in streams:
        # Refused over link_buffer: the provider answered and asked bob to stop sending
        # (bob dropped the answer unread) or reset the stream.
        if stream._send_error is not None or stream._error is not None:
            held.refused_bytes += 1
        elif unread:
            held.unread_sent += DEFAULT_WINDOW
    return held


@dataclass
class Row:
    kind: str
    limits: str
    held: Held
    before: int
    holding: int
    after: int


async def measure(
    bob: Node,
    pid: int,
    kind: str,
    limits: str,
    count: int,
    opener: Callable[[Stream], None],
    unread: bool,
) -> Row:
    async with bob.session("alice") as warm:
        await warm.request(Ping(sent=time.time()))
    await asyncio.sleep(SETTLE)
    before = rss(pid)
    async with bob.session("alice") as session:
        held = await park(session, opener, count, unread)
        holding = rss(pid)
    await asyncio.sleep(AFTER_CLOSE)
    return Row(kind, limits, held, before, holding, rss(pid))


def _download(stream: Stream) -> None:
    stream.send_message(FileGet(path="/big.bin", offset=0))


def docker_image_present(image: str) -> bool:
    if shutil.which("docker") is None:
        return False
    found = subprocess.run(
        ["docker", "image", "inspect", image], capture_output=True, timeout=60, check=False
    )
    return found.returncode == 0


async def with_job(bob: Node, image: str, body: Callable[[str], Awaitable[None]]) -> None:
    """Run ``body`` with the id of a silent job of bob's running on alice."""
    spec = JobSpec(
        image=image,
        command=["sleep", "3600"],
        env={},
        workdir=None,
        gpu_memory=0,
        retries=0,
        timeout=0.0,
        peer="alice",
        group=None,
    )
    job = await run_job(bob, spec, detach=True)
    try:
        await body(job.job_id)
    finally:
        with contextlib.suppress(GPUMeshError):
            await cancel_job(bob, "alice", job.job_id)


def _set_limits(home: Path, limits: str) -> None:
    config = Home(home)
    try:
        for key, value in LIMITS_OFF.items():
            if limits == "defaults":
                config.config.unset(key)
            else:
                config.config.set(key, value)
        config.config.save()
    finally:
        config.close()


def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as folder:
        tmp = Path(folder)
        alice, bob = make_nodes(tmp, free_port(kind=socket.SOCK_DGRAM))
        alice_id = str(alice.info().node_id)
        box = alice.home.path / "files" / str(bob.info().node_id)
        box.mkdir(parents=True, mode=0o700)
        (box / "big.bin").write_bytes(os.urandom(FILE_SIZE))
        alice.home.config.set("image", args.image)
        alice.home.config.save()
        alice.close()
        kinds = ["downloads", "downloads+unread"]
        if docker_image_present(args.image):
            kinds.append("follows+unread")
        else:
            print(f"note: no Docker or no image {args.image}: the follows are skipped")
        try:
            for kind in kinds:
                for limits in ("defaults", "limits off"):
                    _set_limits(tmp / "a", limits)
                    # A fresh agent each time: its RSS only ever shows this run.
                    with running_agent(tmp / "a", tmp / f"agent-{len(rows)}.log") as agent:
                        row = asyncio.run(_one(bob, agent.pid, kind, limits, args))
                    print(
                        f"  {row.kind}, {row.limits}: {mib(row.before)} -> "
                        f"{mib(row.holding)} -> {mib(row.after)}"
                    )
                    rows.append(row)
        finally:
            bob.close()
            remove_containers(f"{LABEL_NODE}={alice_id}")
    return rows


async def _one(bob: Node, pid: int, kind: str, limits: str, args: argparse.Namespace) -> Row:
    count = args.streams
    if kind == "downloads":
        return await measure(bob, pid, kind, limits, count, _download, unread=False)
    if kind == "downloads+unread":
        return await measure(bob, pid, kind, limits, count, _download, unread=True)
    rows: list[Row] = []

    async def follow_all(job_id: str) -> None:
        def open_follow(stream: Stream) -> None:
            stream.send_message(JobLogs(job_id=job_id, after_seq=0, follow=True))

        rows.append(await measure(bob, pid, kind, limits, count, open_follow, unread=True))

    await with_job(bob, args.image, follow_all)
    return rows[0]


def report(args: argparse.Namespace, rows: list[Row]) -> None:
    print(
        f"\nagent RSS, one connection of bob's trying to park {args.streams} streams "
        f"(each a {mib(DEFAULT_WINDOW)} window)"
    )
    table = []
    for row in rows:
        held = row.held
        refusals = []
        if held.refused_requests:
            refusals.append(f"{held.refused_requests} max_requests_per_link")
        if held.refused_bytes:
            refusals.append(f"{held.refused_bytes} link_buffer")
        table.append(
            [
                row.kind,
                row.limits,
                str(held.parked),
                ", ".join(refusals) or "none",
                mib(held.unread_sent),
                mib(row.before),
                mib(row.holding),
                mib(row.after),
            ]
        )
    print_rows(
        ["streams", "provider", "parked", "refused", "unread sent", "before", "holding", "after"],
        table,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--streams", type=int, default=64, help="streams bob tries to park (default 64)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 streams")
    parser.add_argument(
        "--image",
        default=os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1"),
        help="image of the silent job the follows watch (default the offline test image)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.streams = 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    try:
        rows = run(args)
    except KeyboardInterrupt:
        return interrupted()
    report(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
