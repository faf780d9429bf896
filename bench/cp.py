"""`gpumesh cp` of a file and of a tree of small files, next to scp and rsync, in one run.

What is measured: the wall time of whole processes copying to a peer on this
machine, as MB/s (10^6 bytes per second), the median of ``--repeat`` runs of
each tool, the tools taken in a rotating order so the noise of this shared
machine hits all alike, each after one untimed warm-up. Everything is done
twice, on two media:

* tmpfs (``/dev/shm``): the source, the provider's home (where its sandbox
  is) and the ssh tools' target;
* disk: the same under ``--dir`` (default ``bench/out/`` in this checkout; the
  script prints its filesystem, taken from ``findmnt``, and refuses tmpfs
  there). Writes land in the page cache as any copy's do, and no copy is synced
  inside its timing; but before each copy on disk the disk's filesystem is
  synced (``sync -f``, untimed), so that no tool pays for writing back the
  copy before it, nor for the journal work of removing it (``--no-sync``:
  leave that out, as runs before it did).

Two things are copied (``--size``, default 1 GiB, and a tree of ``--files``
files, default 10,000, making up ``--tree-size``, default 256 MiB):

* file: ``gpumesh cp --json FILE alice:PATH`` as a new CLI process each time,
  to a provider running as a separate ``gpumesh share`` process (its own
  figure, without interpreter start, is shown too; the size and
  ``resumed_from == 0`` are checked); ``scp`` with OpenSSH's default cipher;
  ``scp -c aes128-gcm@openssh.com`` (the fastest cipher a user can pick);
  ``rsync -a`` over ssh with that cipher;
* tree: folder ``gpumesh cp``; ``scp -r -c aes128-gcm@openssh.com``;
  ``rsync -a`` over ssh with that cipher.

The ssh tools talk to a throwaway OpenSSH server on 127.0.0.1
(``bench/sshd.sh``). Every copy is checked (bytes arrived) and removed
before the next. If sshd, scp or rsync cannot be set up, the script says why
and still reports GPUMesh's figures (install rsync with ``apt-get install
rsync`` to get its rows). Everything (agent, sshd, files) is removed on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _benchlib import (
    ensure_bytecode,
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
    write_source,
)

MIB = 1024 * 1024
GOAL = 1.2
"""GPUMesh's medians should be at least this many times scp's (aes128-gcm and scp -r)."""
GOAL_RSYNC = 1.0
"""Folder cp should be at least as fast as rsync -a."""
CIPHER = "aes128-gcm@openssh.com"
DISK_DEFAULT = Path(__file__).resolve().parent / "out"

GPUMESH_CP = "gpumesh cp"
SCP_DEFAULT = "scp (default cipher)"
SCP_GCM = "scp -c aes128-gcm"
RSYNC = "rsync -a (ssh aes128-gcm)"
FOLDER_CP = "gpumesh cp (folder)"
SCP_R = "scp -r -c aes128-gcm"
FILE_TOOLS = (GPUMESH_CP, SCP_DEFAULT, SCP_GCM, RSYNC)
TREE_TOOLS = (FOLDER_CP, SCP_R, RSYNC)
RATIOS = (
    ("file", GPUMESH_CP, SCP_DEFAULT, None),
    ("file", GPUMESH_CP, SCP_GCM, GOAL),
    ("file", GPUMESH_CP, RSYNC, None),
    ("tree", FOLDER_CP, SCP_R, GOAL),
    ("tree", FOLDER_CP, RSYNC, GOAL_RSYNC),
)


@dataclass
class Medium:
    name: str
    """``tmpfs`` or ``disk``."""
    parent: Path
    filesystem: str
    """What findmnt says holds ``parent``."""
    file: dict[str, list[float]] = field(default_factory=dict)
    """MB/s per tool of the file copies (whole process)."""
    tree: dict[str, list[float]] = field(default_factory=dict)
    reported: list[float] = field(default_factory=list)
    """MB/s of the file as ``gpumesh cp --json`` reports it (no interpreter start)."""
    channel: set[str] = field(default_factory=set)


@dataclass
class Copies:
    """One medium's set-up: what to copy, where to, and how to reach the provider."""

    tmp: Path
    source: Path
    tree: Path
    size: int
    tree_size: int
    sandbox: Path
    env: dict[str, str]
    ssh: list[str] | None
    settle: bool = False
    """Sync the filesystem (untimed) before each copy."""
    counter: int = 0

    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}-{self.counter}"


# --- one timed process -------------------------------------------------------------------


def timed(command: Sequence[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    """(seconds, stdout) of one whole process."""
    started = time.perf_counter()
    result = subprocess.run(
        list(command),
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TRANSFER_TIMEOUT,
        check=False,
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        what = " ".join(command[:2])
        raise RuntimeError(f"{what} failed (exit {result.returncode}): {result.stderr.strip()}")
    return seconds, result.stdout


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def arrived_file(path: Path, size: int, what: str) -> None:
    got = path.stat().st_size
    path.unlink()
    if got != size:
        raise RuntimeError(f"{what} copied {got} of {size} bytes")


def arrived_tree(path: Path, size: int, what: str) -> None:
    got = tree_bytes(path) if path.is_dir() else -1
    shutil.rmtree(path, ignore_errors=True)
    if got != size:
        raise RuntimeError(f"{what} copied {got} of {size} bytes")


# --- the tools ---------------------------------------------------------------------------


def gpumesh_file(c: Copies, medium: Medium) -> float:
    name = c.fresh("copy") + ".bin"
    seconds, out = timed(
        [*gpumesh_command(), "cp", "--json", str(c.source), f"alice:/{name}"], c.env
    )
    result = json.loads(out)
    if result["resumed_from"] != 0:
        raise RuntimeError(f"gpumesh cp resumed instead of copying from scratch: {result}")
    arrived_file(c.sandbox / name, c.size, "gpumesh cp")
    medium.reported.append(float(result["mb_per_s"]))
    medium.channel.add(f"{result['channel']} ({result.get('congestion') or '-'})")
    return c.size / seconds / 1e6


def gpumesh_tree(c: Copies, _medium: Medium) -> float:
    name = c.fresh("tree")
    seconds, _ = timed([*gpumesh_command(), "cp", "--json", str(c.tree), f"alice:/{name}"], c.env)
    arrived_tree(c.sandbox / name, c.tree_size, "gpumesh cp (folder)")
    return c.tree_size / seconds / 1e6


def scp_file(cipher: str | None) -> Callable[[Copies, Medium], float]:
    def run(c: Copies, _medium: Medium) -> float:
        assert c.ssh is not None
        target = c.tmp / "ssh-in" / (c.fresh("scp") + ".bin")
        flags = ["-c", cipher] if cipher else []
        seconds, _ = timed(["scp", "-q", *flags, *c.ssh, str(c.source), f"bench:{target}"])
        arrived_file(target, c.size, "scp")
        return c.size / seconds / 1e6

    return run


def scp_tree(c: Copies, _medium: Medium) -> float:
    assert c.ssh is not None
    target = c.tmp / "ssh-in" / c.fresh("scp-r")
    seconds, _ = timed(["scp", "-q", "-r", "-c", CIPHER, *c.ssh, str(c.tree), f"bench:{target}"])
    arrived_tree(target, c.tree_size, "scp -r")
    return c.tree_size / seconds / 1e6


def rsync(kind: str) -> Callable[[Copies, Medium], float]:
    def run(c: Copies, _medium: Medium) -> float:
        assert c.ssh is not None
        shell = " ".join(["ssh", "-c", CIPHER, *c.ssh])
        if kind == "file":
            target = c.tmp / "ssh-in" / (c.fresh("rsync") + ".bin")
            seconds, _ = timed(["rsync", "-a", "-e", shell, str(c.source), f"bench:{target}"])
            arrived_file(target, c.size, "rsync -a")
            return c.size / seconds / 1e6
        target = c.tmp / "ssh-in" / c.fresh("rsync-tree")
        seconds, _ = timed(["rsync", "-a", "-e", shell, f"{c.tree}/", f"bench:{target}/"])
        arrived_tree(target, c.tree_size, "rsync -a")
        return c.tree_size / seconds / 1e6

    return run


def tools(c: Copies, kind: str, no_rsync_why: str | None) -> dict[str, Callable[..., float]]:
    if kind == "file":
        chosen: dict[str, Callable[..., float]] = {GPUMESH_CP: gpumesh_file}
        if c.ssh is not None:
            chosen[SCP_DEFAULT] = scp_file(None)
            chosen[SCP_GCM] = scp_file(CIPHER)
    else:
        chosen = {FOLDER_CP: gpumesh_tree}
        if c.ssh is not None:
            chosen[SCP_R] = scp_tree
    if c.ssh is not None and no_rsync_why is None:
        chosen[RSYNC] = rsync(kind)
    return chosen


def settle(c: Copies) -> None:
    """Write back what earlier copies (and their removal) left dirty, outside any timing."""
    if c.settle:
        subprocess.run(["sync", "-f", str(c.tmp)], timeout=TRANSFER_TIMEOUT, check=False)


def measure(c: Copies, medium: Medium, kind: str, repeat: int, no_rsync_why: str | None) -> None:
    chosen = tools(c, kind, no_rsync_why)
    figures = medium.file if kind == "file" else medium.tree
    names = list(chosen)
    for name in names:
        settle(c)
        chosen[name](c, medium)  # untimed warm-up: first-use costs, page cache
        figures[name] = []
    medium.reported.clear()
    for index in range(repeat):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            settle(c)
            mbps = chosen[name](c, medium)
            figures[name].append(mbps)
            print(
                f"  {medium.name} {kind} run {index + 1}: {name:<26} {mbps:8.1f} MB/s", flush=True
            )


# --- set-up ------------------------------------------------------------------------------


def filesystem_of(path: Path) -> str:
    """findmnt's FSTYPE of the mount holding ``path`` (``?`` when it cannot tell)."""
    try:
        result = subprocess.run(
            ["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError:
        return "?"
    lines = result.stdout.strip().splitlines()  # stacked mounts: the first is enough
    return " ".join(lines[0].split()) if lines else "?"


def make_tree(root: Path, files: int, size: int) -> None:
    """``files`` files of random bytes making up ``size``, 100 to a folder."""
    each, extra = divmod(size, files)
    pool = os.urandom(max(each + 1, 1) + 4096)
    for index in range(files):
        folder = root / f"d{index // 100:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        start = index % 4096
        want = each + (1 if index < extra else 0)
        (folder / f"f{index:05d}.bin").write_bytes(pool[start : start + want])


@contextlib.contextmanager
def copies(
    args: argparse.Namespace, parent: Path, no_scp: bool, settle: bool
) -> Iterator[tuple[Copies, str | None]]:
    """A provider and (unless ``no_scp``) an sshd with everything under ``parent``."""
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cp-", dir=parent)))
        source, tree = tmp / "source.bin", tmp / "tree"
        # Only what is measured: a gigabyte written and never read still has to
        # go to the disk while the tree is timed.
        write_source(source, 0 if args.no_file else args.size)
        make_tree(tree, 1 if args.no_tree else args.files, args.tree_size)
        (tmp / "ssh-in").mkdir()
        alice, bob = make_nodes(tmp, free_port(kind=socket.SOCK_DGRAM))
        sandbox = tmp / "a" / "files" / str(bob.info().node_id)
        alice.close()
        bob.close()
        stack.enter_context(running_agent(tmp / "a", tmp / "agent.log"))
        ssh, why = None, "skipped (--no-scp)"
        if not no_scp:
            ssh, why = stack.enter_context(loopback_sshd(tmp / "ssh"))
        env = dict(os.environ, GPUMESH_HOME=str(tmp / "b"))
        env.pop("GPUMESH_LOG", None)
        yield (
            Copies(
                tmp=tmp,
                source=source,
                tree=tree,
                size=args.size,
                tree_size=tree_bytes(tree),
                sandbox=sandbox,
                env=env,
                ssh=ssh,
                settle=settle,
            ),
            why,
        )


def media(args: argparse.Namespace) -> list[Medium]:
    chosen = []
    if "tmpfs" in args.media:
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        chosen.append(Medium("tmpfs", shm, filesystem_of(shm)))
    if "disk" in args.media:
        args.dir.mkdir(parents=True, exist_ok=True)
        chosen.append(Medium("disk", args.dir, filesystem_of(args.dir)))
    return chosen


def run(args: argparse.Namespace) -> list[Medium]:
    done = []
    no_rsync_why = (
        None if shutil.which("rsync") else "rsync is not installed (apt-get install rsync)"
    )
    for medium in media(args):
        print(f"{medium.name}: {medium.parent} ({medium.filesystem})", flush=True)
        if medium.name == "disk" and medium.filesystem.split()[:1] == ["tmpfs"]:
            print(f"  {medium.parent} is on tmpfs, not a disk: skipped (pick one with --dir)")
            continue
        writing = [] if args.no_file else [f"a {args.size / MIB:g} MiB file"]
        if not args.no_tree:
            writing.append(f"{args.files} files of {args.tree_size / MIB:g} MiB in all")
        print(f"  writing {' and '.join(writing) or 'nothing'}...", flush=True)
        settle = medium.name == "disk" and not args.no_sync
        with copies(args, medium.parent, args.no_scp, settle) as (c, ssh_why):
            if ssh_why:
                print(f"  scp, rsync: {ssh_why}")
            elif no_rsync_why:
                print(f"  rsync: {no_rsync_why}")
            if not args.no_file:
                measure(c, medium, "file", args.repeat, no_rsync_why)
            if not args.no_tree:
                measure(c, medium, "tree", args.repeat, no_rsync_why)
        done.append(medium)
    return done


# --- the report --------------------------------------------------------------------------


def report(args: argparse.Namespace, done: list[Medium]) -> None:
    rows = []
    for medium in done:
        for kind, figures in (("file", medium.file), ("tree", medium.tree)):
            for name, values in figures.items():
                s = summarize(values)
                rows.append(
                    [
                        f"{medium.name} {kind}: {name}",
                        f"{s.p50:.1f}",
                        f"{s.low:.1f}",
                        f"{s.high:.1f}",
                    ]
                )
            if kind == "file" and medium.reported:
                s = summarize(medium.reported)
                rows.append(
                    [
                        f"{medium.name} file:   as gpumesh cp reports it",
                        f"{s.p50:.1f}",
                        f"{s.low:.1f}",
                        f"{s.high:.1f}",
                    ]
                )
    print(
        f"\nCopies to a peer over loopback, whole processes, median of {args.repeat}; "
        f"file {args.size / MIB:g} MiB, tree {args.files} files / {args.tree_size / MIB:g} MiB; "
        "MB/s = 10^6 bytes/s"
    )
    print_rows(["", "median MB/s", "min", "max"], rows)
    print("\nRatios (medians, whole processes; > 1: GPUMesh faster)")
    ratio_rows = []
    for medium in done:
        for kind, ours, theirs, goal in RATIOS:
            figures = medium.file if kind == "file" else medium.tree
            if ours not in figures or theirs not in figures:
                continue
            ratio = summarize(figures[ours]).p50 / summarize(figures[theirs]).p50
            verdict = "" if goal is None else ("met" if ratio >= goal else "NOT met")
            goal_text = "" if goal is None else f">= {goal:g}x"
            ratio_rows.append(
                [f"{medium.name} {kind}: {ours} / {theirs}", f"{ratio:.2f}x", goal_text, verdict]
            )
    print_rows(["", "ratio", "goal", ""], ratio_rows)
    for medium in done:
        if medium.channel:
            print(f"  {medium.name}: gpumesh cp carried the file over {', '.join(medium.channel)}")


# --- command line ------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="`gpumesh cp` of a file and of a tree to a separate `gpumesh share` "
        "process, next to scp (default cipher and aes128-gcm), scp -r and rsync -a over a "
        "loopback sshd, on tmpfs and on disk, in one run.",
    )
    parser.add_argument(
        "--size", type=parse_size, default=1024 * MIB, help="bytes of the file (default 1G)"
    )
    parser.add_argument(
        "--files", type=int, default=10_000, help="files in the tree (default 10000)"
    )
    parser.add_argument(
        "--tree-size", type=parse_size, default=256 * MIB, help="bytes of the tree (default 256M)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tool (default 3)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=DISK_DEFAULT,
        help="folder on a disk for the disk runs (default bench/out/ in this checkout)",
    )
    parser.add_argument(
        "--media",
        default="tmpfs,disk",
        help="tmpfs, disk or both, comma-separated (default tmpfs,disk)",
    )
    parser.add_argument("--no-file", action="store_true", help="leave the file copies out")
    parser.add_argument("--no-tree", action="store_true", help="leave the tree copies out")
    parser.add_argument("--quick", action="store_true", help="smoke run: 32M, 500 files, 1 run")
    parser.add_argument("--no-scp", action="store_true", help="measure GPUMesh only")
    parser.add_argument(
        "--no-sync",
        action="store_true",
        help="do not sync the disk (untimed) before each copy on it",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.files, args.tree_size, args.repeat = 32 * MIB, 500, 8 * MIB, 1
    args.media = [m.strip() for m in args.media.split(",") if m.strip()]
    if not args.media or not set(args.media) <= {"tmpfs", "disk"}:
        parser.error("--media takes tmpfs, disk or both")
    if args.size < 1 or args.files < 1 or args.tree_size < args.files:
        parser.error("--size must be at least 1 byte, --tree-size at least --files bytes")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    ensure_bytecode()
    try:
        done = run(args)
    except KeyboardInterrupt:
        return interrupted()
    report(args, done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
