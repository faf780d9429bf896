"""Dispatch latency of ``gpumesh run`` for a trivial job, next to ``docker run``.

What is measured: the wall time, as a user's shell sees it, from typing the
command to getting the prompt back, for a container that prints ``hi``:

* GPUMesh: ``gpumesh run --peer alice --image IMAGE echo hi``, a new CLI
  process each time, against a provider already running as a separate
  ``gpumesh share`` process on this machine (127.0.0.1, a free UDP port, both
  nodes paired both ways in temporary homes). As users get it, the command
  asks bob's node process (started by the warm-ups, then kept), which holds a
  warm session to alice, submits the job and streams its output back; the
  provider creates, starts, waits for and removes the container through the
  Docker Engine API. For comparison, the same job from a ``python -c`` script
  with ``gpumesh.Mesh(in_process=True).run`` (no node process: the script
  imports the client layer, dials and proves both identities itself, submits
  and follows the job's output to its end, printing it) takes turns in the
  same loop.
* ``docker run --rm IMAGE echo hi``: the floor, on Docker's default bridge.
* the same on the provider's job network (``--network gpumesh-jobs-internet``,
  with its firewall rules): what Docker itself costs a container there, to
  tell the network's share of the gap from GPUMesh's own.
* ``ssh HOST docker run --rm IMAGE echo hi``: what users would otherwise do
  to run on another machine, against a throwaway loopback sshd
  (bench/sshd.sh), if one can be started here and its warm-up works; the
  report says why when it is left out (``--no-ssh`` skips it).

Each command is checked on every run: exit status 0 and exactly ``hi`` on
stdout, or the script stops with what the command printed. The commands take
turns in one loop (the order rotates every round, after two untimed warm-ups
of each) so that the noise of this shared machine hits each alike; figures are
medians and p90 of ``--runs`` runs each. The goal reported is a median
``gpumesh run`` of at most 1.2x the median ``docker run``; it is never turned
into a pass/fail exit status.

Where GPUMesh's time goes, from the same runs: the provider's and the
client's job records hold wall-clock times (this one machine's clock) for
"provider accepted the job", "container running", "job finished (its
output stored; the container's removal follows)" and "client got the final
status"; together with the spawn and
exit times seen here they split every ``gpumesh run`` into phases. Two more
commands take turns in the same loop as reference points: ``gpumesh --help``
(interpreter and CLI start-up, the floor of any ``gpumesh`` command) and
``gpumesh connect alice --fresh`` (start-up, then bob's node process dials
anew beside the warm session the runs keep: identity proof, a status request
and five pings on the new session, which it then closes; the command reports
that dial's time). One
more ``gpumesh run`` per round runs with ``PYTHONPROFILEIMPORTTIME=1``; only
its import total is used (the profiler slows it, so its wall time is not).

Not like for like: GPUMesh's job container is locked down (no capabilities,
memory and process limits, the "local" log driver); the ``docker run``
baseline uses Docker's defaults, exactly as a user would type it. (Adding
those flags to ``docker run`` changed its time by no more than the noise when
this was written.)

``--group G`` submits the timed ``gpumesh run`` with ``--group G`` instead of
``--peer alice`` (bob makes the group, alice its one member: the command probes
its members and submits, and bob's node process keeps the job as one that may
move), and ``--outputs PATH`` adds ``--outputs PATH`` (the job's outputs folder
is watched, and its files come home into a temporary folder); with either, the
plain ``gpumesh run --peer alice`` takes turns in the same loop as a row of its
own, so the table shows what the options cost. ``--baseline`` then runs with the
same options; the in-process row stays the plain job. Without them the script
measures exactly what it always did.

This module also provides :func:`local_provider`, the two-node set-up that
bench/log_latency.py reuses.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _benchlib import (
    IN_PROCESS_RUN,
    Summary,
    ensure_bytecode,
    exit_cleanly_on_sigterm,
    free_port,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from bulk import gpumesh_command, loopback_sshd, make_nodes, running_agent
from gpumesh.protocol.states import JobRole
from gpumesh.runtime.base import LABEL_NODE
from gpumesh.runtime.jobnet import NETWORK_PREFIX, names_for
from gpumesh.settings import ENV_TEST_JOB_NETWORK
from gpumesh.store.home import Home
from gpumesh.store.jobs import JobRecord

DEFAULT_IMAGE = "gpumesh-test/busybox:1"
PEER = "alice"
GOAL_RATIO = 1.2
WARMUPS = 2
COMMAND_TIMEOUT = 120.0
EXPECTED = b"hi\n"

# Names of the timed commands, in the order of the table.
RUN = "gpumesh run"
IN_PROCESS = "Mesh(in_process=True).run"
DOCKER = "docker run --rm"
DOCKER_JOBNET = "docker run --rm on the job network"
SSH = "ssh + docker run --rm"
HELP = "gpumesh --help"
CONNECT = "gpumesh connect --fresh"
PROFILED = "gpumesh run, import-profiled"
BASELINE = "gpumesh run at --baseline"
PLAIN = "gpumesh run --peer (plain)"
"""With ``--group`` or ``--outputs``: the plain run beside the timed one."""


# --- the local provider (shared with log_latency.py) --------------------------------------


@dataclass
class Provider:
    """alice sharing this machine in a ``gpumesh share`` process; bob, her paired consumer."""

    alice_home: Path
    bob_home: Path
    alice_id: str
    command: list[str]
    """The ``gpumesh`` console script to run as bob."""
    env: dict[str, str]
    """The environment for bob's CLI processes (``GPUMESH_HOME`` set)."""

    def gpumesh(self, *args: str) -> list[str]:
        return [*self.command, *args]

    def submitted(self, job_id: str | None = None) -> JobRecord:
        """bob's record of the given (default: newest) job he submitted."""
        home = Home(self.bob_home)
        try:
            if job_id is None:
                jobs = home.store.jobs(limit=1, role=JobRole.SUBMITTED)
                if not jobs:
                    raise RuntimeError("bob's store holds no submitted job")
                return jobs[0]
            job = home.store.job(JobRole.SUBMITTED, job_id)
            if job is None:
                raise RuntimeError(f"bob's store has no job {job_id}")
            return job
        finally:
            home.close()

    def hosted(self, job_id: str) -> tuple[JobRecord, list[tuple[float, bytes]]]:
        """alice's record of a job and its stdout events as (time stored, data)."""
        home = Home(self.alice_home)
        try:
            job = home.store.job(JobRole.HOSTED, job_id)
            if job is None:
                raise RuntimeError(f"the provider has no record of job {job_id}")
            events = home.store.job_events(job_id, 0, 100_000)
            return job, [(e.ts, e.data) for e in events if e.kind == "stdout"]
        finally:
            home.close()


def remove_containers(label: str) -> None:
    """Remove every container (running or not) with this label; quiet, best effort."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        found = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label={label}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout.split()
        if found:
            subprocess.run(
                ["docker", "rm", "-f", *found], capture_output=True, timeout=120, check=False
            )


@contextlib.contextmanager
def local_provider(
    tmp: Path, source: Path | None = None, consumer: Path | None = None
) -> Iterator[Provider]:
    """A ``gpumesh share`` provider on 127.0.0.1 and a paired consumer (his home
    ``consumer``, by default beside hers), until the block ends.

    ``source``: a folder holding another version's ``gpumesh`` package, which the
    provider and bob's commands (and so his node process) then run instead of
    this checkout's (see ``--baseline``).

    The provider stops on exit; job containers it leaves behind (an interrupted
    run outlives the agent, by design) are removed too.
    """
    bob_home = consumer or tmp / "b"
    alice, bob = make_nodes(tmp, free_port(kind=socket.SOCK_DGRAM), consumer=bob_home)
    alice_id = str(alice.info().node_id)
    # From here on the agent process and the CLI processes own the homes.
    alice.close()
    bob.close()
    env = dict(os.environ, GPUMESH_HOME=str(bob_home))
    for name in ("GPUMESH_LOG", "GPUMESH_PEER", "GPUMESH_IMAGE"):
        env.pop(name, None)
    wrap: tuple[str, ...] = ()
    if source is not None:
        # Ahead of the installed checkout on sys.path.
        env["PYTHONPATH"] = str(source)
        wrap = ("env", f"PYTHONPATH={source}")
    try:
        with running_agent(tmp / "a", tmp / "agent.log", wrap):
            yield Provider(tmp / "a", bob_home, alice_id, gpumesh_command(), env)
    finally:
        remove_containers(f"{LABEL_NODE}={alice_id}")


def baseline_source(rev: str, folder: Path) -> Path:
    """The ``src`` folder of git revision ``rev`` of this checkout, unpacked in ``folder``."""
    folder.mkdir()
    checkout = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "-C", str(checkout), "archive", rev, "src"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"git archive {rev} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "src"


def docker_ready(image: str) -> None:
    """Stop with a clear message unless the Docker daemon answers and has ``image``."""
    try:
        result = subprocess.run(
            ["docker", "image", "inspect", "--format", "{{.Id}}", image],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SystemExit(f"cannot run docker: {exc}") from None
    if result.returncode != 0:
        raise SystemExit(
            f"docker cannot use image {image}: {result.stderr.strip()}\n"
            "(scripts/ensure-docker.sh starts dockerd and builds the offline test image)"
        )


# --- one timed command --------------------------------------------------------------------


@dataclass
class Outcome:
    seconds: float
    spawned: float
    """Wall-clock time (``time.time()``) just before the spawn."""
    exited: float
    stdout: bytes
    stderr: bytes


def time_command(
    name: str, command: Sequence[str], env: dict[str, str], cwd: Path | None = None
) -> Outcome:
    """Run ``command`` (in ``cwd``, default this process's) to completion; any exit
    status but 0 stops the benchmark."""
    spawned = time.time()
    started = time.perf_counter()
    try:
        result = subprocess.run(
            list(command),
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{name}: no exit within {COMMAND_TIMEOUT:.0f}s") from None
    seconds = time.perf_counter() - started
    exited = time.time()
    if result.returncode != 0:
        raise SystemExit(_failure(name, command, f"exit {result.returncode}", result))
    return Outcome(seconds, spawned, exited, result.stdout, result.stderr)


def expect_hi(name: str, command: Sequence[str], outcome: Outcome) -> None:
    if outcome.stdout != EXPECTED:
        raise SystemExit(
            f"{name}: `{shlex.join(command)}` printed {outcome.stdout!r}, not {EXPECTED!r}"
        )


def _failure(
    name: str, command: Sequence[str], why: str, result: subprocess.CompletedProcess[bytes]
) -> str:
    out = result.stdout.decode(errors="replace").strip()
    err = result.stderr.decode(errors="replace").strip()
    return (
        f"{name}: `{shlex.join(command)}` failed ({why})\n"
        f"  stdout: {out or '(nothing)'}\n  stderr: {err or '(nothing)'}"
    )


# --- the GPUMesh timeline -----------------------------------------------------------------

PHASES = [
    "CLI start, dial, identity proof, submit",
    "provider: create + start container",
    "container runs, logs drained, end recorded",
    "final status reaches the CLI",
    "CLI closes the link and exits",
]


def phases(provider: Provider, outcome: Outcome) -> list[float] | None:
    """Seconds of each of PHASES for the run that just ended, or None if a time is missing."""
    mine = provider.submitted()
    theirs, _ = provider.hosted(mine.job_id)
    marks = [
        outcome.spawned,
        theirs.created_at,
        theirs.started_at,
        theirs.finished_at,
        mine.finished_at,
        outcome.exited,
    ]
    if any(mark is None for mark in marks):
        return None
    times = [float(mark) for mark in marks if mark is not None]
    return [after - before for before, after in itertools.pairwise(times)]


# --- the run ------------------------------------------------------------------------------


@dataclass
class Results:
    seconds: dict[str, list[float]] = field(default_factory=dict)
    phases: list[list[float]] = field(default_factory=list)
    dial_ms: list[float] = field(default_factory=list)
    """``gpumesh connect --fresh``'s own "connect N ms" (the node process's new dial
    and proof)."""
    import_seconds: list[float] = field(default_factory=list)
    """What ``python -X importtime`` says ``gpumesh run``'s imports took."""
    ssh_note: str | None = None
    node_rss_kb: int | None = None
    """Resident memory of bob's node process after the runs (one warm session)."""


def node_rss_kb(home: Path) -> int | None:
    """VmRSS of the node process serving ``home``, from its record; None if none runs."""
    try:
        pid = int(json.loads((home / "node.json").read_text())["pid"])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, KeyError):
        return None
    return None


CONNECT_MS = re.compile(rb"connect ([0-9.]+) ms")


def import_seconds(stderr: bytes) -> float:
    """Sum of the top-level imports' cumulative times in ``-X importtime`` output."""
    total = 0
    for line in stderr.decode(errors="replace").splitlines():
        if not line.startswith("import time:"):
            continue
        _, cumulative, name = line.split("|", 2)
        if cumulative.strip().isdigit() and not name.startswith("  "):
            total += int(cumulative)
    return total / 1e6


def run_options(args: argparse.Namespace) -> list[str]:
    """Where and how the timed ``gpumesh run`` submits: ``--peer alice`` by default."""
    where = ["--group", args.group] if args.group else ["--peer", PEER]
    return [*where, *(["--outputs", args.outputs] if args.outputs else [])]


def run_label(args: argparse.Namespace) -> str:
    """The timed ``gpumesh run``'s row, with its options when they are not the default."""
    if not (args.group or args.outputs):
        return RUN
    return " ".join([RUN, *run_options(args)])


def make_group(provider: Provider, name: str) -> None:
    """bob's group ``name`` with alice as its one member."""
    for args in (("group", "create", name), ("group", "add", name, PEER)):
        result = subprocess.run(
            provider.gpumesh(*args), env=provider.env, capture_output=True, timeout=60, check=False
        )
        if result.returncode != 0:
            raise SystemExit(_failure("group set-up", provider.gpumesh(*args), "", result))


def measure(args: argparse.Namespace, tmp: Path) -> Results:
    docker_ready(args.image)
    results = Results()
    with contextlib.ExitStack() as stack:
        provider = stack.enter_context(local_provider(tmp))
        job = ["--image", args.image, "echo", "hi"]
        commands: dict[str, list[str]] = {
            RUN: provider.gpumesh("run", *run_options(args), *job),
            DOCKER: ["docker", "run", "--rm", args.image, "echo", "hi"],
        }
        if args.group:
            make_group(provider, args.group)
        if args.group or args.outputs:
            commands[PLAIN] = provider.gpumesh("run", "--peer", PEER, *job)
        # The provider's jobs run on a Docker network of their own (job_network
        # internet, the default), made by its first job (a warm-up, before this
        # row's first run); Docker starts a container on such a network slower than
        # on its default bridge, and this row shows by how much.
        prefix = os.environ.get(ENV_TEST_JOB_NETWORK) or NETWORK_PREFIX
        jobnet = names_for("internet", prefix).network
        commands[DOCKER_JOBNET] = [
            "docker", "run", "--rm", "--network", jobnet, args.image, "echo", "hi"
        ]  # fmt: skip
        if args.no_ssh:
            results.ssh_note = "skipped (--no-ssh)"
        else:
            options, results.ssh_note = stack.enter_context(loopback_sshd(tmp / "ssh"))
            if options is not None:
                remote = shlex.join(commands[DOCKER])
                commands[SSH] = ["ssh", *options, "bench", remote]
        commands[HELP] = provider.gpumesh("--help")
        # --fresh: a dial of its own every time (without it the node process would
        # measure on the warm session the runs keep).
        commands[CONNECT] = provider.gpumesh("connect", PEER, "--fresh")
        commands[PROFILED] = commands[RUN]
        kwargs = json.dumps({"image": args.image})
        commands[IN_PROCESS] = [sys.executable, "-c", IN_PROCESS_RUN, PEER, kwargs, "echo", "hi"]
        env = dict(provider.env)
        envs = {PROFILED: dict(env, PYTHONPROFILEIMPORTTIME="1")}
        if args.baseline:
            # Another version, provider and consumer both, on the same engine.
            source = baseline_source(args.baseline, tmp / "baseline-src")
            other = stack.enter_context(local_provider(tmp / "baseline", source))
            if args.group:
                make_group(other, args.group)
            commands[BASELINE] = other.gpumesh("run", *run_options(args), *job)
            envs[BASELINE] = dict(other.env)
        # `--outputs` without `--outputs-to` brings them home into the working folder.
        cwd = tmp / "outputs" if args.outputs else None
        if cwd is not None:
            cwd.mkdir()

        def once(name: str) -> Outcome:
            outcome = time_command(name, commands[name], envs.get(name, env), cwd)
            if name in (RUN, IN_PROCESS, DOCKER, DOCKER_JOBNET, SSH, PROFILED, BASELINE, PLAIN):
                expect_hi(name, commands[name], outcome)
            if name == PROFILED:
                results.import_seconds.append(import_seconds(outcome.stderr))
            elif name == CONNECT:
                if b"reachable" not in outcome.stdout:
                    raise SystemExit(f"{name}: unexpected output {outcome.stdout!r}")
                if found := CONNECT_MS.search(outcome.stdout):
                    results.dial_ms.append(float(found.group(1)))
            return outcome

        names = list(commands)
        for _ in range(WARMUPS):
            for name in list(names):
                try:
                    once(name)
                except SystemExit as exc:
                    if name != SSH:
                        raise
                    # The ssh baseline is optional: say why it is missing, measure the rest.
                    results.ssh_note = f"left out, its warm-up failed: {exc}"
                    names.remove(SSH)
        results.dial_ms.clear()
        results.import_seconds.clear()
        results.seconds = {name: [] for name in names}
        print(f"Timing {', '.join(names)}: {args.runs} runs each, round-robin...", flush=True)
        for index in range(args.runs):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                outcome = once(name)
                results.seconds[name].append(outcome.seconds)
                if name == RUN and (split := phases(provider, outcome)) is not None:
                    results.phases.append(split)
        results.node_rss_kb = node_rss_kb(provider.bob_home)
    return results


# --- the report ---------------------------------------------------------------------------


def _ms(summary: Summary) -> list[str]:
    return [f"{summary.p50 * 1e3:.0f}", f"{summary.p90 * 1e3:.0f}", f"{summary.low * 1e3:.0f}"]


def report(args: argparse.Namespace, results: Results) -> None:
    summaries = {name: summarize(values) for name, values in results.seconds.items()}
    floor = summaries[DOCKER]
    print(f"\nDispatch of `echo hi` in {args.image}, {args.runs} runs each, round-robin;")
    print("wall time of a new process, from spawn to exit, as a shell sees it")
    rows = []
    label = run_label(args)
    for name in (RUN, PLAIN, BASELINE, IN_PROCESS, SSH, DOCKER_JOBNET, DOCKER):
        if name in summaries:
            summary = summaries[name]
            shown = label if name == RUN else name
            rows.append([shown, *_ms(summary), f"{summary.p50 / floor.p50:.2f}x"])
    print_rows(["", "p50 ms", "p90 ms", "min ms", "vs docker run"], rows)
    if SSH not in summaries:
        print(f"  ssh: {results.ssh_note}")
    ratio = summaries[RUN].p50 / floor.p50
    verdict = "met" if ratio <= GOAL_RATIO else "missed"
    print(
        f"  goal: {label} median <= {GOAL_RATIO:.1f}x docker run: {ratio:.2f}x, {verdict} "
        f"({(summaries[RUN].p50 - floor.p50) * 1e3:+.0f} ms)"
    )
    if PLAIN in summaries:
        plain = summaries[PLAIN].p50
        print(
            f"  the plain `gpumesh run --peer {PEER}` in the same loop: {plain / floor.p50:.2f}x "
            f"docker run; the options cost {(summaries[RUN].p50 - plain) * 1e3:+.0f} ms "
            f"({summaries[RUN].p50 / plain:.2f}x)"
        )
    if DOCKER_JOBNET in summaries:
        same = summaries[DOCKER_JOBNET].p50
        print(
            f"  on the same Docker network as the job: {summaries[RUN].p50 / same:.2f}x "
            f"({(summaries[RUN].p50 - same) * 1e3:+.0f} ms; the network itself costs "
            f"docker run {(same - floor.p50) * 1e3:+.0f} ms)"
        )
    if BASELINE in summaries:
        before = summaries[BASELINE].p50
        print(
            f"  this checkout vs --baseline {args.baseline}: {summaries[RUN].p50 / before:.2f}x "
            f"({(summaries[RUN].p50 - before) * 1e3:+.0f} ms)"
        )
    if results.node_rss_kb is not None:
        print(f"  bob's node process after the runs: {results.node_rss_kb / 1024:.1f} MB resident")

    print(f"\nWhere `{label}` spends its time (phases of the same runs)")
    rows = []
    if results.phases:
        columns = list(zip(*results.phases, strict=True))
        for index, (name, values) in enumerate(zip(PHASES, columns, strict=True)):
            rows.append([name, *_ms(summarize(values))])
            if index == 0 and results.import_seconds:
                imports = summarize(results.import_seconds)
                # Not all of it before the submission: the plain `run` sends its
                # request first and loads the rest of the CLI meanwhile.
                rows.append(["  CLI imports in all (-X importtime, extra runs)", *_ms(imports)])
        total = sum(summarize(column).p50 for column in columns)
        rows.append(["sum of the phase medians", f"{total * 1e3:.0f}", "", ""])
    rows.append(["reference: gpumesh --help (start-up floor)", *_ms(summaries[HELP])])
    rows.append(["reference: gpumesh connect --fresh (whole process)", *_ms(summaries[CONNECT])])
    if results.dial_ms:
        dial = summarize([ms / 1e3 for ms in results.dial_ms])
        rows.append(["  of which dial + proof, as connect reports it", *_ms(dial)])
    print_rows(["", "p50 ms", "p90 ms", "min ms"], rows)
    if not results.phases:
        print("  (no phase split: the job records lacked a time)")
    print("  phases: from the provider's and the client's job records (one clock);")
    print("  the provider removes the container after the end is told; the CLI's imports")
    print("  load before run's request is sent; -X importtime inflates imports a little")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time `gpumesh run --peer P --image IMG echo hi` (fresh CLI process, "
        "local `gpumesh share` provider) next to `docker run --rm IMG echo hi` and "
        "`ssh host docker run ...`, in one run, and split GPUMesh's time into phases.",
    )
    parser.add_argument("--runs", type=int, default=10, help="timed runs of each (default 10)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 runs of each")
    parser.add_argument(
        "--image", default=DEFAULT_IMAGE, help=f"image to run (default {DEFAULT_IMAGE})"
    )
    parser.add_argument("--no-ssh", action="store_true", help="skip the ssh baseline")
    parser.add_argument(
        "--group",
        metavar="NAME",
        help="submit the timed `gpumesh run` with --group NAME (bob's group, alice its one "
        "member) instead of --peer alice; the plain run then takes turns as a row of its own",
    )
    parser.add_argument(
        "--outputs",
        metavar="PATH",
        help="add --outputs PATH to the timed `gpumesh run` (its files come home into a "
        "temporary folder); the plain run then takes turns as a row of its own",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also time `gpumesh run` of git revision REV (provider and consumer both, "
        "from `git archive`), side by side in the same loop",
    )
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
            results = measure(args, Path(tmp))
    except KeyboardInterrupt:
        return interrupted()
    report(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
