"""What authenticating FEC frames costs per frame, next to what the codec cost before.

Every FEC frame carries a GMAC tag and a group id that is a keyed permutation of the
group's sequence number (``protocol/fec.py``, :class:`~gpumesh.protocol.fec.Sealer`).
This prints, as medians of ``--repeat`` rounds (the rows alternate within each
round), in nanoseconds per frame:

* ``codec, send + receive``: ``Encoder.encode`` and ``Decoder.receive`` of groups of
  16 datagrams of ``--size`` bytes plus their two parities, no loss: what each frame
  costs the two ends in all, tag and permutation included;
* ``tag (sender)``: ``Sealer.tag`` alone, what a sender adds per frame;
* ``check (receiver)``: ``Sealer.check`` of an authentic frame, what a receiver adds;
* ``group id (per frame)``: ``Sealer.group_id``, once per group, spread over its 18
  frames;
* ``forged frame dropped``: ``Decoder.receive`` of a forged frame with a random group
  id (the id inverted, the tag checked and refused): what each forgery costs;
* ``codec before the tag``: the first row less the tag, check and group id rows,
  that is what the codec cost per frame without authentication.

Goal: what authentication adds per frame at either end <= 2000 ns.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import time
from collections.abc import Callable

from _benchlib import interrupted, print_rows, summarize
from gpumesh.protocol import fec

GROUP = fec.GROUP_SIZE
FRAMES_PER_GROUP = GROUP + 2


def _codec(size: int, groups: int) -> Callable[[], float]:
    keys = fec.FecKeys.derive(os.urandom(32), from_client=True)
    datagrams = [os.urandom(size) for _ in range(GROUP)]

    def run() -> float:
        encoder, decoder = fec.Encoder(keys), fec.Decoder(keys)
        start = time.perf_counter_ns()
        frames = 0
        for _ in range(groups):
            for frame in encoder.encode(datagrams, 0.0):
                decoder.receive(frame, 0.0)
                frames += 1
        return (time.perf_counter_ns() - start) / frames

    return run


def _tag(size: int, count: int) -> Callable[[], float]:
    sealer = fec.Sealer(fec.FecKeys.derive(os.urandom(32), from_client=True))
    body = struct.pack("!BIB", fec.DATA, 1, 0) + os.urandom(size)

    def run() -> float:
        start = time.perf_counter_ns()
        for seq in range(count):
            sealer.tag(seq, body)
        return (time.perf_counter_ns() - start) / count

    return run


def _check(size: int, count: int) -> Callable[[], float]:
    sealer = fec.Sealer(fec.FecKeys.derive(os.urandom(32), from_client=True))
    frame = sealer.tag(7, struct.pack("!BIB", fec.DATA, 1, 0) + os.urandom(size))

    def run() -> float:
        start = time.perf_counter_ns()
        for _ in range(count):
            if not sealer.check(7, frame):
                raise SystemExit("an authentic frame failed its check")
        return (time.perf_counter_ns() - start) / count

    return run


def _group_id(count: int) -> Callable[[], float]:
    sealer = fec.Sealer(fec.FecKeys.derive(os.urandom(32), from_client=True))

    def run() -> float:
        start = time.perf_counter_ns()
        for seq in range(count):
            sealer.group_id(seq)
        return (time.perf_counter_ns() - start) / count / FRAMES_PER_GROUP

    return run


def _forged(size: int, count: int) -> Callable[[], float]:
    keys = fec.FecKeys.derive(os.urandom(32), from_client=True)
    forged = [
        struct.pack("!BIB", fec.DATA, int.from_bytes(os.urandom(4), "big"), 0)
        + os.urandom(size + fec.TAG)
        for _ in range(count)
    ]

    def run() -> float:
        decoder = fec.Decoder(keys)
        start = time.perf_counter_ns()
        for frame in forged:
            decoder.receive(frame, 0.0)
        elapsed = (time.perf_counter_ns() - start) / count
        if decoder.counters.forged != count:
            raise SystemExit("a forged frame was not refused")
        return elapsed

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1400, help="datagram bytes (1400)")
    parser.add_argument("--repeat", type=int, default=7, help="rounds (7)")
    parser.add_argument("--count", type=int, default=20_000, help="frames per round (20000)")
    args = parser.parse_args()
    groups = max(1, args.count // FRAMES_PER_GROUP)
    rows: dict[str, Callable[[], float]] = {
        "codec, send + receive": _codec(args.size, groups),
        "tag (sender)": _tag(args.size, args.count),
        "check (receiver)": _check(args.size, args.count),
        "group id (per frame)": _group_id(max(1, args.count // 10)),
        "forged frame dropped": _forged(args.size, args.count),
    }
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeat):
        for name, run in rows.items():
            samples[name].append(run())
    p50 = {name: summarize(values).p50 for name, values in samples.items()}
    added = p50["tag (sender)"] + p50["check (receiver)"] + p50["group id (per frame)"]
    table = [
        [name, f"{summarize(values).p50:,.0f}", f"{summarize(values).p90:,.0f}"]
        for name, values in samples.items()
    ]
    table.append(["codec before the tag", f"{p50['codec, send + receive'] - added:,.0f}", ""])
    print(f"FEC frame authentication, {args.size}-byte datagrams, {args.repeat} rounds")
    print_rows(["ns per frame", "p50", "p90"], table)
    sender = p50["tag (sender)"] + p50["group id (per frame)"]
    print(
        f"authentication adds {sender:,.0f} ns per frame to the sender and "
        f"{p50['check (receiver)']:,.0f} to the receiver (goal <= 2,000 each); "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(interrupted())
