"""``gpumesh run --workdir`` of a 512 MiB folder, next to ``cp`` of it plus a ``docker run``.

What is measured: the wall time, as a user's shell sees it, of running a job
on a folder that first has to reach the provider:

* ``gpumesh run --peer alice --image IMG --workdir DIR -- sh -c CHECK``, a new
  CLI process each time, against a provider running as a separate
  ``gpumesh share`` process on this machine. It packs the folder, uploads it
  (over the data channel: TLS on TCP, opened by the QUIC request), the
  provider unpacks it as it arrives and checks its hash, then runs the job in
  a locked-down container with the folder as its working directory, and the
  CLI streams the output back.
* What a user would otherwise do: ``gpumesh cp -r DIR alice:/`` (a whole
  process too), then ``docker run --rm -v DIR:/w -w /w IMG sh -c CHECK`` on
  this machine; the two times are added.
* For reference, ``gpumesh run --workdir`` with ``data_channel off`` in the
  consumer's config (the folder as DATA on the QUIC stream, as before the
  workdir took the channel), the same job from a ``python -c`` script with
  ``gpumesh.Mesh(in_process=True).run(..., workdir=DIR)`` (the script's
  process dials and uploads itself instead of asking the home's node process,
  as the other commands here do; it prints the job's output as it comes),
  and ``gpumesh run -- true`` without a workdir (what dispatching a job costs
  beyond the upload).

CHECK adds up the sizes of the folder's files inside the container, and
every run's output is compared with the folder's size, so each job did see
the whole folder (its content is checked by the transfer's hash). The
folder (``--files`` files of random bytes, ``--size`` in all, default
512 MiB in 4 files) and the provider's home live on tmpfs
(``/dev/shm`` when it exists), as in bench/cp.py. Each copy and job workdir is
removed after its run. The commands take turns in one loop (the order rotates
every round, after an untimed warm-up of each) so that the noise of this
shared machine hits each alike; figures are medians of ``--repeat`` runs. The
goal reported is a median ``run --workdir`` of at most 1.2x the median of
(``cp`` + ``docker run``); it is never turned into an exit status. Each timed
``run --workdir`` (and ``--baseline``'s) is also split into phases by the
provider's and the client's job records and the spawn and exit times seen here.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _benchlib import (
    IN_PROCESS_RUN,
    exit_cleanly_on_sigterm,
    interrupted,
    print_rows,
    source_note,
)
from bulk import parse_size, write_source
from dispatch import (
    DEFAULT_IMAGE,
    Outcome,
    Provider,
    baseline_source,
    docker_ready,
    local_provider,
    time_command,
)

MIB = 1024 * 1024
GOAL = 1.2
"""``run --workdir`` should take at most this many times (``cp`` + ``docker run``)."""

RUN = "gpumesh run --workdir"
CP = "gpumesh cp -r"
DOCKER = "docker run -v"
QUIC = "gpumesh run --workdir, data_channel off"
ALONE = "Mesh(in_process=True).run, workdir"
BASELINE = "gpumesh run --workdir at --baseline"
BARE = "gpumesh run, no workdir"
CHECK = "find . -type f | xargs stat -c %s | awk '{n += $1} END {print n}'"
"""The job: add up the sizes of the files in the folder it was given (their
content is checked by the transfer's hash; reading it here would time the
container's reads, not the transfer)."""


PHASES = [
    "CLI start, submit, provider accepts",
    "upload, unpack, create + start container",
    "the job, its end recorded",
    "end reaches the CLI, CLI exits",
]
"""Where a ``run --workdir`` spends its time, from the provider's and the client's
job records and the spawn and exit times seen here (one clock)."""


def phases(provider: Provider, outcome: Outcome) -> list[float] | None:
    """Seconds of each of PHASES for the run that just ended, or None if a time is missing."""
    mine = provider.submitted()
    theirs, _ = provider.hosted(mine.job_id)
    marks = [
        outcome.spawned,
        theirs.created_at,
        theirs.started_at,
        theirs.finished_at,
        outcome.exited,
    ]
    if any(mark is None for mark in marks):
        return None
    times = [float(mark) for mark in marks if mark is not None]
    return [after - before for before, after in itertools.pairwise(times)]


def make_folder(root: Path, size: int, files: int) -> None:
    root.mkdir()
    each, rest = divmod(size, files)
    for index in range(files):
        write_source(root / f"part{index}.bin", each + (rest if index == 0 else 0))


def _expect_size(name: str, stdout: bytes, size: int) -> None:
    if stdout.strip() != str(size).encode():
        raise SystemExit(f"{name}: the job counted {stdout.strip()!r} bytes, not {size}")


def _tidy(provider: Provider) -> None:
    """Free the tmpfs space a run took on the provider: copies and job workdirs."""
    for parent, name in (("files", "data"), ("jobs", "work")):
        folder = provider.alice_home / parent
        if folder.is_dir():
            for entry in folder.iterdir():
                shutil.rmtree(entry / name, ignore_errors=True)


def _set_channel(provider: Provider, value: str) -> None:
    subprocess.run(
        provider.gpumesh("config", "set", "data_channel", value),
        env=provider.env,
        check=True,
        capture_output=True,
    )


def measure(
    args: argparse.Namespace, tmp: Path
) -> tuple[dict[str, list[float]], dict[str, list[list[float]]]]:
    folder = tmp / "data"
    make_folder(folder, args.size, args.files)
    times: dict[str, list[float]] = {
        name: [] for name in (RUN, CP, DOCKER, QUIC, BARE, ALONE, BASELINE)
    }
    splits: dict[str, list[list[float]]] = {RUN: [], BASELINE: []}
    with contextlib.ExitStack() as stack:
        provider = stack.enter_context(local_provider(tmp))
        other = None
        if args.baseline:
            # Another version, provider and consumer both, on the same engine.
            source = baseline_source(args.baseline, tmp / "baseline-src")
            other = stack.enter_context(local_provider(tmp / "baseline", source))
        run = provider.gpumesh(
            "run", "--peer", "alice", "--image", args.image, "--workdir", str(folder),
            "--", "sh", "-c", CHECK,
        )  # fmt: skip
        bare = provider.gpumesh("run", "--peer", "alice", "--image", args.image, "--", "true")
        cp = provider.gpumesh("cp", "-r", str(folder), "alice:/")
        docker = [
            "docker", "run", "--rm", "-v", f"{folder}:/w:ro", "-w", "/w", args.image,
            "sh", "-c", CHECK,
        ]  # fmt: skip

        options = json.dumps({"image": args.image, "workdir": str(folder)})
        alone = [sys.executable, "-c", IN_PROCESS_RUN, "alice", options, "sh", "-c", CHECK]
        commands = {RUN: run, QUIC: run, ALONE: alone, CP: cp, DOCKER: docker, BARE: bare}
        envs = {name: provider.env for name in commands}
        if other is not None:
            commands[BASELINE] = other.gpumesh(*run[len(provider.command) :])
            envs[BASELINE] = other.env

        def one(name: str, timed: bool = True) -> float:
            if name == QUIC:
                _set_channel(provider, "off")
            try:
                outcome = time_command(name, commands[name], envs[name])
            finally:
                if name == QUIC:
                    _set_channel(provider, "on")
            if name not in (CP, BARE):
                _expect_size(name, outcome.stdout, args.size)
            owner = other if name == BASELINE and other is not None else provider
            if timed and name in splits and (split := phases(owner, outcome)) is not None:
                splits[name].append(split)
            _tidy(other if name == BASELINE and other is not None else provider)
            return outcome.seconds

        names = [RUN, CP, DOCKER, BARE] + ([] if args.no_quic else [QUIC])
        names += [] if args.no_in_process else [ALONE]
        names += [] if other is None else [BASELINE]
        for name in names:  # untimed warm-up of each
            one(name, timed=False)
        for index in range(args.repeat):
            order = names[index % len(names) :] + names[: index % len(names)]
            for name in order:
                seconds = one(name)
                times[name].append(seconds)
                print(f"  run {index + 1}: {name:<40} {seconds:6.2f} s", flush=True)
    return times, splits


def report_phases(args: argparse.Namespace, splits: dict[str, list[list[float]]]) -> None:
    """The median of each phase of ``run --workdir`` (and of the baseline's, beside it)."""
    shown = [name for name in (RUN, BASELINE) if splits[name]]
    if not shown:
        return
    columns = {name: list(zip(*splits[name], strict=True)) for name in shown}
    heads = ["this checkout" if name == RUN else f"at {args.baseline}" for name in shown]
    print("\nWhere `run --workdir` spends its time (medians of the same runs, ms)")
    rows = [
        [phase, *(f"{statistics.median(columns[name][i]) * 1e3:.0f}" for name in shown)]
        for i, phase in enumerate(PHASES)
    ]
    print_rows(["", *heads], rows)
    print("  phases: from the provider's and the client's job records (one clock)")


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    def median(name: str) -> float:
        return statistics.median(times[name])

    rows = [
        [name, f"{median(name):.2f}", f"{min(times[name]):.2f}", f"{max(times[name]):.2f}"]
        for name in (RUN, CP, DOCKER, BARE, QUIC, ALONE, BASELINE)
        if times[name]
    ]
    baseline = [c + d for c, d in zip(times[CP], times[DOCKER], strict=True)]
    rows.append(
        ["cp + docker run (per round)", f"{statistics.median(baseline):.2f}",
         f"{min(baseline):.2f}", f"{max(baseline):.2f}"]
    )  # fmt: skip
    print(
        f"\n`run --workdir` of {args.size / MIB:g} MiB in {args.files} files, "
        f"{args.repeat} runs of each, whole processes"
    )
    print_rows(["", "median s", "min", "max"], rows)
    ratio = median(RUN) / statistics.median(baseline)
    verdict = "met" if ratio <= GOAL else "NOT met"
    print(f"  ratio run --workdir / (cp + docker run) (medians): {ratio:.2f}x")
    print(f"  goal: <= {GOAL}x: {verdict}")
    if times[QUIC]:
        print(
            f"  run --workdir over QUIC / over the data channel: {median(QUIC) / median(RUN):.2f}x"
        )
    if times[ALONE]:
        alone = median(ALONE) / statistics.median(baseline)
        print(
            f"  ratio Mesh(in_process=True).run, workdir / (cp + docker run) (medians): "
            f"{alone:.2f}x"
        )
    if times[BASELINE]:
        before = median(BASELINE) / statistics.median(baseline)
        print(
            f"  ratio run --workdir at {args.baseline} / (cp + docker run) (medians): "
            f"{before:.2f}x; this checkout / {args.baseline}: {median(RUN) / median(BASELINE):.2f}x"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="`gpumesh run --workdir` of a folder vs `gpumesh cp -r` of it plus a "
        "local `docker run`, in one run.",
    )
    parser.add_argument(
        "--size", type=parse_size, default=512 * MIB, help="bytes in the folder (default 512M)"
    )
    parser.add_argument("--files", type=int, default=4, help="files in the folder (default 4)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (default 3)")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help=f"(default {DEFAULT_IMAGE})")
    parser.add_argument("--no-quic", action="store_true", help="leave out the QUIC reference")
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also time `run --workdir` of git revision REV (provider and consumer both, "
        "from `git archive`), side by side in the same loop",
    )
    parser.add_argument(
        "--no-in-process",
        action="store_true",
        help="leave out the job run in-process (a script's Mesh(in_process=True).run)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 32M, 1 run of each")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeat = 32 * MIB, 1
    if args.size < args.files or args.files < 1:
        parser.error("--size must be at least --files bytes, and --files at least 1")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    docker_ready(args.image)
    shm_parent = "/dev/shm" if Path("/dev/shm").is_dir() else None
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-workdir-", dir=shm_parent) as tmp:
            print(
                f"Running on a {args.size / MIB:g} MiB folder, {args.repeat} runs of each...",
                flush=True,
            )
            times, splits = measure(args, Path(tmp))
    except KeyboardInterrupt:
        return interrupted()
    report(args, times)
    report_phases(args, splits)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
