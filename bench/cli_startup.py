"""Start-up time of the ``gpumesh`` command, next to a bare interpreter.

What is measured: the wall time, as a user's shell sees it, of running
``gpumesh --help``, ``gpumesh status`` and ``gpumesh jobs`` (in a freshly
initialized temporary home) to completion, through the home's node process
(started by the warm-ups, then kept), as users get them; for comparison, a
``python -c`` script that lists the same jobs in its own process with
``gpumesh.Mesh(in_process=True).jobs()`` (no node process; the Python API's
start-up, not the CLI's), median and p90 of ``--runs`` runs each. The floor is
``python -c pass`` with the interpreter the ``gpumesh`` console script runs
on: no CLI can start faster than its interpreter. ``python -c "import click"``
is shown too, as the cost of the CLI framework alone.

Why it is fair: every command is the real console script in a new process,
with output discarded; all commands take turns in one round-robin loop (after
two untimed warm-ups each) so the noise of this shared machine hits each
alike. The goals checked are a median under 150 ms for ``gpumesh --help``,
and ``gpumesh --help`` and ``gpumesh jobs`` at most 1.2x and 1.5x of
``python -c "import click"``; they are reported, never turned into a
pass/fail exit status.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _benchlib import (
    ensure_bytecode,
    exit_cleanly_on_sigterm,
    interrupted,
    print_rows,
    source_note,
    summarize,
)

HELP_GOAL_MS = 150.0
HELP_GOAL_RATIO = 1.2
JOBS_GOAL_RATIO = 1.5
CLICK = 'python -c "import click"'
WARMUPS = 2
IN_PROCESS_JOBS = "Mesh(in_process=True).jobs"
IN_PROCESS_JOBS_SCRIPT = (
    "import gpumesh\nwith gpumesh.Mesh(in_process=True) as mesh:\n    mesh.jobs()\n"
)
"""What ``gpumesh jobs`` does, in the script's own process ($GPUMESH_HOME's home)."""


def gpumesh_script() -> Path:
    """The ``gpumesh`` console script of this interpreter's environment."""
    script = Path(sys.prefix) / "bin" / "gpumesh"
    if script.exists():
        return script
    found = shutil.which("gpumesh")
    if found is None:
        raise SystemExit("cannot find the `gpumesh` console script; install the package first")
    return Path(found)


def script_interpreter(script: Path) -> str:
    """The interpreter in the script's ``#!`` line, else this one."""
    with script.open("rb") as handle:
        first = handle.readline().decode(errors="replace").strip()
    words = first.removeprefix("#!").split() if first.startswith("#!") else []
    # A plain "#!/path/to/python"; anything fancier (env, wrappers) falls back.
    plain = len(words) == 1 and Path(words[0]).name.startswith("python")
    if plain and os.access(words[0], os.X_OK):
        return words[0]
    return sys.executable


def time_once(command: list[str], env: dict[str, str] | None) -> float:
    """Seconds from spawn to exit of one run; a failure stops the benchmark."""
    started = time.perf_counter()
    result = subprocess.run(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        check=False,
    )
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(
            f"`{' '.join(command)}` failed (exit {result.returncode}): "
            f"{result.stderr.decode(errors='replace').strip()}"
        )
    return elapsed


def measure(runs: int, home: Path) -> dict[str, list[float]]:
    script = gpumesh_script()
    python = script_interpreter(script)
    env = dict(os.environ, GPUMESH_HOME=str(home))
    env.pop("GPUMESH_LOG", None)
    init = [str(script), "init", "--name", "bench"]
    subprocess.run(init, env=env, check=True, stdout=subprocess.DEVNULL)
    commands = {
        "python -c pass (floor)": [python, "-c", "pass"],
        CLICK: [python, "-c", "import click"],
        "gpumesh --help": [str(script), "--help"],
        "gpumesh status": [str(script), "status"],
        "gpumesh jobs": [str(script), "jobs"],
        IN_PROCESS_JOBS: [python, "-c", IN_PROCESS_JOBS_SCRIPT],
    }
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(WARMUPS):
        for command in commands.values():
            time_once(command, env)
    for _ in range(runs):
        for name, command in commands.items():
            samples[name].append(time_once(command, env))
    subprocess.run([str(script), "daemon", "stop"], env=env, check=False, stdout=subprocess.DEVNULL)
    return samples


def report(runs: int, samples: dict[str, list[float]]) -> None:
    summaries = {name: summarize(values) for name, values in samples.items()}
    floor = summaries["python -c pass (floor)"]
    print(f"CLI start-up, wall time of a new process, {runs} runs each, round-robin")
    rows = [
        [
            name,
            f"{s.p50 * 1e3:.1f}",
            f"{s.p90 * 1e3:.1f}",
            f"{s.p50 / floor.p50:.2f}x",
            f"{(s.p50 - floor.p50) * 1e3:+.1f}",
        ]
        for name, s in summaries.items()
    ]
    print_rows(["", "p50 ms", "p90 ms", "p50 / floor", "over floor ms"], rows)
    help_ms = summaries["gpumesh --help"].p50 * 1e3
    verdict = "met" if help_ms < HELP_GOAL_MS else "missed"
    print(f"  goal: `gpumesh --help` median < {HELP_GOAL_MS:.0f} ms: {help_ms:.1f} ms, {verdict}")
    click_p50 = summaries[CLICK].p50
    for name, goal in (("gpumesh --help", HELP_GOAL_RATIO), ("gpumesh jobs", JOBS_GOAL_RATIO)):
        ratio = summaries[name].p50 / click_p50
        verdict = "met" if ratio <= goal else "missed"
        print(f"  goal: `{name}` <= {goal:.1f}x `import click`: {ratio:.2f}x, {verdict}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time `gpumesh --help`, `gpumesh status` and `gpumesh jobs` next to a "
        "bare `python -c pass` and `python -c 'import click'`, in one run.",
    )
    parser.add_argument("--runs", type=int, default=20, help="timed runs of each (default 20)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 runs of each")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 3
    if args.runs < 2:
        parser.error("--runs must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    ensure_bytecode()
    if note := source_note():
        print(note)
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as tmp:
            samples = measure(args.runs, Path(tmp) / "home")
    except KeyboardInterrupt:
        return interrupted()
    report(args.runs, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
