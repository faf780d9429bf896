"""What ``run --outputs`` costs a job that writes steadily, next to the same job
writing into a mounted folder nobody fetches.

What is measured: the job's own throughput, by its own clock. The job makes
``--files`` files of ``--file-size`` each, one after the other, from
``/dev/urandom`` (the kernel's generator keeps a core busy, as a job's own
work would; ``--source zero`` writes as fast as the disk takes it instead),
with ``dd ... conv=fsync`` (so the bytes reach the disk, as a checkpoint does),
each renamed into place when done (as the docs ask), timing itself with
``/proc/uptime``; its throughput is the bytes over that time.

* With outputs: ``gpumesh run --peer alice --outputs /out --outputs-to DEST``:
  while the job writes, each finished file streams to bob's node process
  (the provider reads it from its disk and hashes it, bob writes and hashes
  it), on the same machine and disk as the job.
* Without: the same job writing into a folder of bob's sandbox mounted
  read-write (``--mount /bench:/out:rw``): the same bind mount on the same
  disk, and nothing fetched.

The two take turns (``--repeat`` rounds, alternating which goes first, after
an untimed warm-up of each), against a provider running as a separate
``gpumesh share`` process; every run checks that the job wrote what it
should and, with outputs, that every file came home whole (sizes). Figures
are medians with their spread (min..max); the goal (streaming costs at most 5%
of the job's throughput) is reported, never turned into an exit status. The
homes and the destination live under ``--dir`` (default ``bench/out``, a
disk; tmpfs would hide the I/O the job and the stream share). The consumer's
home and destination (``--dest``) are on /dev/shm by default: in a mesh they are
another machine's disk, and here their writes (the files, the store's records of
them) would otherwise share the job's disk and slow the job's fsyncs, which no
real submitter does; ``--dest bench/out`` shows that case.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from _benchlib import exit_cleanly_on_sigterm, interrupted, print_rows, source_note
from dispatch import DEFAULT_IMAGE, Provider, docker_ready, local_provider, time_command

MIB = 1024 * 1024
GOAL = 0.05
"""Streaming may cost the job at most this share of its own throughput."""
WITH = "job, --outputs (streamed)"
WITHOUT = "job, --mount :rw (not fetched)"
SCRIPT = (
    "read t0 _ < /proc/uptime; i=0; while [ $i -lt {files} ]; do i=$((i+1)); "
    "dd if=/dev/{source} of=/out/f$i.t bs=1M count={mib} conv=fsync 2>/dev/null; "
    "mv /out/f$i.t /out/f$i; done; read t1 _ < /proc/uptime; echo $t0 $t1"
)


def throughput(stdout: bytes, total: int, name: str) -> float:
    """MB/s of the job by its own clock, from the ``t0 t1`` line it printed."""
    try:
        t0, t1 = (float(word) for word in stdout.split()[-2:])
    except ValueError:
        raise SystemExit(f"{name}: the job printed {stdout[-200:]!r}, not its times") from None
    return total / max(t1 - t0, 0.01) / 1e6


def _cli(provider: Provider, *args: str) -> None:
    subprocess.run(provider.gpumesh(*args), env=provider.env, check=True, capture_output=True)


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, list[float]]:
    mib = max(1, args.file_size // MIB)
    total = args.files * mib * MIB
    script = SCRIPT.format(files=args.files, mib=mib, source=args.source)
    consumer = Path(tempfile.mkdtemp(prefix="gpumesh-outputs-", dir=args.dest))
    dest = consumer / "dest"
    times: dict[str, list[float]] = {WITH: [], WITHOUT: []}
    try:
        with local_provider(tmp / "homes", consumer=consumer / "b") as provider:
            empty = tmp / "bench"
            empty.mkdir()
            _cli(provider, "cp", "-r", str(empty), "alice:/")
            mounted = provider.alice_home / "files"
            base = ["run", "--peer", "alice", "--image", args.image]
            commands = {
                WITH: provider.gpumesh(
                    *base, "--outputs", "/out", "--outputs-to", str(dest), "--", "sh", "-c", script
                ),
                WITHOUT: provider.gpumesh(
                    *base, "--mount", "/bench:/out:rw", "--", "sh", "-c", script
                ),
            }

            def one(name: str) -> float:
                outcome = time_command(name, commands[name], provider.env)
                speed = throughput(outcome.stdout, total, name)
                if name == WITH:
                    sizes = sorted(p.stat().st_size for p in dest.iterdir())
                    if sizes != [mib * MIB] * args.files:
                        raise SystemExit(f"{name}: {len(sizes)} files came home, not {args.files}")
                    shutil.rmtree(dest)
                for folder in mounted.glob("*/bench"):
                    shutil.rmtree(folder, ignore_errors=True)
                    folder.mkdir()
                return speed

            names = [WITH, WITHOUT]
            for name in names:  # untimed warm-up of each
                one(name)
            for index in range(args.repeat):
                order = names if index % 2 == 0 else names[::-1]
                for name in order:
                    speed = one(name)
                    times[name].append(speed)
                    print(f"  run {index + 1}: {name:<34} {speed:8.1f} MB/s", flush=True)
    finally:
        shutil.rmtree(consumer, ignore_errors=True)
    return times


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    mib = max(1, args.file_size // MIB)
    print(
        f"\nA job writing {args.files} files of {mib} MiB from /dev/{args.source} "
        "(dd conv=fsync, then mv), "
        f"{args.repeat} alternated runs of each; its own throughput"
    )
    rows = [
        [name, f"{statistics.median(v):.1f}", f"{min(v):.1f}..{max(v):.1f}"]
        for name, v in times.items()
    ]
    print_rows(["", "median MB/s", "spread"], rows)
    cost = 1 - statistics.median(times[WITH]) / statistics.median(times[WITHOUT])
    verdict = "met" if cost <= GOAL else "NOT met"
    print(f"  cost of streaming (1 - with / without, medians): {cost * 100:.1f}%")
    print(f"  goal: <= {GOAL * 100:.0f}%: {verdict}")
    note = source_note()
    if note:
        print(f"  {note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=128, help="files the job writes (128)")
    parser.add_argument(
        "--file-size", type=lambda t: int(float(t) * MIB), default=8 * MIB,
        help="MiB in each file (8)",
    )  # fmt: skip
    parser.add_argument(
        "--source", choices=("urandom", "zero"), default="urandom", help="what dd reads"
    )
    parser.add_argument("--repeat", type=int, default=5, help="alternated runs of each (5)")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="an image with busybox")
    parser.add_argument("--dir", default="bench/out", help="where homes and outputs live")
    parser.add_argument(
        "--dest",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="where outputs land: the consumer's disk (default /dev/shm: another machine's "
        "disk in a real mesh, so kept off the provider's; a folder on the same disk shows "
        "both ends sharing it)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    if args.quick:
        args.files, args.file_size, args.repeat = 4, 2 * MIB, 1
    exit_cleanly_on_sigterm()
    docker_ready(args.image)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=Path(args.dir).absolute()) as folder:
            times = measure(args, Path(folder))
    except KeyboardInterrupt:
        return interrupted()
    report(args, times)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
