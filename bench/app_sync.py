"""`gpumesh app sync` re-syncing a tree of 10,000 files (~1 GiB) after one changed,
next to `rsync -a` of the same tree over a loopback sshd, in one run.

What is measured, per re-sync (the median of ``--repeat`` runs, a different
file rewritten before each pair of runs, the two tools alternating first):

* GPUMesh: ``gpumesh app sync --json --dir TREE`` as a new CLI process each
  time, to a provider running as a separate ``gpumesh share`` process. The
  timed span is the whole process: start, the scan, the manifest (hashes come
  from the local cache, so only the changed file is read), the exchange with
  the provider (which checks its index by size and mtime), the tar of the
  changed file, exit. Bytes are those ``app sync`` reports it sent: the tar
  of the changed files plus the manifest: a delta against the manifest the
  provider confirmed last time (the whole list, about 100 bytes a file, only
  when the provider holds another one).
* rsync: ``rsync -a --delete --stats TREE/ host:DEST/`` over a throwaway
  OpenSSH server on 127.0.0.1 (bench/sshd.sh), whole process; bytes are
  rsync's own "Total bytes sent" (file lists and checksums included).

The first sync of each tool is not part of the medians; GPUMesh's is
printed, and re-syncs are compared with it (goal: at most 0.1x its time and
bytes) and with rsync (goal: at most 0.5x its time). Everything lives on tmpfs
(``/dev/shm`` when it exists) and is removed on exit. If sshd or rsync cannot
be set up, the script says why and still reports GPUMesh's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _benchlib import (
    ensure_bytecode,
    exit_cleanly_on_sigterm,
    free_port,
    interrupted,
    print_rows,
    summarize,
)
from bulk import gpumesh_command, loopback_sshd, make_nodes, running_agent

TIMEOUT = 600.0
GOAL_OF_FIRST = 0.1
"""A re-sync should take at most this share of the first sync's time and bytes."""
GOAL_OF_RSYNC = 0.5
"""A re-sync should take at most this share of rsync's re-sync time."""


@dataclass
class Results:
    gpumesh_seconds: list[float] = field(default_factory=list)
    gpumesh_bytes: list[int] = field(default_factory=list)
    gpumesh_files: list[int] = field(default_factory=list)
    gpumesh_manifest: list[int] = field(default_factory=list)
    rsync_seconds: list[float] = field(default_factory=list)
    rsync_bytes: list[int] = field(default_factory=list)
    rsync_note: str | None = None
    first_seconds: float = 0.0
    first_bytes: int = 0
    manifest_kinds: list[str] = field(default_factory=list)


def make_tree(root: Path, count: int, size: int) -> None:
    """``count`` files of ``size`` random bytes, 100 to a folder."""
    for index in range(count):
        folder = root / f"d{index // 100:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{index:05d}.bin").write_bytes(os.urandom(size))


def change_one(root: Path, index: int, size: int) -> None:
    path = root / f"d{index // 100:03d}" / f"f{index:05d}.bin"
    path.write_bytes(os.urandom(size))


def app_sync(bob_home: Path, tree: Path) -> tuple[float, dict[str, object]]:
    """One ``app sync --json`` as a new process."""
    env = dict(os.environ, GPUMESH_HOME=str(bob_home))
    env.pop("GPUMESH_LOG", None)
    started = time.perf_counter()
    result = subprocess.run(
        [*gpumesh_command(), "app", "sync", "--peer", "alice", "--dir", str(tree), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"gpumesh app sync failed: {result.stderr.strip()}")
    data: dict[str, object] = json.loads(result.stdout)
    return seconds, data


def rsync_once(options: list[str], tree: Path, dest: Path) -> tuple[float, int]:
    shell = "ssh " + " ".join(options)
    started = time.perf_counter()
    result = subprocess.run(
        ["rsync", "-a", "--delete", "--stats", "-e", shell, f"{tree}/", f"bench:{dest}/"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"rsync failed: {result.stderr.strip()}")
    found = re.search(r"Total bytes sent: ([\d,.]+)", result.stdout)
    sent = int(re.sub(r"[,.]", "", found.group(1))) if found else -1
    return seconds, sent


def run(args: argparse.Namespace) -> Results:
    results = Results()
    with contextlib.ExitStack() as stack:
        shm_parent = "/dev/shm" if Path("/dev/shm").is_dir() else None
        tmp = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="gpumesh-app-", dir=shm_parent))
        )
        alice, bob = make_nodes(tmp, free_port(kind=socket.SOCK_DGRAM))
        bob.close()
        alice.close()
        tree = tmp / "tree"
        print(f"Making {args.files} files of {args.file_size} bytes...", flush=True)
        make_tree(tree, args.files, args.file_size)
        stack.enter_context(running_agent(tmp / "a", tmp / "agent.log"))
        options: list[str] | None = None
        note: str | None = "skipped (--no-rsync)"
        if not args.no_rsync:
            if shutil.which("rsync") is None:
                note = "rsync is not installed"
            else:
                options, note = stack.enter_context(loopback_sshd(tmp / "ssh"))
        results.rsync_note = note
        dest = tmp / "rsync-dest"
        first, data = app_sync(tmp / "b", tree)  # the first sync sends everything
        results.first_seconds = first
        results.first_bytes = int(str(data["bytes_sent"])) + int(str(data["manifest_bytes"]))
        print(
            f"  first app sync: {data['files_sent']} files, {results.first_bytes} bytes "
            f"in {first:.1f}s",
            flush=True,
        )
        if options is not None:
            seconds, _sent = rsync_once(options, tree, dest)
            print(f"  first rsync: {seconds:.1f}s", flush=True)
        for index in range(args.repeat):
            change_one(tree, (index * 7919) % args.files, args.file_size)
            order = ("gpumesh", "rsync") if index % 2 == 0 else ("rsync", "gpumesh")
            for kind in order:
                if kind == "gpumesh":
                    seconds, data = app_sync(tmp / "b", tree)
                    results.gpumesh_seconds.append(seconds)
                    results.gpumesh_bytes.append(int(str(data["bytes_sent"])))
                    results.gpumesh_files.append(int(str(data["files_sent"])))
                    results.gpumesh_manifest.append(int(str(data["manifest_bytes"])))
                    results.manifest_kinds.append(str(data.get("manifest", "full")))
                    print(
                        f"  run {index + 1}: app sync {seconds:6.2f}s "
                        f"{data['files_sent']} file(s), {data['bytes_sent']} bytes of tar "
                        f"+ {data['manifest_bytes']} of manifest ({data.get('manifest')})",
                        flush=True,
                    )
                elif options is not None:
                    seconds, sent = rsync_once(options, tree, dest)
                    results.rsync_seconds.append(seconds)
                    results.rsync_bytes.append(sent)
                    print(f"  run {index + 1}: rsync    {seconds:6.2f}s {sent} bytes", flush=True)
    return results


def report(args: argparse.Namespace, results: Results) -> None:
    print(
        f"\nRe-sync of {args.files} files of {args.file_size} bytes after changing one, "
        f"{len(results.gpumesh_seconds)} run(s) of each (whole process)"
    )
    rows = []
    gm = summarize(results.gpumesh_seconds)
    total = [a + b for a, b in zip(results.gpumesh_bytes, results.gpumesh_manifest, strict=True)]
    rows.append(
        [
            "gpumesh app sync (tar + manifest)",
            f"{gm.p50:.2f}",
            f"{gm.low:.2f}",
            f"{gm.high:.2f}",
            f"{_median(total)} ({_median(results.gpumesh_bytes)} + "
            f"{_median(results.gpumesh_manifest)})",
        ]
    )
    if results.rsync_seconds:
        rs = summarize(results.rsync_seconds)
        rows.append(
            [
                "rsync -a over loopback sshd",
                f"{rs.p50:.2f}",
                f"{rs.low:.2f}",
                f"{rs.high:.2f}",
                str(_median(results.rsync_bytes)),
            ]
        )
    print_rows(["", "median s", "min", "max", "median bytes sent"], rows)
    if set(results.gpumesh_files) != {1}:
        print(f"  WARNING: app sync sent {results.gpumesh_files} files, expected 1 each time")
    time_ratio = gm.p50 / results.first_seconds
    bytes_ratio = _median(total) / results.first_bytes
    print(
        f"  first sync: {results.first_seconds:.2f}s, {results.first_bytes} bytes; "
        f"re-sync / first: {time_ratio:.3f}x time, {bytes_ratio:.4f}x bytes "
        f"(goal <= {GOAL_OF_FIRST}x both: {_met(max(time_ratio, bytes_ratio) <= GOAL_OF_FIRST)})"
    )
    print(f"  manifest sent as: {', '.join(results.manifest_kinds)}")
    if not results.rsync_seconds:
        print(f"  rsync: {results.rsync_note}; no comparison")
        return
    ratio = gm.p50 / summarize(results.rsync_seconds).p50
    print(
        f"  re-sync time gpumesh / rsync (medians): {ratio:.2f}x "
        f"(goal <= {GOAL_OF_RSYNC}x: {_met(ratio <= GOAL_OF_RSYNC)})"
    )


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="`gpumesh app sync` re-sync after one change, next to rsync over ssh."
    )
    parser.add_argument("--files", type=int, default=10_000, help="files in the tree")
    parser.add_argument(
        "--file-size", type=int, default=100 * 1024, help="bytes per file (default 100 KiB)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="re-syncs of each tool")
    parser.add_argument("--quick", action="store_true", help="smoke run: 500 files, 1 run")
    parser.add_argument("--no-rsync", action="store_true", help="measure GPUMesh only")
    args = parser.parse_args(argv)
    if args.quick:
        args.files, args.repeat = 500, 1
    if args.files < 1 or args.repeat < 1 or args.file_size < 1:
        parser.error("--files, --file-size and --repeat must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    ensure_bytecode()
    try:
        results = run(args)
    except KeyboardInterrupt:
        return interrupted()
    report(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
