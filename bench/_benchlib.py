"""Helpers shared by the benchmark scripts: summaries, ports, printing.

Benchmarks report medians and tail percentiles of many runs, measured side by
side with the tool a user would otherwise use, never a single timing.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Summary", "free_port", "print_rows", "summarize"]


@dataclass(frozen=True)
class Summary:
    """Median and 90th percentile of a sample, plus its size and range."""

    n: int
    p50: float
    p90: float
    low: float
    high: float


def summarize(samples: Sequence[float]) -> Summary:
    """Summarize at least one sample; p90 interpolates between the closest ranks."""
    if not samples:
        raise ValueError("no samples to summarize")
    ordered = sorted(samples)
    if len(ordered) > 1:
        p90 = statistics.quantiles(ordered, n=10, method="inclusive")[8]
    else:
        p90 = ordered[0]
    return Summary(
        n=len(ordered),
        p50=statistics.median(ordered),
        p90=p90,
        low=ordered[0],
        high=ordered[-1],
    )


def free_port(kind: int = socket.SOCK_STREAM, host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (another process could still take it)."""
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def print_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a plain, left-aligned table (first column) with right-aligned figures."""
    table = [list(header), *[list(row) for row in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for index, row in enumerate(table):
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        print("  " + "  ".join(cells).rstrip())
        if index == 0:
            print("  " + "  ".join("-" * width for width in widths))
