"""Helpers shared by the benchmark scripts: summaries, ports, printing.

Benchmarks report medians and tail percentiles of many runs, measured side by
side with the tool a user would otherwise use, never a single timing.
"""

from __future__ import annotations

import signal
import socket
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "IN_PROCESS_CONNECT",
    "IN_PROCESS_CP",
    "IN_PROCESS_RUN",
    "Summary",
    "ensure_bytecode",
    "exit_cleanly_on_sigterm",
    "free_port",
    "interrupted",
    "print_rows",
    "source_note",
    "summarize",
]


_LOGGING = (
    "import os\n"
    "if os.environ.get('GPUMESH_LOG'):\n"
    "    from gpumesh.cli._common import setup_logging\n"
    "    setup_logging(None)\n"
)
"""Console logging at ``$GPUMESH_LOG``, as a CLI command sets it up (only when it is set:
the CLI's helpers then cost no time in the figures)."""

IN_PROCESS_CP = (
    "import sys\n"
    "import gpumesh\n"
    "from gpumesh.client.views import to_json\n"
    + _LOGGING
    + "with gpumesh.Mesh(in_process=True) as mesh:\n"
    "    print(to_json(mesh.cp(sys.argv[1], sys.argv[2])))\n"
)
"""``python -c IN_PROCESS_CP SOURCE DESTINATION``: the copy ``gpumesh cp --json SOURCE
DESTINATION`` makes, with ``gpumesh.Mesh(in_process=True).cp`` in the script's own
process ($GPUMESH_HOME's home, no node process: it dials for itself); it prints the
same JSON."""

IN_PROCESS_RUN = (
    "import json\n"
    "import sys\n"
    "import gpumesh\n" + _LOGGING + "peer, options, *command = sys.argv[1:]\n"
    "with gpumesh.Mesh(in_process=True) as mesh:\n"
    "    job = mesh.run(peer, command, **json.loads(options))\n"
    "    for line in job.logs(stderr=False):\n"
    "        print(line, flush=True)\n"
    "    result = job.wait()\n"
    "sys.exit(0 if result.state == 'succeeded' else result.exit_code or 1)\n"
)
"""``python -c IN_PROCESS_RUN PEER OPTIONS COMMAND...``: the job ``gpumesh run --peer PEER
... -- COMMAND...`` runs, with ``gpumesh.Mesh(in_process=True).run`` in the script's own
process ($GPUMESH_HOME's home, no node process: it dials and uploads for itself).
OPTIONS: ``Mesh.run``'s keyword arguments as a JSON object (``{"image": "IMG"}``). It
prints the job's stdout as it comes and exits with the job's exit status."""

IN_PROCESS_CONNECT = (
    "import asyncio\n"
    "import json\n"
    "import sys\n"
    "import gpumesh\n" + _LOGGING + "node = gpumesh.Node()\n"
    "try:\n"
    "    done = asyncio.run(node.connect(sys.argv[1], fresh=True))\n"
    "finally:\n"
    "    node.close()\n"
    "print(json.dumps({'path': done.path, 'connect_ms': done.connect_ms}))\n"
)
"""``python -c IN_PROCESS_CONNECT PEER``: one new dial to PEER from the script's own
process ($GPUMESH_HOME's home, no node process), with ``Node.connect``; it prints the
session's ``path`` and ``connect_ms`` as JSON."""


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


def source_note() -> str | None:
    """A warning when the gpumesh being measured is not this checkout's ``src/``.

    A non-editable ``pip install .`` leaves a copy in the environment that
    later edits do not reach; figures would then describe that copy.
    """
    import gpumesh

    measured = Path(gpumesh.__file__).resolve().parent
    checkout = Path(__file__).resolve().parent.parent / "src" / "gpumesh"
    if not checkout.is_dir() or measured == checkout.resolve():
        return None
    return (
        f"note: measuring the gpumesh installed at {measured}, not this checkout's src/; "
        "`pip install -e .` makes the figures follow your edits"
    )


def ensure_bytecode() -> None:
    """Compile gpumesh's modules once, as an installed package has them.

    Scripts that time whole CLI processes call this first: where
    ``PYTHONDONTWRITEBYTECODE`` is set, every process would otherwise compile
    each edited module again, and that would be measured as GPUMesh's start-up.
    """
    import compileall

    import gpumesh

    compileall.compile_dir(Path(gpumesh.__file__).parent, quiet=1)


def interrupted() -> int:
    """What a script's ``main`` returns after Ctrl-C, once everything is cleaned up."""
    print("interrupted", file=sys.stderr)
    return 130


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so ``finally`` blocks still stop what we started."""

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
