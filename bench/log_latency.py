"""Live log latency: a line printed in a job's container, until the user's terminal has it.

What is measured: for each line a container prints, the time from just
before the container writes it to when the reading process's output reaches
this script's pipe. Four paths, each reading a container of its own that runs
the same shell loop:

* ``gpumesh run --peer alice ...``: the job's output streamed live by the
  submitting CLI (a provider running as a separate ``gpumesh share`` process
  on this machine, as in bench/dispatch.py);
* ``gpumesh logs -f ID`` for a job started with ``gpumesh run --detach``;
* ``docker run`` (attached) and ``docker logs -f ID`` of a detached
  ``docker run -d``, the same container run locally: the baselines.

How the time is taken: the container and this script share one kernel and so
one wall clock (``CLOCK_REALTIME``; Docker gives containers no time
namespace). Before each line the container reads it with ``busybox adjtimex``
(the kernel's time in microseconds; busybox ``date`` has no sub-second
format, ``/proc/uptime`` only ticks every 10 ms, and ``ts`` buffers its output
when it goes to a pipe) and prints it in the line. This script reads each
reader's stdout unbuffered in a thread and notes ``time.time()`` when a line's
last byte arrives. The difference is the latency, with microsecond resolution,
but it overstates it by the time between the container reading the clock and
writing the line (a process exit and a shell builtin): the container also
reads the clock right after each write and reports it in the next line, and
the stamp-to-next-stamp gap, an upper bound of that error, is printed with
the figures. A negative latency (clocks that differ, e.g. a remote Docker)
stops the script.

Lines go out ``--interval`` seconds apart (default 0.1 s), so each is a
separate event, not part of a burst. Each container first sleeps 1 s and
prints one warm-up line that is never counted, so that a follower (``logs
-f``) is attached before the counted lines start; a line counts only if it was
stamped after its reader had received the warm-up line, so replayed history
(a follower that attached late) is left out and its count is shown. The four
paths take turns, ``--rounds`` containers each, the order rotating every
round; figures are p50 and p90 over all counted lines of a path.

The first line of each container (the warm-up line, printed ``LEAD_IN``
seconds after the container started, when the reader is attached) is shown
apart: the latency of a job's first output, which for GPUMesh includes the
provider's first look at the container's log and, for ``logs -f``, the node
process's event stream (``/api/v1/jobs/ID/events``) starting to carry it. A
follower that attached only after that line was written would show its
lateness here instead; the lead-in makes that unlikely.

For GPUMesh, the provider's event log also records when it stored each line,
so its latency splits into "container to the provider's event log" (Docker's
log pipeline, the Engine API, one SQLite transaction) and "event log to CLI
output" (QUIC to the client, the client's own store update, its write).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _benchlib import (
    exit_cleanly_on_sigterm,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from dispatch import DEFAULT_IMAGE, PEER, Provider, docker_ready, local_provider, remove_containers

LEAD_IN = 1.0
PREFIX = "gpumesh-bench"
BENCH_LABEL = "gpumesh-bench"

GPUMESH_RUN = "gpumesh run"
GPUMESH_LOGS = "gpumesh logs -f"
DOCKER_RUN = "docker run (attached)"
DOCKER_LOGS = "docker logs -f"
PATHS = (GPUMESH_RUN, GPUMESH_LOGS, DOCKER_RUN, DOCKER_LOGS)
BASELINE = DOCKER_LOGS

# Each line: PREFIX, its number, the clock before it (s, us), the clock after the
# previous line (s, us). The last line, "end", carries the clock after line N.
CONTAINER_SCRIPT = """\
stamp() {{
  set -- $(busybox adjtimex)
  while [ $# -gt 0 ]; do
    case $1 in time.tv_sec:) s=$2 ;; time.tv_usec:) u=$2 ;; status:) st=$2 ;; esac
    shift
  done
  # A kernel in nanosecond mode (STA_NANO, 0x2000) gives nanoseconds in tv_usec.
  [ $(( ${{st:-0}} & 8192 )) -eq 0 ] || u=$(( u / 1000 ))
}}
s=; stamp
[ -n "$s" ] || {{ echo "{prefix}: busybox adjtimex gave no time" >&2; exit 3; }}
sleep {lead}
stamp; echo "{prefix} 0 $s $u - -"; stamp; bs=$s; bu=$u
i=0
while [ $i -lt {lines} ]; do
  sleep {interval}
  i=$((i + 1))
  stamp; echo "{prefix} $i $s $u $bs $bu"; stamp; bs=$s; bu=$u
done
echo "{prefix} end - - $bs $bu"
"""


def container_script(lines: int, interval: float) -> str:
    return CONTAINER_SCRIPT.format(prefix=PREFIX, lead=LEAD_IN, lines=lines, interval=interval)


# --- reading a process's output, timestamped --------------------------------------------


class TimedReader(threading.Thread):
    """Reads a pipe unbuffered; notes ``time.time()`` when each line's last byte arrives."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.lines: list[tuple[float, bytes]] = []

    def run(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # closed under us: the run is being abandoned
                return
            if not chunk:
                break
            now = time.time()
            pending += chunk
            *complete, pending = pending.split(b"\n")
            self.lines.extend((now, line) for line in complete)
        if pending:
            self.lines.append((time.time(), pending))


@dataclass
class Reading:
    """What one reader showed of one container."""

    stamped: dict[int, float]
    """Line number to the container's clock just before it printed the line."""
    received: dict[int, float]
    gaps: list[float]
    """Container clock: after a line's write minus before it (upper bound of the error)."""


@contextlib.contextmanager
def spawned(command: Sequence[str], env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A process whose stdout is a raw pipe; killed if still running when the block ends."""
    proc = subprocess.Popen(
        list(command),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def read_lines(
    name: str, command: Sequence[str], env: dict[str, str], lines: int, timeout: float
) -> Reading:
    """Run a reader to its end; check its exit status and every line it printed."""
    with spawned(command, env) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        reader = TimedReader(proc.stdout.fileno())
        reader.start()
        errors: list[bytes] = []
        drain = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)
        drain.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(
                f"{name}: `{_short(command)}` still running after {timeout:.0f}s"
            ) from None
        reader.join(timeout=10)
        drain.join(timeout=10)
    stderr = b"".join(errors).decode(errors="replace").strip()
    if code != 0:
        raise SystemExit(
            f"{name}: `{_short(command)}` failed (exit {code})\n  stderr: {stderr or '(nothing)'}"
        )
    return parse_lines(name, reader.lines, lines, stderr)


LINE = re.compile(rf"^{PREFIX} (\d+|end) (\d+|-) (\d+|-) (\d+|-) (\d+|-)$")


def parse_lines(name: str, received: list[tuple[float, bytes]], lines: int, stderr: str) -> Reading:
    """Lines 0 to ``lines``, then "end", each exactly once and in order, and nothing else."""
    reading = Reading({}, {}, [])
    expected = 0
    ended = False
    for arrived, raw in received:
        text = raw.decode(errors="replace")
        found = LINE.match(text)
        number = found.group(1) if found is not None else None
        in_order = number == str(expected) or (number == "end" and expected > 0)
        if found is None or ended or not in_order:
            raise SystemExit(
                f"{name}: unexpected output line {text!r} (expected line {expected})"
                f"\n  stderr: {stderr or '(nothing)'}"
            )
        _, sec, usec, after_sec, after_usec = found.groups()
        if expected > 0:
            if not (after_sec.isdigit() and after_usec.isdigit()):
                raise SystemExit(f"{name}: line {text!r} lacks the previous line's clock")
            after = float(after_sec) + int(after_usec) / 1e6
            reading.gaps.append(after - reading.stamped[expected - 1])
        if number == "end":
            ended = True
            continue
        if not (sec.isdigit() and usec.isdigit()):
            raise SystemExit(f"{name}: line {text!r} lacks the container's clock")
        reading.stamped[expected] = float(sec) + int(usec) / 1e6
        reading.received[expected] = arrived
        expected += 1
    if not ended or expected != lines + 1:
        raise SystemExit(
            f"{name}: expected lines 0 to {lines} and an end line; got {expected} numbered "
            f"line(s){'' if ended else ' and no end'}\n  stderr: {stderr or '(nothing)'}"
        )
    return reading


def _short(command: Sequence[str]) -> str:
    text = shlex.join(command)
    return text if len(text) < 120 else text[:117] + "..."


# --- the four paths ------------------------------------------------------------------------


@dataclass
class Sample:
    """Counted lines of one container: latencies, and for GPUMesh the two legs."""

    latencies: list[float] = field(default_factory=list)
    to_store: list[float] = field(default_factory=list)
    from_store: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    replayed: int = 0
    first: list[float] = field(default_factory=list)
    """The warm-up line's latency: the container's first line of output."""


def counted(reading: Reading, stored: dict[int, float] | None = None) -> Sample:
    """The lines stamped after the reader had the warm-up line; latencies checked >= 0."""
    sample = Sample(gaps=list(reading.gaps))
    live_from = reading.received[0]
    sample.first.append(max(0.0, live_from - reading.stamped[0]))
    for number, stamp in reading.stamped.items():
        if number == 0:
            continue
        if stamp <= live_from:
            sample.replayed += 1
            continue
        latency = reading.received[number] - stamp
        if latency < 0:
            raise SystemExit(
                f"line {number} arrived {-latency * 1e3:.3f} ms before the container stamped "
                "it: the container's clock is not this machine's (remote Docker?)"
            )
        sample.latencies.append(latency)
        if stored is not None and number in stored:
            sample.to_store.append(stored[number] - stamp)
            sample.from_store.append(reading.received[number] - stored[number])
    return sample


def stored_times(provider: Provider, job_id: str) -> dict[int, float]:
    """Line number to when the provider stored it in the job's event log."""
    _, events = provider.hosted(job_id)
    times: dict[int, float] = {}
    for stored, data in events:
        for raw in data.split(b"\n"):
            found = LINE.match(raw.decode(errors="replace"))
            if found is not None and found.group(1).isdigit():
                times.setdefault(int(found.group(1)), stored)
    return times


class Runner:
    """Runs one container per call on a path, all from one set-up."""

    def __init__(self, args: argparse.Namespace, provider: Provider, label: str) -> None:
        self.args = args
        self.provider = provider
        self.label = label
        self.env = provider.env

    def timeout(self, lines: int) -> float:
        return 120.0 + LEAD_IN + lines * (self.args.interval + 0.05) * 3

    def once(self, path: str, lines: int) -> Sample:
        script = ["sh", "-c", container_script(lines, self.args.interval)]
        image = self.args.image
        timeout = self.timeout(lines)
        gpumesh = self.provider.gpumesh
        if path == GPUMESH_RUN:
            command = gpumesh("run", "--peer", PEER, "--image", image, "--", *script)
            reading = read_lines(path, command, self.env, lines, timeout)
            job_id = self.provider.submitted().job_id
            return counted(reading, stored_times(self.provider, job_id))
        if path == GPUMESH_LOGS:
            detach = gpumesh("run", "--peer", PEER, "--image", image, "--detach", "--", *script)
            job_id = self._start(path, detach)
            follow = gpumesh("logs", "-f", job_id)
            reading = read_lines(path, follow, self.env, lines, timeout)
            return counted(reading, stored_times(self.provider, job_id))
        labelled = ["--label", self.label, image, *script]
        if path == DOCKER_RUN:
            attached = ["docker", "run", "--rm", *labelled]
            return counted(read_lines(path, attached, self.env, lines, timeout))
        container = self._start(path, ["docker", "run", "-d", *labelled])
        try:
            follow = ["docker", "logs", "-f", container]
            reading = read_lines(path, follow, self.env, lines, timeout)
            waited = self._output(path, ["docker", "wait", container])
            if waited != "0":
                raise SystemExit(f"{path}: the container exited with {waited}")
        finally:
            subprocess.run(
                ["docker", "rm", "-f", container], capture_output=True, timeout=60, check=False
            )
        return counted(reading)

    def _start(self, path: str, command: list[str]) -> str:
        """Run a detaching command; its one line of output is the id it started."""
        started = self._output(path, command)
        if not re.fullmatch(r"[0-9a-f]{8,64}", started):
            raise SystemExit(f"{path}: `{_short(command)}` printed {started!r}, not an id")
        return started

    def _output(self, path: str, command: list[str]) -> str:
        result = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=120, check=False
        )
        if result.returncode != 0:
            raise SystemExit(
                f"{path}: `{_short(command)}` failed (exit {result.returncode}): "
                f"{result.stderr.strip()}"
            )
        return result.stdout.strip()


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, list[Sample]]:
    docker_ready(args.image)
    label = f"{BENCH_LABEL}={secrets.token_hex(6)}"
    samples: dict[str, list[Sample]] = {path: [] for path in PATHS}
    try:
        with local_provider(tmp) as provider:
            runner = Runner(args, provider, label)
            per_round = math.ceil(args.lines / args.rounds)
            print(
                f"Following {per_round} lines per container, {args.interval:g} s apart, "
                f"{args.rounds} round(s) of {', '.join(PATHS)}...",
                flush=True,
            )
            for index in range(args.rounds):
                shift = index % len(PATHS)
                for path in PATHS[shift:] + PATHS[:shift]:
                    samples[path].append(runner.once(path, per_round))
    finally:
        remove_containers(label)
    return samples


# --- the report --------------------------------------------------------------------------


def _row(name: str, values: list[float], versus: str = "") -> list[str]:
    summary = summarize(values)
    return [
        name,
        f"{summary.p50 * 1e3:.2f}",
        f"{summary.p90 * 1e3:.2f}",
        f"{summary.high * 1e3:.2f}",
        str(summary.n),
        versus,
    ]


def report(args: argparse.Namespace, samples: dict[str, list[Sample]]) -> None:
    def merged(path: str, part: str) -> list[float]:
        return list(itertools.chain.from_iterable(getattr(s, part) for s in samples[path]))

    for path in PATHS:
        if not merged(path, "latencies"):
            raise SystemExit(f"{path}: no line was received live (all replayed)")
    baseline = summarize(merged(BASELINE, "latencies"))
    print(
        f"\nLive log latency, container's write to the reader's output on our pipe; "
        f"{args.rounds} round(s), lines {args.interval:g} s apart"
    )
    rows = []
    for path in PATHS:
        latencies = merged(path, "latencies")
        rows.append(_row(path, latencies, f"{summarize(latencies).p50 / baseline.p50:.2f}x"))
        if merged(path, "to_store"):
            rows.append(_row("  container -> provider's event log", merged(path, "to_store")))
            rows.append(_row("  event log -> CLI output", merged(path, "from_store")))
    print_rows(["", "p50 ms", "p90 ms", "max ms", "lines", f"p50 vs {BASELINE}"], rows)
    gaps = summarize(list(itertools.chain.from_iterable(merged(path, "gaps") for path in PATHS)))
    fastest = min(min(merged(path, "latencies")) for path in PATHS)
    print(
        "  resolution: clocks are one kernel's, in microseconds; each figure overstates by the\n"
        "  time from the container's stamp to its write, at most its stamp-to-next-stamp gap\n"
        f"  (p50 {gaps.p50 * 1e3:.2f} ms, p90 {gaps.p90 * 1e3:.2f} ms), and in practice less: "
        f"the fastest line of all took {fastest * 1e3:.2f} ms"
    )
    first = summarize(merged(BASELINE, "first"))
    print(
        f"\nFirst line of each container (printed {LEAD_IN:g} s after it started, the reader "
        "attached meanwhile), write to the reader's output"
    )
    rows = [
        _row(
            path, merged(path, "first"), f"{summarize(merged(path, 'first')).p50 / first.p50:.2f}x"
        )
        for path in PATHS
    ]
    print_rows(["", "p50 ms", "p90 ms", "max ms", "lines", f"p50 vs {BASELINE}"], rows)
    replayed = {path: sum(s.replayed for s in samples[path]) for path in PATHS}
    if any(replayed.values()):
        shown = ", ".join(f"{path}: {n}" for path, n in replayed.items() if n)
        print(f"  not counted, stamped before the reader was live (replayed history): {shown}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time a container's output lines to `gpumesh run` and `gpumesh logs -f` "
        "(local `gpumesh share` provider) next to `docker run` and `docker logs -f`, "
        "in one run; p50 and p90 per path.",
    )
    parser.add_argument("--lines", type=int, default=50, help="counted lines per path (default 50)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="containers per path, lines split (default 2)"
    )
    parser.add_argument(
        "--interval", type=float, default=0.1, help="seconds between lines (default 0.1)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 lines, 1 round")
    parser.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help=f"image with a static busybox (default {DEFAULT_IMAGE})",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.lines, args.rounds = 10, 1
    if args.rounds < 1 or args.lines < args.rounds * 2:
        parser.error("--rounds must be at least 1, and --lines at least 2 per round")
    if not 0.01 <= args.interval <= 10:
        parser.error("--interval must be from 0.01 to 10 seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as tmp:
            samples = measure(args, Path(tmp))
    except KeyboardInterrupt:
        return interrupted()
    report(args, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
