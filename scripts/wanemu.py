#!/usr/bin/env python3
"""A user-space WAN link between two TUN devices: one-way delay and random loss.

Where the kernel has no ``netem``, this joins two network namespaces over a
link with a fixed one-way delay, seeded random loss and, optionally, a rate
limit with a bounded queue, separately in each direction. IP packets one
namespace sends into its TUN device are read here, held back (or dropped) and
written into the other namespace's TUN device. ``scripts/wanlab.sh`` builds
the namespaces and devices and runs this; see its header for the topology.

The scheduling is :class:`Direction`, a plain class that takes packets with
their arrival time and hands them back when due: no sockets, no clock, so it
is tested on its own (``tests/unit/test_wanemu.py``). :func:`pump` is the thin
I/O loop around two of them: it drains each device per wake-up (one packet
per ``read``, until the device is empty or a batch is done), then writes
whatever is due and sleeps in ``epoll`` until the next release.

Standard library only; Linux only (``/dev/net/tun``, ``setns``); needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import os
import random
import select
import signal
import struct
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Direction", "DirectionStats", "main", "open_tun", "pump"]

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
READ_SIZE = 65536
"""Larger than any packet a TUN device with a sane MTU hands over."""
BATCH = 256
"""Packets read from one device per wake-up before the other gets its turn."""
QUEUE_LIMIT = 64 << 20
"""Bytes one direction holds at most (delayed or waiting for the rate); past it, tail drop."""


@dataclass
class DirectionStats:
    """What one direction did with the packets offered to it."""

    offered: int = 0
    delivered: int = 0
    """Packets handed back by :meth:`Direction.release`."""
    lost: int = 0
    """Dropped at random (the configured loss)."""
    overflowed: int = 0
    """Dropped because the queue was full (only with a rate or a huge backlog)."""
    bytes_delivered: int = 0


class Direction:
    """One direction of the link, without I/O.

    A packet offered at ``now`` is lost with probability ``loss`` (drawn from
    ``rng``, so a seed replays the same losses), else released at ``now +
    delay``, or, with a ``rate`` in bytes/s, once the packets ahead of it have
    been serialised at that rate, plus ``delay``. Every packet waits the same
    delay, so release times are in arrival order and a deque is the schedule
    (no reordering; none is wanted: a WAN path rarely reorders).
    """

    def __init__(
        self,
        delay: float,
        loss: float,
        rng: random.Random,
        *,
        rate: float = 0.0,
        limit: int = QUEUE_LIMIT,
    ) -> None:
        if delay < 0:
            raise ValueError("delay must not be negative")
        if not 0.0 <= loss < 1.0:
            raise ValueError("loss must be from 0 up to (not including) 1")
        if rate < 0:
            raise ValueError("rate must not be negative")
        self.delay = delay
        self.loss = loss
        self.rate = rate
        self.limit = limit
        self.stats = DirectionStats()
        self._rng = rng
        self._queue: deque[tuple[float, bytes]] = deque()
        self._queued = 0
        self._free_at = 0.0
        """When the rate-limited wire is free for the next packet."""

    def offer(self, packet: bytes, now: float) -> bool:
        """Take a packet that arrived at ``now``; False when it is dropped."""
        self.stats.offered += 1
        if self.loss and self._rng.random() < self.loss:
            self.stats.lost += 1
            return False
        if self._queued + len(packet) > self.limit:
            self.stats.overflowed += 1
            return False
        if self.rate:
            self._free_at = max(now, self._free_at) + len(packet) / self.rate
            due = self._free_at + self.delay
        else:
            due = now + self.delay
        self._queue.append((due, packet))
        self._queued += len(packet)
        return True

    def next_due(self) -> float | None:
        """When the next packet is due (None: nothing is waiting)."""
        return self._queue[0][0] if self._queue else None

    def release(self, now: float) -> list[bytes]:
        """Every packet due by ``now``, in order."""
        queue = self._queue
        out: list[bytes] = []
        while queue and queue[0][0] <= now:
            out.append(queue.popleft()[1])
        if out:
            size = sum(len(packet) for packet in out)
            self._queued -= size
            self.stats.delivered += len(out)
            self.stats.bytes_delivered += size
        return out

    @property
    def queued(self) -> int:
        """Packets waiting."""
        return len(self._queue)


# --- I/O: TUN devices in network namespaces ----------------------------------------------


@contextlib.contextmanager
def in_netns(name: str | None) -> Iterator[None]:
    """Run the block in network namespace ``name`` (from ``ip netns``), then come back."""
    if name is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {name}: {os.strerror(err)}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back: {os.strerror(err)}")
    finally:
        os.close(own)


def open_tun(device: str, netns: str | None = None) -> int:
    """A non-blocking fd on TUN ``device`` (plain IP packets), created if missing."""
    with in_netns(netns):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
    return fd


def pump(fd_a: int, fd_b: int, a_to_b: Direction, b_to_a: Direction, stop: list[bool]) -> None:
    """Move packets between the devices through the two directions until ``stop[0]``."""
    poller = select.epoll()
    poller.register(fd_a, select.EPOLLIN)
    poller.register(fd_b, select.EPOLLIN)
    inbound = {fd_a: a_to_b, fd_b: b_to_a}
    outbound = ((a_to_b, fd_b), (b_to_a, fd_a))
    clock = time.monotonic
    read, write = os.read, os.write
    try:
        while not stop[0]:
            dues = [due for d, _ in outbound if (due := d.next_due()) is not None]
            timeout = max(0.0, min(dues) - clock()) if dues else 1.0
            try:
                events = poller.poll(min(timeout, 1.0))
            except InterruptedError:
                continue
            now = clock()
            for fd, _mask in events:
                direction = inbound[fd]
                for _ in range(BATCH):
                    try:
                        packet = read(fd, READ_SIZE)
                    except BlockingIOError:
                        break
                    direction.offer(packet, now)
            now = clock()
            for direction, fd in outbound:
                for packet in direction.release(now):
                    # A full receive queue in the namespace drops it, as a NIC would.
                    with contextlib.suppress(BlockingIOError):
                        write(fd, packet)
    finally:
        poller.close()


# --- command line ------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Join two TUN devices through a link with one-way delay and random loss."
    )
    parser.add_argument("--tun-a", default="wan", help="device on side A (default wan)")
    parser.add_argument("--tun-b", default="wan", help="device on side B (default wan)")
    parser.add_argument("--netns-a", help="network namespace of side A's device")
    parser.add_argument("--netns-b", help="network namespace of side B's device")
    parser.add_argument(
        "--delay", type=float, default=0.0, help="one-way delay in ms, each way (default 0)"
    )
    parser.add_argument(
        "--loss", type=float, default=0.0, help="random loss in percent, each way (default 0)"
    )
    parser.add_argument("--delay-ba", type=float, help="one-way delay B->A in ms (default --delay)")
    parser.add_argument("--loss-ba", type=float, help="loss B->A in percent (default --loss)")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="rate limit in Mbit/s, each way (0: none)"
    )
    parser.add_argument(
        "--queue", type=int, default=QUEUE_LIMIT, help="bytes queued per direction at most"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the loss draws (default 1)")
    return parser.parse_args(argv)


def directions(args: argparse.Namespace) -> tuple[Direction, Direction]:
    rate = args.rate * 1e6 / 8
    back_delay = args.delay if args.delay_ba is None else args.delay_ba
    back_loss = args.loss if args.loss_ba is None else args.loss_ba
    a_to_b = Direction(
        args.delay / 1000,
        args.loss / 100,
        random.Random(args.seed * 2),
        rate=rate,
        limit=args.queue,
    )
    b_to_a = Direction(
        back_delay / 1000,
        back_loss / 100,
        random.Random(args.seed * 2 + 1),
        rate=rate,
        limit=args.queue,
    )
    return a_to_b, b_to_a


def _summary(name: str, direction: Direction) -> str:
    s = direction.stats
    return (
        f"{name}: {s.offered} packets, {s.delivered} delivered ({s.bytes_delivered} bytes), "
        f"{s.lost} lost at random, {s.overflowed} over the queue, {direction.queued} waiting"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        a_to_b, b_to_a = directions(args)
        fd_a = open_tun(args.tun_a, args.netns_a)
        fd_b = open_tun(args.tun_b, args.netns_b)
    except (OSError, ValueError) as exc:
        print(f"wanemu: {exc}", file=sys.stderr)
        return 1
    stop = [False]

    def stopping(_signum: int, _frame: object) -> None:
        stop[0] = True

    def report(_signum: int, _frame: object) -> None:
        print(_summary("A->B", a_to_b), file=sys.stderr, flush=True)
        print(_summary("B->A", b_to_a), file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGINT, stopping)
    signal.signal(signal.SIGUSR1, report)
    print(
        f"wanemu: ready: A->B {a_to_b.delay * 1000:g} ms, {a_to_b.loss * 100:g}% loss; "
        f"B->A {b_to_a.delay * 1000:g} ms, {b_to_a.loss * 100:g}% loss; "
        f"rate {args.rate:g} Mbit/s (0: none); seed {args.seed}",
        file=sys.stderr,
        flush=True,
    )
    try:
        pump(fd_a, fd_b, a_to_b, b_to_a, stop)
    finally:
        report(0, None)
        os.close(fd_a)
        os.close(fd_b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
