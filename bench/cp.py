"""`gpumesh cp` of a 1 GiB file to a peer, next to scp of the same file, in one run.

What is measured: the wall time of copying ``--size`` bytes (default 1 GiB)
to a peer on this machine, as MB/s (10^6 bytes per second), the median of
``--repeat`` runs of each tool, taken alternately (GPUMesh first on even runs,
scp first on odd ones) so the noise of this shared machine hits both alike.

* GPUMesh: ``gpumesh cp FILE alice:/copy.bin`` as a new CLI process each time,
  to a provider running as a separate ``gpumesh share`` process. The timed
  span covers the whole process: start, hashing the file (SHA-256, sent ahead
  in ``FilePut``), dialling and the identity proof, the transfer, the
  provider's hash check and rename, exit. The figure ``cp`` itself reports
  (``--json``: whole call, without interpreter start) is shown next to it.
* scp: ``scp FILE host:PATH`` against a throwaway OpenSSH server on 127.0.0.1
  (bench/sshd.sh, default ciphers), whole process too.

Source and destinations live on tmpfs (``/dev/shm`` when it exists): the
provider's home (where its sandbox is) and scp's target alike, so no disk is
involved on either side. Each copy is checked (size; GPUMesh checks SHA-256
itself) and removed before the next. If sshd or scp cannot be set up, the
script says why and still reports GPUMesh's figure. Everything (agent, sshd,
files) is removed on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _benchlib import (
    exit_cleanly_on_sigterm,
    free_port,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from bulk import (
    TRANSFER_TIMEOUT,
    gpumesh_command,
    loopback_sshd,
    make_nodes,
    parse_size,
    running_agent,
    scp_once,
    write_source,
)

MIB = 1024 * 1024
GOAL = 1.2
"""GPUMesh's median should be at least this many times scp's."""


@dataclass
class Results:
    gpumesh_wall: list[float] = field(default_factory=list)
    """MB/s of the whole ``gpumesh cp`` process."""
    gpumesh_reported: list[float] = field(default_factory=list)
    """MB/s as ``gpumesh cp --json`` reports it (whole call, no interpreter start)."""
    scp_wall: list[float] = field(default_factory=list)
    scp_note: str | None = None


async def cp_once(bob_home: Path, source: Path, copied: Path, size: int) -> tuple[float, float]:
    """(wall MB/s, reported MB/s) of one ``gpumesh cp`` of ``source`` to alice."""
    env = dict(os.environ, GPUMESH_HOME=str(bob_home))
    env.pop("GPUMESH_LOG", None)
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *gpumesh_command(),
        "cp",
        "--json",
        str(source),
        "alice:/copy.bin",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TRANSFER_TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"gpumesh cp failed (exit {proc.returncode}): {err.decode().strip()}")
    result = json.loads(out)
    check_copied(copied, size, result)
    return size / wall / 1e6, float(result["mb_per_s"])


def check_copied(copied: Path, size: int, result: dict[str, object]) -> None:
    """Check that the whole file arrived, sent from scratch, then free the tmpfs space."""
    arrived = copied.stat().st_size
    copied.unlink()
    if arrived != size or result["resumed_from"] != 0:
        raise RuntimeError(f"gpumesh cp did not copy all {size} bytes from scratch: {result}")


async def transfers(
    args: argparse.Namespace, tmp: Path, scp_options: list[str] | None, sandbox: Path
) -> Results:
    results = Results()
    source, target = tmp / "source.bin", tmp / "scp-target.bin"
    copied = sandbox / "copy.bin"
    write_source(source, args.size)
    # Untimed warm-up of both: first-use costs, page cache, binaries.
    if scp_options is not None:
        await scp_once(scp_options, source, target, args.size)
    await cp_once(tmp / "b", source, copied, args.size)
    for index in range(args.repeat):
        order = ("gpumesh", "scp") if index % 2 == 0 else ("scp", "gpumesh")
        for kind in order:
            if kind == "gpumesh":
                wall, reported = await cp_once(tmp / "b", source, copied, args.size)
                results.gpumesh_wall.append(wall)
                results.gpumesh_reported.append(reported)
                print(f"  run {index + 1}: gpumesh cp {wall:8.1f} MB/s", flush=True)
            elif scp_options is not None:
                wall = await scp_once(scp_options, source, target, args.size)
                results.scp_wall.append(wall)
                print(f"  run {index + 1}: scp        {wall:8.1f} MB/s", flush=True)
    return results


def run(args: argparse.Namespace) -> Results:
    with contextlib.ExitStack() as stack:
        shm_parent = "/dev/shm" if Path("/dev/shm").is_dir() else None
        tmp = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="gpumesh-cp-", dir=shm_parent))
        )
        alice, bob = make_nodes(tmp, free_port(kind=socket.SOCK_DGRAM))
        sandbox = tmp / "a" / "files" / str(bob.info().node_id)
        bob.close()
        alice.close()  # the agent process owns alice's home from here on
        stack.enter_context(running_agent(tmp / "a", tmp / "agent.log"))
        scp_options, note = (None, "skipped (--no-scp)")
        if not args.no_scp:
            scp_options, note = stack.enter_context(loopback_sshd(tmp / "ssh"))
        print(
            f"Copying {args.size / MIB:g} MiB, {_runs(args.repeat)} of each, alternating...",
            flush=True,
        )
        results = asyncio.run(transfers(args, tmp, scp_options, sandbox))
        results.scp_note = note
        return results


def _runs(count: int) -> str:
    return f"{count} run" if count == 1 else f"{count} runs"


def report(args: argparse.Namespace, results: Results) -> None:
    wall = summarize(results.gpumesh_wall)

    def figures(values: list[float]) -> list[str]:
        summary = summarize(values)
        return [f"{summary.p50:.1f}", f"{summary.low:.1f}", f"{summary.high:.1f}"]

    rows = [
        ["gpumesh cp, whole process", *figures(results.gpumesh_wall)],
        ["  as cp reports it (no interpreter start)", *figures(results.gpumesh_reported)],
    ]
    if results.scp_wall:
        rows.append(["scp over loopback sshd, whole process", *figures(results.scp_wall)])
    print(
        f"\nCopy of {args.size / MIB:g} MiB to a peer over loopback, {_runs(wall.n)} of each; "
        "MB/s = 10^6 bytes/s"
    )
    print_rows(["", "median MB/s", "min", "max"], rows)
    if results.scp_wall:
        ratio = wall.p50 / summarize(results.scp_wall).p50
        verdict = "met" if ratio >= GOAL else "NOT met"
        print(f"  ratio gpumesh cp / scp (medians, whole process): {ratio:.2f}x")
        print(f"  goal: >= {GOAL}x scp: {verdict}")
    else:
        print(f"  scp: {results.scp_note}; no ratio")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="`gpumesh cp` of a file to a separate `gpumesh share` process, next to "
        "scp over a loopback sshd, in one run.",
    )
    parser.add_argument(
        "--size", type=parse_size, default=1024 * MIB, help="bytes per copy (default 1G)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tool (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 32M, 1 run of each")
    parser.add_argument("--no-scp", action="store_true", help="measure GPUMesh only")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeat = 32 * MIB, 1
    if args.size < 1:
        parser.error("--size must be at least 1 byte")
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
