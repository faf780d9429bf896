"""``gpumesh.Mesh`` through the node process vs in-process, next to ``docker run``.

What is measured: from one long-lived Python script (as a user's script runs),
the wall time of ``mesh.run("alice", ["echo", "hi"], image=IMAGE,
detach=False)`` and reading its lines back (``job.logs()`` must give exactly
``["hi"]``), against a provider running as a separate ``gpumesh share``
process on this machine (bench/dispatch.py's ``local_provider``):

* ``Mesh()``: through bob's node process over ``control.sock`` (the node
  process keeps a warm session to alice between runs);
* ``Mesh(in_process=True)``: the client layer in the script, which dials and
  proves both identities for each run;
* ``docker run --rm IMAGE echo hi``: the floor, no network at all.

The three take turns in one loop (the order rotates each round, after two
untimed warm-ups of each) so this shared machine's noise hits each alike;
figures are medians and p90 of ``--runs`` runs. Ratios are to the ``docker
run`` median; nothing here is a pass/fail verdict.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _benchlib import ensure_bytecode, exit_cleanly_on_sigterm, print_rows, summarize
from dispatch import DEFAULT_IMAGE, PEER, docker_ready, local_provider

NODE = "Mesh() via the node process"
LOCAL = "Mesh(in_process=True)"
DOCKER = "docker run --rm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="timed runs of each (default 10)")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="image to run")
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()
    ensure_bytecode()
    docker_ready(args.image)
    import gpumesh

    with (
        tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as tmp,
        local_provider(Path(tmp)) as provider,
    ):
        os.environ["GPUMESH_HOME"] = str(provider.bob_home)
        through = gpumesh.Mesh(provider.bob_home)
        local = gpumesh.Mesh(provider.bob_home, in_process=True)
        try:

            def mesh_run(mesh: gpumesh.Mesh) -> Callable[[], None]:
                def once() -> None:
                    job = mesh.run(PEER, ["echo", "hi"], image=args.image, detach=False)
                    lines = list(job.logs())
                    if lines != ["hi"] or job.result.exit_code != 0:
                        raise SystemExit(f"unexpected run: {lines} {job.result}")

                return once

            def docker() -> None:
                done = subprocess.run(
                    ["docker", "run", "--rm", args.image, "echo", "hi"],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if done.returncode != 0 or done.stdout != "hi\n":
                    raise SystemExit(f"docker run failed: {done.stderr}")

            commands = {NODE: mesh_run(through), LOCAL: mesh_run(local), DOCKER: docker}
            times: dict[str, list[float]] = {name: [] for name in commands}
            for _ in range(2):
                for command in commands.values():
                    command()
            orders = itertools.cycle(itertools.permutations(commands))
            for _ in range(args.runs):
                for name in next(orders):
                    started = time.perf_counter()
                    commands[name]()
                    times[name].append(time.perf_counter() - started)
        finally:
            through.close()
            local.close()
            from gpumesh.daemon.client import stop

            stop(provider.bob_home)
    floor = summarize(times[DOCKER]).p50
    rows = []
    for name, samples in times.items():
        s = summarize(samples)
        rows.append([name, f"{s.p50 * 1000:.0f}", f"{s.p90 * 1000:.0f}", f"{s.p50 / floor:.2f}x"])
    print(f"A trivial job from one Python script, {args.runs} runs each (ms):")
    print_rows(["", "p50", "p90", "p50 vs docker run"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
