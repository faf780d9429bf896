"""How long `gpumesh deny` takes to end everything a peer has on the provider.

A `gpumesh share` provider (alice) runs a job of bob's and holds an open
connection of bob's (a `gpumesh logs -f` of that job). Then alice's owner
types `gpumesh deny bob-laptop`. Measured, from just before that command is
spawned: until the follow's connection is closed (its process exits), and
until the job's record says `cancelled` ("access revoked") and its container
is gone. Then `gpumesh allow` and again, ``--repeat`` times. Goal: both within
1 s of the deny (the promise: "deny revokes everything at once").

There is no outside tool to compare with here (nothing a user would otherwise
use revokes a peer's running containers); the deny command's own duration is
shown next to the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
from dispatch import PEER, docker_ready, local_provider
from gpumesh.runtime.base import LABEL_JOB
from gpumesh.store.home import Home

CONSUMER = "bob"
"""bob's name on alice (see bench/bulk.py's make_nodes)."""


def _cli(
    env: dict[str, str], *args: str, home: Path | None = None
) -> subprocess.CompletedProcess[str]:
    run_env = dict(env)
    if home is not None:
        run_env["GPUMESH_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "gpumesh", *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _container_gone(job_id: str) -> bool:
    found = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label={LABEL_JOB}={job_id}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return not found.stdout.strip()


def one_round(alice: Path, env: dict[str, str], image: str) -> tuple[float, float, float]:
    """(deny command, link closed, job cancelled and its container gone), seconds."""
    started = _cli(env, "run", "--peer", PEER, "--image", image, "--detach", "sleep", "300")
    if started.returncode != 0:
        raise SystemExit(f"could not start a job: {started.stderr.strip()}")
    job_id = started.stdout.strip().split()[-1]
    home = Home(alice)
    try:
        deadline = time.monotonic() + 60
        while (job := home.store.job("hosted", job_id)) is None or job.state != "running":
            if time.monotonic() > deadline:
                raise SystemExit(f"job {job_id} never started")
            time.sleep(0.02)
        follow = subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "logs", "-f", job_id],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # the follow is connected and waiting for output
        began = time.monotonic()
        denied = _cli(env, "deny", CONSUMER, home=alice)
        deny_seconds = time.monotonic() - began
        if denied.returncode != 0:
            raise SystemExit(f"deny failed: {denied.stderr.strip()}")
        closed = cancelled = None
        while closed is None or cancelled is None:
            now = time.monotonic() - began
            if closed is None and follow.poll() is not None:
                closed = now
            if cancelled is None:
                job = home.store.job("hosted", job_id)
                if job is not None and job.state == "cancelled" and _container_gone(job_id):
                    cancelled = now
            if now > 60:
                follow.kill()
                raise SystemExit("the deny did not end the peer's link and job within 60 s")
            time.sleep(0.005)
        follow.wait()
    finally:
        home.close()
    if _cli(env, "allow", CONSUMER, home=alice).returncode != 0:
        raise SystemExit("allow failed")
    return deny_seconds, closed, cancelled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="denials to time (default 5)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 denial")
    parser.add_argument(
        "--image",
        default=os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1"),
        help="an image with a static busybox (default the offline test image)",
    )
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()
    ensure_bytecode()
    docker_ready(args.image)
    if (note := source_note()) is not None:
        print(note)
    rounds = 1 if args.quick else args.repeat
    rows: list[tuple[float, float, float]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as folder:
            tmp = Path(folder)
            with local_provider(tmp) as provider:
                for number in range(rounds):
                    rows.append(one_round(provider.alice_home, provider.env, args.image))
                    deny, closed, cancelled = rows[-1]
                    print(
                        f"  run {number + 1}: deny {deny * 1000:.0f} ms, link closed "
                        f"{closed * 1000:.0f} ms, job cancelled {cancelled * 1000:.0f} ms"
                    )
    except KeyboardInterrupt:
        return interrupted()
    print(f"\n`gpumesh deny` ending a peer's open connection and running job, {rounds} runs")
    table = []
    for name, index in (
        ("the deny command itself", 0),
        ("deny -> its connection closed", 1),
        ("deny -> its job cancelled, container gone", 2),
    ):
        summary = summarize([row[index] for row in rows])
        table.append((name, f"{summary.p50 * 1000:.0f}", f"{summary.p90 * 1000:.0f}"))
    print_rows(("from the start of `gpumesh deny`", "p50 ms", "p90 ms"), table)
    worst = summarize([max(row[1], row[2]) for row in rows]).p50
    verdict = "met" if worst <= 1.0 else "NOT met"
    print(f"  goal: everything ended within 1 s of the deny (median): {verdict}")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
