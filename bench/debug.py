"""``gpumesh debug JOB -- true`` of a failed job, next to ``docker run --rm IMAGE true``.

What is measured: the wall time, as a user's shell sees it, of getting a
program to run in a twin of a failed job and back:

* ``gpumesh debug JOB -- true``, a new CLI process each time, against a
  provider running as a separate ``gpumesh share`` process on this machine.
  The job (``--workdir`` of a small folder and ``--outputs``, failing with
  exit 3) ran once beforehand; each debug makes a twin of its last attempt
  (the image by id, the workdir and outputs folder it left, its user, limits
  and network), runs ``true`` in it through the node process, and removes it.
  The provider runs jobs with a read-only root (the default), so the twin
  starts from the image; with ``job_root on`` it would first commit the
  kept container (not measured here).
* What a user would otherwise do on the provider: ``docker run --rm IMAGE true``.

The two take turns in one loop (after an untimed warm-up of each) so that
the noise of this shared machine hits both alike; figures are medians of
``--repeat`` runs. The goal reported is a median ``debug`` of at most 2x the
median ``docker run`` plus 1 s; it is never turned into an exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _benchlib import (
    ensure_bytecode,
    exit_cleanly_on_sigterm,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from dispatch import DEFAULT_IMAGE, PEER, docker_ready, local_provider, time_command

DEBUG = "gpumesh debug JOB -- true"
DOCKER = "docker run --rm IMG true"
GOAL_FACTOR = 2.0
GOAL_EXTRA = 1.0
"""``debug`` should take at most GOAL_FACTOR x ``docker run`` + GOAL_EXTRA seconds."""


def _failed_job(command: list[str], env: dict[str, str], image: str, tmp: Path) -> str:
    """Run the job to debug (detached) until it failed; its id."""
    work = tmp / "work"
    work.mkdir()
    (work / "data.txt").write_text("x" * 4096)
    started = subprocess.run(
        [*command, "run", "--peer", PEER, "--image", image, "-d", "--workdir", str(work),
         "--outputs", "/out", "--outputs-to", str(tmp / "got"), "--",
         "sh", "-c", "echo 1 > /workspace/w; echo 2 > $GPUMESH_OUTPUTS/o; exit 3"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if started.returncode != 0:
        raise SystemExit(f"the job to debug did not start: {started.stderr.strip()}")
    job_id = started.stdout.strip()
    waited = subprocess.run(
        [*command, "logs", "-f", job_id], env=env, capture_output=True, timeout=120, check=False
    )
    if waited.returncode != 3:
        raise SystemExit(f"the job to debug exited {waited.returncode}, not 3")
    return job_id


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {DEBUG: [], DOCKER: []}
    with local_provider(tmp) as provider:
        job_id = _failed_job(provider.command, provider.env, args.image, tmp)
        commands = {
            DEBUG: provider.gpumesh("debug", job_id, "--", "true"),
            DOCKER: ["docker", "run", "--rm", args.image, "true"],
        }
        for name, command in commands.items():  # warm-up, untimed
            time_command(name, command, provider.env)
        for index in range(args.repeat):
            order = list(commands) if index % 2 == 0 else list(reversed(commands))
            for name in order:
                times[name].append(time_command(name, commands[name], provider.env).seconds)
    return times


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    rows = []
    for name, samples in times.items():
        summary = summarize(samples)
        rows.append(
            [name, f"{summary.p50 * 1000:.0f}", f"{summary.p90 * 1000:.0f}", str(summary.n)]
        )
    print(f"debug of a failed job vs docker run, image {args.image}, {args.repeat} runs each:")
    print_rows(["command", "p50 ms", "p90 ms", "n"], rows)
    debug, docker = statistics.median(times[DEBUG]), statistics.median(times[DOCKER])
    goal = GOAL_FACTOR * docker + GOAL_EXTRA
    verdict = "met" if debug <= goal else "missed"
    print(
        f"ratio debug / docker run: {debug / docker:.2f}x; goal <= {GOAL_FACTOR:g}x + "
        f"{GOAL_EXTRA:g} s = {goal * 1000:.0f} ms: {verdict}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="image with a static busybox")
    parser.add_argument("--repeat", type=int, default=15, help="timed runs of each command")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 runs each")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat = 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    ensure_bytecode()
    if note := source_note():
        print(note)
    docker_ready(args.image)
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as tmp:
            times = measure(args, Path(tmp))
    except KeyboardInterrupt:
        return interrupted()
    with contextlib.suppress(BrokenPipeError):
        report(args, times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
