"""Bulk transfer over one authenticated GPUMesh connection, next to scp.

What is measured: the wall time to push ``--size`` bytes (default 256 MiB) to
a peer on this machine, as MB/s (10^6 bytes per second), the median of
``--repeat`` runs of each tool, taken alternately (GPUMesh first on even runs,
scp first on odd ones) so the noise of this shared machine hits both alike.

* GPUMesh: ``Node.throughput(peer, size)`` from this process to a provider
  agent running as a separate ``gpumesh share`` process (so the two ends do
  not share one CPU core and one event loop, as they would not in real use).
  It dials, proves both identities, then sends the bytes over one QUIC stream
  with GPUMesh's own flow control; the agent reads and discards them. The
  timed span covers the whole call, connection set-up included. The figure
  GPUMesh itself reports (stream only, set-up excluded) is shown next to it.
* scp: what a user would otherwise run, ``scp FILE host:PATH`` against a
  throwaway OpenSSH server on 127.0.0.1 (bench/sshd.sh, default ciphers). The
  timed span covers the whole process: start, SSH handshake, transfer, exit.
  The source file and the destination live on tmpfs (``/dev/shm`` when it
  exists), so no disk is involved; scp still writes the bytes to memory where
  GPUMesh's test discards them on receipt, a small advantage to GPUMesh.

If sshd or scp cannot be set up, the script says why and still reports
GPUMesh's figure. Everything (agent, sshd, files) is removed on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _benchlib import (
    Summary,
    exit_cleanly_on_sigterm,
    free_port,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from gpumesh.client.node import Node
from gpumesh.protocol.messages import MAX_THROUGHPUT_TEST

LOOPBACK = "127.0.0.1"
MIB = 1024 * 1024
BENCH_DIR = Path(__file__).resolve().parent
TRANSFER_TIMEOUT = 600.0
AGENT_START_TIMEOUT = 20.0


@dataclass
class Results:
    gpumesh_wall: list[float] = field(default_factory=list)
    """MB/s over the whole ``Node.throughput`` call."""
    gpumesh_stream: list[float] = field(default_factory=list)
    """MB/s as GPUMesh reports it (stream only)."""
    scp_wall: list[float] = field(default_factory=list)
    scp_note: str | None = None


# --- set-up and tear-down ----------------------------------------------------------------


def gpumesh_command() -> list[str]:
    """The ``gpumesh`` console script of this interpreter's environment."""
    script = Path(sys.prefix) / "bin" / "gpumesh"
    if script.exists():
        return [str(script)]
    found = shutil.which("gpumesh")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from gpumesh.cli.main import main; sys.exit(main())"]


def make_nodes(
    tmp: Path, port: int, host: str = LOOPBACK, consumer: Path | None = None
) -> tuple[Node, Node]:
    """alice (provider, listening on host:port) and bob (his home ``consumer``, by
    default beside hers), paired both ways."""
    alice = Node(tmp / "a")
    alice.init("alice")
    config = alice.home.config
    config.set("listen_host", host)
    config.set("listen_port", str(port))
    config.save()
    alice.home.reload_config()
    bob = Node(consumer or tmp / "b")
    bob.init("bob")
    bob.pair(alice.pairing_code())
    alice.pair(bob.pairing_code())
    return alice, bob


@contextlib.contextmanager
def running_agent(
    home: Path, log: Path, wrap: Sequence[str] = ()
) -> Iterator[subprocess.Popen[bytes]]:
    """``gpumesh share`` for ``home`` in its own process, until the block ends.

    ``wrap`` goes before the command and must exec it (e.g. ``ip netns exec NS``).
    This version shares from the home's node process, which the command starts
    (inside ``wrap`` too); a ``--baseline`` of an earlier version shares the way
    that version's ``gpumesh share`` does by default.
    """
    env = dict(os.environ, GPUMESH_HOME=str(home))
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*wrap, *gpumesh_command(), "share"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # Every version says its pairing code once it serves (this one from its node
        # process, which a SIGTERM to the command stops sharing).
        deadline = time.monotonic() + AGENT_START_TIMEOUT
        while b"Pairing code" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"`gpumesh share` did not start; its output:\n{log.read_text().strip()}"
                )
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def loopback_sshd(
    state: Path, address: str = LOOPBACK, wrap: Sequence[str] = (), port: int | None = None
) -> Iterator[tuple[list[str] | None, str | None]]:
    """(scp options, None) with a throwaway sshd running, or (None, why not).

    ``address`` and ``wrap`` put it elsewhere, e.g. in a network namespace
    (``wrap`` then needs ``port``: a free port here may not be free there).
    """
    script = BENCH_DIR / "sshd.sh"
    if shutil.which("scp") is None:
        yield None, "scp is not installed"
        return
    started = False
    try:
        result = subprocess.run(
            [*wrap, "bash", str(script), "start", str(state), str(port or free_port())],
            env=dict(os.environ, SSHD_ADDRESS=address),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        started = result.returncode == 0
        if not started:
            reason = result.stderr.strip().splitlines()[-1:] or [f"exit {result.returncode}"]
            yield None, f"bench/sshd.sh could not start sshd: {reason[0]}"
            return
        yield shlex.split(result.stdout.strip()), None
    finally:
        if state.exists():
            subprocess.run(
                ["bash", str(script), "stop", str(state)],
                capture_output=True,
                timeout=60,
                check=False,
            )


def write_source(path: Path, size: int) -> None:
    """Incompressible bytes, so nothing on the way can shrink them."""
    chunk = os.urandom(MIB)
    with path.open("wb") as out:
        remaining = size
        while remaining:
            part = min(remaining, len(chunk))
            out.write(chunk[:part])
            remaining -= part


# --- the transfers ---------------------------------------------------------------------------


async def gpumesh_once(node: Node, size: int) -> tuple[float, float]:
    """(wall MB/s, stream MB/s) of one throughput test to alice."""
    started = time.perf_counter()
    result = await asyncio.wait_for(node.throughput("alice", size), TRANSFER_TIMEOUT)
    wall = time.perf_counter() - started
    return size / wall / 1e6, result.mb_per_s


async def scp_once(options: list[str], source: Path, target: Path, size: int) -> float:
    """Wall MB/s of one ``scp`` of ``source`` to ``target`` over the loopback sshd."""
    command = ["scp", "-q", *options, str(source), f"bench:{target}"]
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), TRANSFER_TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"scp failed (exit {proc.returncode}): {err.decode().strip()}")
    check_copy(target, size)
    return size / wall / 1e6


def check_copy(target: Path, size: int) -> None:
    """Check that scp delivered every byte, then free the tmpfs space."""
    copied = target.stat().st_size
    target.unlink()
    if copied != size:
        raise RuntimeError(f"scp copied {copied} of {size} bytes")


async def transfers(
    args: argparse.Namespace, bob: Node, scp_options: list[str] | None, shm: Path
) -> Results:
    results = Results()
    source, target = shm / "source.bin", shm / "target.bin"
    if scp_options is not None:
        write_source(source, args.size)
        # Untimed warm-up of both: first-use costs, page cache, binaries.
        await scp_once(scp_options, source, target, args.size)
    await gpumesh_once(bob, min(args.size, 4 * MIB))
    for index in range(args.repeat):
        order = ("gpumesh", "scp") if index % 2 == 0 else ("scp", "gpumesh")
        for kind in order:
            if kind == "gpumesh":
                wall, stream = await gpumesh_once(bob, args.size)
                results.gpumesh_wall.append(wall)
                results.gpumesh_stream.append(stream)
                print(f"  run {index + 1}: GPUMesh {wall:8.1f} MB/s", flush=True)
            elif scp_options is not None:
                wall = await scp_once(scp_options, source, target, args.size)
                results.scp_wall.append(wall)
                print(f"  run {index + 1}: scp     {wall:8.1f} MB/s", flush=True)
    return results


# --- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> Results:
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpumesh-bench-")))
        shm_parent = "/dev/shm" if Path("/dev/shm").is_dir() else None
        shm = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=shm_parent)))
        alice, bob = make_nodes(tmp, free_port(kind=socket.SOCK_DGRAM))
        stack.callback(bob.close)
        alice.close()  # the agent process owns alice's home from here on
        stack.enter_context(running_agent(tmp / "a", tmp / "agent.log"))
        scp_options: list[str] | None = None
        note: str | None = "skipped (--no-scp)"
        if not args.no_scp:
            scp_options, note = stack.enter_context(loopback_sshd(tmp / "ssh"))
        print(
            f"Pushing {args.size / MIB:g} MiB, {_runs(args.repeat)} of each, alternating...",
            flush=True,
        )
        results = asyncio.run(transfers(args, bob, scp_options, shm))
        results.scp_note = note
        return results


def _runs(count: int) -> str:
    return f"{count} run" if count == 1 else f"{count} runs"


def _figures(summary: Summary) -> list[str]:
    return [f"{summary.p50:.1f}", f"{summary.low:.1f}", f"{summary.high:.1f}"]


def report(args: argparse.Namespace, results: Results) -> None:
    wall = summarize(results.gpumesh_wall)
    stream = summarize(results.gpumesh_stream)
    rows = [
        ["GPUMesh, whole call (dial + proof + push)", *_figures(wall)],
        ["  as GPUMesh reports it (stream only)", *_figures(stream)],
    ]
    scp = summarize(results.scp_wall) if results.scp_wall else None
    if scp is not None:
        rows.append(["scp over loopback sshd, whole process", *_figures(scp)])
    print(
        f"\nBulk push of {args.size / MIB:g} MiB over loopback, {_runs(wall.n)} of each; "
        "MB/s = 10^6 bytes/s"
    )
    print_rows(["", "median MB/s", "min", "max"], rows)
    if scp is not None:
        print(f"  ratio GPUMesh / scp (medians, whole call): {wall.p50 / scp.p50:.2f}x")
        print("  note: GPUMesh's test discards bytes on receipt; scp writes them to tmpfs")
    else:
        print(f"  scp: {results.scp_note}; no ratio")


def parse_size(text: str) -> int:
    units = {"k": 1024, "m": MIB, "g": 1024 * MIB}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    factor = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        return int(float(number) * factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 256M, 1G)") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Push bytes over one authenticated GPUMesh connection to a separate "
        "`gpumesh share` process, next to scp over a loopback sshd, in one run.",
    )
    parser.add_argument(
        "--size", type=parse_size, default=256 * MIB, help="bytes per transfer (default 256M)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tool (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16M, 1 run of each")
    parser.add_argument("--no-scp", action="store_true", help="measure GPUMesh only")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeat = 16 * MIB, 1
    if not 0 < args.size <= MAX_THROUGHPUT_TEST:
        parser.error(f"--size must be from 1 byte to {MAX_THROUGHPUT_TEST // MIB} MiB")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    try:
        results = run(args)
    except KeyboardInterrupt:
        return interrupted()
    report(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
