"""Peak memory of ``gpumesh cp`` as the file grows: it should not grow with the file.

Copies are streamed in pieces (4 MiB, a few in flight), so what each process
holds should be the same for a 256 MiB file as for a 4 GiB one. This script
measures that, on this machine, for every process a copy goes through:

* the provider: a ``gpumesh share`` process (separate, as a user runs it);
* the consumer, as users get it: the home's background node process, which
  does the copy, and the short ``gpumesh cp`` CLI process that asks it to;
* the consumer in-process, for comparison: a ``python -c`` script that makes
  the same copy with ``gpumesh.Mesh(in_process=True).cp`` (no node process:
  the script's process does it all).

Each is measured uploading (``gpumesh cp FILE alice:/NAME``) and downloading
(``gpumesh cp alice:/NAME FILE``) over the data channel (TLS on TCP, the
default) and over QUIC (``--no-fast-path``; the in-process script, which has
no such option, gets ``data_channel = off`` in bob's config for its QUIC
copies, restored after each), for each ``--sizes`` (default
256 MiB and 1 GiB; ``--big`` adds 4 GiB). Files and homes live on tmpfs
(``/dev/shm``), so no disk speed is in the way; each copy is checked (size,
``resumed_from == 0``) and removed before the next.

How peaks are read: every copy gets a new ``share`` process and a new node
process (after one ``gpumesh connect``, or for the in-process script one
``Node.connect`` in a process of its own, so their start is not in the figure),
so a copy's peak is its own and not what an earlier, larger copy left in the
allocator. For these processes the kernel's high-water mark (``VmHWM`` in ``/proc/PID/status``) is
reset just before each copy (writing ``5`` to ``/proc/PID/clear_refs``, which
needs the process's owner or root) and read just after; where that reset is
refused, the sampled peak instead. A CLI or script process's peak is its
``ru_maxrss`` from ``wait4``. Every process that moves the bytes is also sampled (RSS every
20 ms), and for the largest size the peak of the copy's first half is shown
beside its second half's: memory that grows with the bytes moved shows there
as a higher second half, whatever the start-up cost. Reading a file does not map it, so
the figures are the processes' own memory, not the page cache.

What is printed: per process, direction and path, the peak in MB at each
size, and the growth from the smallest size to the largest (MB per GiB of
file). "Flat" means a growth under 16 MB from the smallest to the largest
size (a few pieces' worth: allocator noise, not the file).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _benchlib import (
    IN_PROCESS_CONNECT,
    IN_PROCESS_CP,
    exit_cleanly_on_sigterm,
    interrupted,
    print_rows,
    source_note,
)
from bulk import gpumesh_command, make_nodes, parse_size, running_agent, write_source
from gpumesh.control.views import NodeProcessView
from gpumesh.daemon.client import NodeClient, connect, stop
from gpumesh.store.config import Config

MIB = 1024 * 1024
GIB = 1024 * MIB
FLAT_MB = 16.0
"""A growth from the smallest to the largest size under this many MB counts as flat."""
COPY_TIMEOUT = 900.0
SAMPLE_EVERY = 0.02

SHARE = "provider (gpumesh share)"
NODE = "consumer node process"
CLI_NODE = "consumer CLI (via node)"
ALONE = "consumer Mesh(in_process=True).cp"


def status_kb(pid: int, name: str) -> int:
    """One ``/proc/PID/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return int(value.split()[0])
    raise RuntimeError(f"no {name} for pid {pid}")


def reset_peak(pid: int) -> bool:
    """Set ``pid``'s VmHWM back to its current RSS; False where the kernel refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class Peaks:
    """The peak resident memory of processes over one copy, and its course.

    Long-lived processes' peaks come from the kernel (VmHWM, reset when this
    starts); every process is also sampled (RSS every ``SAMPLE_EVERY``), so the
    peak of the copy's first half can be set beside its second half's: memory
    that grows with the bytes moved shows as a higher second half.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.reset = all(reset_peak(pid) for pid in pids)
        self.samples: dict[int, list[tuple[float, int]]] = {pid: [] for pid in pids}
        self.began = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> None:
        """Sample ``pid`` too from now on (a process started after this)."""
        self.samples.setdefault(pid, [])

    def _sample(self) -> None:
        while not self._done.wait(SAMPLE_EVERY):
            for pid, samples in list(self.samples.items()):
                with contextlib.suppress(OSError, RuntimeError):
                    samples.append((time.monotonic(), status_kb(pid, "VmRSS")))

    def finish(self) -> tuple[dict[int, int], dict[int, tuple[int, int]]]:
        """Peak KiB per long-lived pid; per sampled pid, its peak KiB in the first and
        in the second half of the time since this started."""
        self._done.set()
        self._thread.join()
        middle = (self.began + time.monotonic()) / 2
        halves = {}
        for pid, samples in self.samples.items():
            first = [kib for at, kib in samples if at < middle]
            second = [kib for at, kib in samples if at >= middle]
            if first and second:
                halves[pid] = (max(first), max(second))
        if self.reset:
            peaks = {pid: status_kb(pid, "VmHWM") for pid in self.pids}
        else:
            peaks = {pid: max(kib for _, kib in self.samples[pid]) for pid in self.pids}
        return peaks, halves


def run_cli(
    command: list[str], env: dict[str, str], started: Callable[[int], None] = lambda _pid: None
) -> tuple[str, int]:
    """(stdout, peak RSS in KiB) of one CLI process, which must exit 0; ``started``
    gets its pid."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        started(proc.pid)
        deadline = time.monotonic() + COPY_TIMEOUT
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{' '.join(command)} did not finish in {COPY_TIMEOUT:g} s")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed (exit {proc.returncode}): "
                f"{err.read().decode(errors='replace').strip()}"
            )
        return out.read().decode(), usage.ru_maxrss


@dataclass
class Figures:
    """Peak KiB per (process, direction, path) per size."""

    peaks: dict[tuple[str, str, str], dict[int, int]] = field(default_factory=dict)
    channels: set[str] = field(default_factory=set)
    reset: bool = True
    halves: dict[tuple[str, str, str, int], tuple[int, int] | None] = field(default_factory=dict)
    """Sampled peak KiB in the first and the second half of each copy."""

    def add(self, process: str, direction: str, path: str, size: int, kib: int) -> None:
        self.peaks.setdefault((process, direction, path), {})[size] = kib


@dataclass
class Setup:
    tmp: Path
    sandbox: Path
    env: dict[str, str]


@contextlib.contextmanager
def fresh_processes(s: Setup, alone: bool) -> Iterator[tuple[int, int | None]]:
    """A new ``gpumesh share`` process, and unless ``alone`` a new node process for
    bob: (share pid, node pid). Fresh for each copy, so each peak is that copy's
    alone, not what an earlier, larger one left in the allocator."""
    with running_agent(s.tmp / "a", s.tmp / "agent.log") as agent:
        if alone:
            yield agent.pid, None
            return
        client = connect(s.tmp / "b")
        try:
            yield agent.pid, node_pid(client)
        finally:
            stop(s.tmp / "b", client)


def copy_once(
    s: Setup, figures: Figures, source: Path, size: int, direction: str, quic: bool, alone: bool
) -> None:
    """One copy (upload of ``source``, or download of what the upload left), its peaks noted."""
    name = "copy.bin"
    flags = ["--json", "--no-fast-path"] if quic else ["--json"]
    down = s.tmp / "down.bin"
    ends = (
        (str(source), f"alice:/{name}") if direction == "upload" else (f"alice:/{name}", str(down))
    )
    if alone:
        command = [sys.executable, "-c", IN_PROCESS_CP, *ends]
        warm_up = [sys.executable, "-c", IN_PROCESS_CONNECT, "alice"]
    else:
        command = [*gpumesh_command(), "cp", *flags, *ends]
        warm_up = [*gpumesh_command(), "connect", "alice"]
    with (
        fresh_processes(s, alone) as (share_pid, node),
        data_channel_off(s.tmp / "b", alone and quic),
    ):
        # One small request first, so the peak is the copy's and not the start's.
        run_cli(warm_up, s.env)
        pids = [share_pid] if node is None else [share_pid, node]
        peaks = Peaks(pids)
        cli: list[int] = []

        def started(pid: int) -> None:
            cli.append(pid)
            if node is None:  # the script does the copy itself
                peaks.watch(pid)

        out, cli_kib = run_cli(command, s.env, started)
        held, halves = peaks.finish()
    figures.reset = figures.reset and peaks.reset
    result = json.loads(out)
    if result.get("resumed_from", 0) != 0:
        raise RuntimeError(f"gpumesh cp resumed instead of copying from scratch: {result}")
    arrived = (s.sandbox / name) if direction == "upload" else down
    if arrived.stat().st_size != size:
        raise RuntimeError(f"{direction}: {arrived.stat().st_size} bytes arrived, not {size}")
    figures.channels.add(f"{'QUIC asked' if quic else 'default'}: {result.get('channel')}")
    path = "QUIC" if quic else "channel"
    figures.add(SHARE, direction, path, size, held[share_pid])
    figures.halves[(SHARE, direction, path, size)] = halves.get(share_pid)
    if node is None:
        figures.add(ALONE, direction, path, size, cli_kib)
        figures.halves[(ALONE, direction, path, size)] = halves.get(cli[0])
    else:
        figures.add(NODE, direction, path, size, held[node])
        figures.halves[(NODE, direction, path, size)] = halves.get(node)
        figures.add(CLI_NODE, direction, path, size, cli_kib)
    down.unlink(missing_ok=True)


@contextlib.contextmanager
def homes(parent: Path | None) -> Iterator[Setup]:
    with tempfile.TemporaryDirectory(prefix="cpmem-", dir=parent) as name:
        tmp = Path(name)
        alice, bob = make_nodes(tmp, free_udp_port())
        sandbox = tmp / "a" / "files" / str(bob.info().node_id)
        alice.close()
        bob.close()
        env = dict(os.environ, GPUMESH_HOME=str(tmp / "b"))
        env.pop("GPUMESH_LOG", None)
        yield Setup(tmp=tmp, sandbox=sandbox, env=env)


@contextlib.contextmanager
def data_channel_off(home: Path, off: bool) -> Iterator[None]:
    """With ``off``, ``data_channel = off`` in ``home``'s config until the block ends
    (what ``cp --no-fast-path`` asks for one copy), then the file as it was."""
    if not off:
        yield
        return
    path = home / "config.toml"
    before = path.read_bytes()
    config = Config.load(path)
    config.set("data_channel", "off")
    config.save()
    try:
        yield
    finally:
        path.write_bytes(before)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def node_pid(client: NodeClient) -> int:
    return client.call("GET", "/api/v1/node", NodeProcessView).pid


def measure(args: argparse.Namespace) -> Figures:
    figures = Figures()
    parent = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with homes(parent) as s:
        source = s.tmp / "source.bin"
        for size in args.sizes:
            print(f"  {size / MIB:g} MiB: writing the file...", flush=True)
            write_source(source, size)
            for quic in (False, True):
                for alone in (False, True):
                    for direction in ("upload", "download"):
                        began = time.perf_counter()
                        copy_once(s, figures, source, size, direction, quic, alone)
                        print(
                            f"    {direction:<8} {'QUIC' if quic else 'channel':<7} "
                            f"{'in-process' if alone else 'via node':<10} "
                            f"{time.perf_counter() - began:5.1f} s (with the processes' start)",
                            flush=True,
                        )
            source.unlink()
            (s.sandbox / "copy.bin").unlink(missing_ok=True)
    return figures


def report(args: argparse.Namespace, figures: Figures) -> None:
    sizes = list(args.sizes)
    low, high = sizes[0], sizes[-1]
    span_gib = (high - low) / GIB
    rows = []
    worst = 0.0
    for (process, direction, path), peaks in figures.peaks.items():
        grew = (peaks[high] - peaks[low]) / 1024
        worst = max(worst, grew)
        per_gib = f"{grew / span_gib:+.1f}" if span_gib > 0 else "-"
        rows.append(
            [f"{process}, {direction}, {path}"]
            + [f"{peaks[size] / 1024:.1f}" for size in sizes]
            + [f"{grew:+.1f}", per_gib]
        )
    how = (
        "VmHWM reset before each copy"
        if figures.reset
        else "RSS sampled (the kernel refused a VmHWM reset)"
    )
    print(f"\nPeak resident memory per copy, MB ({how}; CLI and script: ru_maxrss)")
    print_rows(
        ["process, direction, path", *[f"{size / MIB:g} MiB" for size in sizes],
         "growth", "per GiB"],
        rows,
    )  # fmt: skip
    print(f"  paths taken: {'; '.join(sorted(figures.channels))}")
    halves = []
    for (process, direction, path), _peaks in figures.peaks.items():
        pair = figures.halves.get((process, direction, path, high))
        if pair is not None:
            first, second = pair
            halves.append(
                [f"{process}, {direction}, {path}", f"{first / 1024:.1f}",
                 f"{second / 1024:.1f}", f"{(second - first) / 1024:+.1f}"]
            )  # fmt: skip
    if halves:
        print(
            f"\nThe {high / MIB:g} MiB copy's course: RSS sampled every "
            f"{SAMPLE_EVERY * 1000:g} ms, peak of each half of the copy, MB"
        )
        print_rows(["process, direction, path", "1st half", "2nd half", "change"], halves)
    if len(sizes) > 1:
        verdict = "flat" if worst < FLAT_MB else "GROWS with file size"
        print(
            f"  largest growth {low / MIB:g} -> {high / MIB:g} MiB: {worst:+.1f} MB "
            f"(flat: under {FLAT_MB:g} MB): {verdict}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Peak memory of `gpumesh cp` (provider, consumer node process, CLI; "
        "Mesh(in_process=True).cp for comparison) at growing file sizes, both directions, "
        "data channel and QUIC.",
    )
    parser.add_argument(
        "--sizes",
        type=lambda text: [parse_size(part) for part in text.split(",")],
        default=[256 * MIB, GIB],
        help="file sizes, comma-separated (default 256M,1G)",
    )
    parser.add_argument("--big", action="store_true", help="add a 4 GiB file (tmpfs space!)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16M and 64M")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes = [16 * MIB, 64 * MIB]
    if args.big:
        args.sizes.append(4 * GIB)
    args.sizes = sorted(set(args.sizes))
    if not args.sizes or args.sizes[0] < 1:
        parser.error("--sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    print(
        "Copying " + ", ".join(f"{size / MIB:g} MiB" for size in args.sizes)
        + " up and down, data channel and QUIC, via the node process and in-process...",
        flush=True,
    )  # fmt: skip
    try:
        figures = measure(args)
    except KeyboardInterrupt:
        return interrupted()
    report(args, figures)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
