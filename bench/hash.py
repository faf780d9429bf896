"""Hashing throughput: SHA-256 (what copies used) next to BLAKE3 (what they use now).

Every copy hashes each byte on both ends, beside the threads that read, encrypt
and write it; this prints how fast each algorithm goes on this machine, in one
run, as medians of ``--repeat`` rounds (the algorithms alternate within each
round), and the ratio to SHA-256:

* ``sha256``: ``hashlib.sha256`` (OpenSSL; SHA-NI where the CPU has it);
* ``blake3``: ``blake3.blake3()`` with one thread, as transfers use it;
* ``blake3 max_threads``: ``blake3.blake3(max_threads=AUTO)``, all cores.

Buffers are fed in the piece sizes transfers use (1 MiB on QUIC, 4 MiB on the
data channel), from memory, so only the hashing is timed. The same is then
measured with one other core kept busy (a thread hashing with SHA-256 all the
while, standing in for TLS and the disk), which is what a copy leaves a
hasher on a 2-core machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable

from blake3 import blake3

from _benchlib import interrupted, print_rows, summarize

MIB = 1024 * 1024


def _hashers() -> dict[str, Callable[[], object]]:
    return {
        "sha256": hashlib.sha256,
        "blake3": lambda: blake3(max_threads=1),
        "blake3 max_threads": lambda: blake3(max_threads=blake3.AUTO),
    }


def _rate(make: Callable[[], object], buffer: bytes, total: int) -> float:
    """MB/s of one hasher fed ``buffer`` until ``total`` bytes went through."""
    hasher = make()
    update = hasher.update  # type: ignore[attr-defined]
    rounds = max(1, total // len(buffer))
    started = time.perf_counter()
    for _ in range(rounds):
        update(buffer)
    hasher.digest()  # type: ignore[attr-defined]
    return rounds * len(buffer) / (time.perf_counter() - started) / 1e6


class _Busy:
    """One thread keeping a core busy (SHA-256 over a buffer, GIL released) until stopped."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        buffer = os.urandom(4 * MIB)
        while not self._stop.is_set():
            hashlib.sha256(buffer)

    def __enter__(self) -> _Busy:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(total: int, repeat: int, busy: bool) -> dict[tuple[str, int], list[float]]:
    rates: dict[tuple[str, int], list[float]] = {}
    buffers = {size: os.urandom(size) for size in (MIB, 4 * MIB)}
    hashers = _hashers()
    with _Busy() if busy else _NoLoad():
        for _ in range(repeat):
            for size, buffer in buffers.items():
                for name, make in hashers.items():
                    rates.setdefault((name, size), []).append(_rate(make, buffer, total))
    return rates


class _NoLoad:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: object) -> None:
        return None


def report(title: str, rates: dict[tuple[str, int], list[float]]) -> None:
    print(title)
    rows = []
    for size in (MIB, 4 * MIB):
        base = summarize(rates[("sha256", size)]).p50
        for name in _hashers():
            median = summarize(rates[(name, size)]).p50
            rows.append([name, f"{size // MIB} MiB", f"{median:,.0f}", f"{median / base:.2f}x"])
    print_rows(["algorithm", "piece", "MB/s (median)", "vs sha256"], rows)
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=512, help="MiB hashed per measurement")
    parser.add_argument("--repeat", type=int, default=5, help="rounds (medians are printed)")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    total = (64 if args.quick else args.size) * MIB
    repeat = 1 if args.quick else args.repeat
    print(
        f"hashing {total // MIB} MiB per measurement, {repeat} rounds, "
        f"{os.cpu_count()} cores, from memory"
    )
    print()
    try:
        report("idle machine:", measure(total, repeat, busy=False))
        report("one other core busy (as during a copy):", measure(total, repeat, busy=True))
    except KeyboardInterrupt:
        return interrupted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
