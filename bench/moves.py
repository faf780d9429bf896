"""Jobs that move: how long a group's job takes to run again elsewhere when its
provider is lost or paused, and how much of its work it loses, next to a plain start.

Set-up, all on this machine, with the real CLI: three temporary homes, each served
by its own node process; two providers (``alice``, ``carol``: ``gpumesh share
--detach`` on free UDP ports of 127.0.0.1) and a consumer (``bob``) paired with both,
who has them in his group ``bench`` and ``job_lease`` set to ``--job-lease`` (3s).

Each trial:

1. bob runs ``gpumesh run --group bench --detach --outputs /out --outputs-to DIR --
   sh -c COUNTER`` (a new CLI process): a counter that resumes from the checkpoint it
   finds in its outputs folder and writes the next count there every second, up to
   10. Timed from the spawn to the start of its container: the **plain start**, the
   reference.
2. Once bob's copy of the checkpoint reached 2, and after a random wait of up to one
   checkpoint interval (so that the loss falls anywhere between two checkpoints), the
   job's provider goes away:

   * ``lost`` (a machine switched off): its node process gets SIGKILL (``status
     --json``'s ``agent_pid``), at once the job's container is killed through the
     Docker API, and a UDP socket that never answers takes the provider's port
     (packets vanish, as they do towards a machine that is off; ``--loss refused``
     leaves the port closed instead, so the kernel refuses them at once, which no
     switched-off machine does). Timed from the clock read just before the SIGKILL.
   * ``pause`` (the owner takes the machine back): the provider's owner runs
     ``gpumesh pause --grace 0s``. Timed from its spawn.

3. ... until the job's new container starts on the other provider: the **move**.

"A container running" is the Docker engine's own ``start`` event for the job's
container (``docker events``, filtered on the job's and the provider's labels, with
the engine's ``timeNano``: this machine's clock): the most exact signal there is, no
polling. The loss's time is ``time.time()`` on the same clock.

**Lost work**: the last count the first copy wrote (read from its outputs folder on
the provider's disk every 20 ms from just before the loss until the job runs again,
and once more after) minus the count the second copy resumed from (its first line,
``start N attempt 2``). Goal: at most one checkpoint interval (1 count).

Every trial checks that the job ended ``succeeded`` (exit 0) after exactly two hops
(the first ``unreachable`` or ``preempted``), that its logs show the first copy
starting from 0 and the second resuming (attempt 2) and counting on to 10, and that
bob's checkpoint says ``10 2``; otherwise the script stops with what it found. Then
the lost provider comes back (``gpumesh share --detach``, its port freed) or resumes
(``gpumesh resume``), and bob connects to both (``gpumesh connect``, untimed) before
the next trial.

Side by side: the ``lost`` and the ``pause`` trials alternate (which goes first
alternates every round), each with its own plain start; figures are the median and
p90 of ``--runs`` trials of each. Goals (medians): a move after a loss within
``job_lease`` + 2 x the plain start; after a pause within 2 x the plain start. They
are reported, never turned into an exit status.

Where the time goes, from the same trials: when bob's node process ended the hop (its
store, polled every 25 ms from the loss) and when the new provider accepted the job
(its job record), beside the same split of the plain start (spawn, the provider's
acceptance, the container's start).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _benchlib import (
    Summary,
    ensure_bytecode,
    exit_cleanly_on_sigterm,
    free_port,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from bulk import gpumesh_command
from dispatch import DEFAULT_IMAGE, docker_ready, remove_containers
from gpumesh.errors import GPUMeshError
from gpumesh.protocol.states import FINAL_STATES, JobRole
from gpumesh.runtime.base import LABEL_JOB, LABEL_NODE
from gpumesh.runtime.holders import LABEL_HOLDER_OF
from gpumesh.store.home import Home
from gpumesh.units import parse_duration

GROUP = "bench"
PROVIDERS = ("alice", "carol")
CONSUMER = "bob"
COUNT_TO = 10
LOSE_AFTER = 2
"""bob's checkpoint count before the provider goes away."""
CEILING = 120.0
"""Seconds any one wait may take before the script stops (never a verdict on speed)."""
LOST = "lost"
PAUSE = "pause"
TRIGGERS = (LOST, PAUSE)
COUNTER = (
    'f="$GPUMESH_OUTPUTS/count"; n=0; [ -f "$f" ] && n=$(cut -d" " -f1 "$f"); '
    'echo "start $n attempt $GPUMESH_ATTEMPT resumed $GPUMESH_RESUMED"; '
    f"while [ $n -lt {COUNT_TO} ]; do n=$((n+1)); "
    'echo "$n $GPUMESH_ATTEMPT" > "$f.tmp"; mv "$f.tmp" "$f"; echo "count $n"; sleep 1; done'
)
"""Resumes from its checkpoint (``count ATTEMPT``), then counts on, writing the
checkpoint each second (written, then renamed into place) and saying each count."""


# --- the nodes ---------------------------------------------------------------------------


@dataclass
class Member:
    name: str
    home: Path
    port: int | None = None
    node_id: str = ""


class Trio:
    """alice and carol sharing, bob with both in his group: real node processes."""

    def __init__(self, tmp: Path, image: str, lease: str) -> None:
        self.members = {
            name: Member(name, tmp / name, free_port(kind=socket.SOCK_DGRAM)) for name in PROVIDERS
        }
        self.bob = Member(CONSUMER, tmp / CONSUMER)
        self.image = image
        self.lease = lease

    def cli(
        self, who: Member, *args: str, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``gpumesh ARGS`` for ``who``'s home; any failure stops the script."""
        command = [*gpumesh_command(), *args]
        try:
            done = subprocess.run(
                command,
                env=member_env(who.home),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{who.name}: `gpumesh {' '.join(args)}` hung") from None
        if check and done.returncode != 0:
            raise SystemExit(
                f"{who.name}: `gpumesh {' '.join(args)}` failed (exit {done.returncode}): "
                f"{one_line(done.stderr or done.stdout)}"
            )
        return done

    def set_up(self) -> None:
        everyone = [*self.members.values(), self.bob]
        for who in everyone:
            self.cli(who, "init", "--name", who.name)
            self.cli(who, "config", "set", "listen_host", "127.0.0.1")
            self.cli(who, "config", "set", "image", self.image)
            if who.port is not None:
                self.cli(who, "config", "set", "listen_port", str(who.port))
        self.cli(self.bob, "config", "set", "job_lease", self.lease)
        for provider in self.members.values():
            self.cli(provider, "share", "--detach", timeout=120)
            provider.node_id = self.status(provider)["node_id"]
            self.cli(self.bob, "pair", self.code(provider), "--offline")
            self.cli(provider, "pair", self.code(self.bob), "--offline")
        self.cli(self.bob, "group", "create", GROUP)
        for name in PROVIDERS:
            self.cli(self.bob, "group", "add", GROUP, name)

    def code(self, who: Member) -> str:
        return self.cli(who, "pair-code").stdout.strip()

    def status(self, who: Member) -> dict[str, Any]:
        status: dict[str, Any] = json.loads(self.cli(who, "status", "--json").stdout)
        return status

    def by_id(self, node_id: str) -> Member:
        for member in self.members.values():
            if member.node_id == node_id:
                return member
        raise SystemExit(f"a job container started on a node not of this run ({node_id})")

    def other(self, member: Member) -> Member:
        return next(m for m in self.members.values() if m is not member)

    def tear_down(self) -> None:
        """Stop every node process this run started and remove the providers' containers."""
        for who in [self.bob, *self.members.values()]:
            if not (who.home / "identity.key").exists():
                continue
            with contextlib.suppress(SystemExit):
                self.cli(who, "daemon", "stop", timeout=60, check=False)
            stop_node_process(who.home)
        for member in self.members.values():
            if member.node_id:
                remove_containers(f"{LABEL_NODE}={member.node_id}")
                remove_containers(f"{LABEL_HOLDER_OF}={member.node_id}")


def one_line(text: str) -> str:
    """A command's output as one line (its last non-empty one), for a failure message."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(nothing)"


def member_env(home: Path) -> dict[str, str]:
    env = dict(os.environ, GPUMESH_HOME=str(home))
    for name in ("GPUMESH_LOG", "GPUMESH_PEER", "GPUMESH_IMAGE"):
        env.pop(name, None)
    return env


def stop_node_process(home: Path) -> None:
    """SIGKILL the node process the home's record names, if it still runs (a
    ``daemon stop`` that did not stop it)."""
    try:
        pid = int(json.loads((home / "node.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return
    if running(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


# --- what the engine and the stores say -----------------------------------------------


@dataclass(frozen=True)
class Start:
    at: float
    """The engine's time of the start (``timeNano``)."""
    container_id: str
    job_id: str
    node_id: str


class Starts:
    """The engine's container start events for GPUMesh jobs, as they come."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [
                "docker", "events", "--format", "{{json .}}",
                "--filter", "type=container", "--filter", "event=start",
                "--filter", f"label={LABEL_JOB}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        self._seen: list[Start] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                event = json.loads(line)
                labels = event["Actor"]["Attributes"]
                start = Start(
                    event["timeNano"] / 1e9, event["id"], labels[LABEL_JOB], labels[LABEL_NODE]
                )
            except (ValueError, KeyError, TypeError):
                continue
            with self._changed:
                self._seen.append(start)
                self._changed.notify_all()

    def find(self, job_id: str, not_on: str = "") -> Start | None:
        with self._changed:
            for start in self._seen:
                if start.job_id == job_id and start.node_id != not_on:
                    return start
        return None

    def wait(self, job_id: str, what: str) -> Start:
        deadline = time.monotonic() + CEILING
        with self._changed:
            while (found := self.find(job_id)) is None:
                if self._proc.poll() is not None:
                    raise SystemExit("`docker events` ended")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SystemExit(f"{what}: no container started within {CEILING:g}s")
                self._changed.wait(min(left, 1.0))
        return found

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@contextlib.contextmanager
def store_of(who: Member) -> Iterator[Home]:
    home = Home(who.home)
    try:
        yield home
    finally:
        home.close()


def accepted_at(who: Member, job_id: str) -> float | None:
    """When ``who`` accepted the job (its record's ``created_at``)."""
    with store_of(who) as home:
        job = home.store.job(JobRole.HOSTED, job_id)
        return None if job is None else float(job.created_at)


def checkpoint(path: Path) -> int:
    """The count of a checkpoint file (0: none, or not readable now)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0


class LastCount:
    """The highest count a copy's checkpoint file showed, read every 20 ms."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last = checkpoint(path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.last = max(self.last, checkpoint(self.path))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.last = max(self.last, checkpoint(self.path))
        return self.last


def outputs_folder(container_id: str) -> Path:
    """Where the container's ``/out`` is on this machine (the provider's folder)."""
    found = subprocess.run(
        ["docker", "inspect", "--format", "{{json .Mounts}}", container_id],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if found.returncode != 0:
        raise SystemExit(f"docker inspect {container_id}: {one_line(found.stderr)}")
    for mount in json.loads(found.stdout):
        if mount.get("Destination") == "/out":
            return Path(mount["Source"])
    raise SystemExit(f"the job's container {container_id} has no /out mount")


# --- one trial ---------------------------------------------------------------------------


@dataclass
class Trial:
    trigger: str
    plain: float
    """Seconds from the spawn of ``run --detach`` to the container's start."""
    plain_accepted: float | None
    """... of which until the provider accepted the job."""
    move: float
    """Seconds from the loss (or the pause's spawn) to the new container's start."""
    left: float
    """... of which until bob's node process ended the hop."""
    accepted: float | None
    """... until the new provider accepted the job."""
    lost_work: int
    last_count: int
    resumed_from: int
    pause_seconds: float | None = None
    """The pause command's own duration."""


def one_trial(
    trio: Trio, starts: Starts, engine: Any, trigger: str, args: argparse.Namespace, dest: Path
) -> Trial:
    bob = trio.bob
    for name in PROVIDERS:  # bob's sessions warm, as between a user's commands
        trio.cli(bob, "connect", name)
    command = [
        *gpumesh_command(),
        "run", "--group", GROUP, "--detach", "--outputs", "/out", "--outputs-to", str(dest),
        "--", "sh", "-c", COUNTER,
    ]  # fmt: skip
    spawned = time.time()
    done = subprocess.run(
        command,
        env=member_env(bob.home),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CEILING,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(
            f"`gpumesh run --group` failed (exit {done.returncode}): {one_line(done.stderr)}"
        )
    job_id = done.stdout.split()[-1]
    first_start = starts.wait(job_id, f"job {job_id}")
    first = trio.by_id(first_start.node_id)
    second = trio.other(first)
    first_accepted = accepted_at(first, job_id)
    copy = outputs_folder(first_start.container_id) / "count"
    pid = int(trio.status(first)["agent_pid"])
    # The loss falls anywhere between two checkpoints.
    deadline = time.monotonic() + CEILING
    while checkpoint(dest / "count") < LOSE_AFTER:
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job_id}: its checkpoint never reached {LOSE_AFTER} at home")
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 1.0))

    watch = LastCount(copy)
    silent: socket.socket | None = None
    pause: subprocess.Popen[str] | None = None
    pause_seconds: float | None = None
    lost_at = time.time()
    if trigger == LOST:
        os.kill(pid, signal.SIGKILL)
        engine.api.kill(first_start.container_id)
        if args.loss == "silent":
            silent = hold_port(first)
    else:
        pause = subprocess.Popen(
            [*gpumesh_command(), "pause", "--grace", "0s"],
            env=member_env(first.home),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        left_at: float | None = None
        job = None
        with store_of(bob) as home:
            deadline = time.monotonic() + CEILING
            while (moved := starts.find(job_id, not_on=first.node_id)) is None or left_at is None:
                if left_at is None:
                    job = home.store.job(JobRole.SUBMITTED, job_id)
                    if job is None:
                        raise SystemExit(f"bob's store lost job {job_id}")
                    if job.hops or moved is not None:
                        left_at = time.time()
                    elif job.state in FINAL_STATES:
                        raise SystemExit(
                            f"job {job_id} ended {job.state} without moving: {job.message}"
                        )
                if pause is not None and pause_seconds is None and pause.poll() is not None:
                    pause_seconds = time.time() - lost_at
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"job {job_id} did not run again within {CEILING:g}s "
                        f"(bob's record: {job.state if job else '?'}, {job.message if job else ''})"
                    )
                time.sleep(0.025)
        last = watch.stop()
        if pause is not None:
            out, err = pause.communicate(timeout=CEILING)
            if pause_seconds is None:
                pause_seconds = time.time() - lost_at
            if pause.returncode != 0:
                raise SystemExit(f"`gpumesh pause --grace 0s` failed: {one_line(err or out)}")
        # The provider comes back (its copy then hears that the job moved, and bob can
        # read the first copy's logs again), or takes guests again.
        if silent is not None:
            silent.close()
            silent = None
        if trigger == LOST:
            trio.cli(first, "share", "--detach", timeout=120)
        else:
            trio.cli(first, "resume")
        resumed = finished(trio, job_id, first, second, trigger, dest)
    finally:
        watch.stop()
        if pause is not None and pause.poll() is None:
            pause.kill()
            pause.communicate()
        if silent is not None:
            silent.close()
    new_accepted = accepted_at(second, job_id)
    return Trial(
        trigger=trigger,
        plain=first_start.at - spawned,
        plain_accepted=None if first_accepted is None else first_accepted - spawned,
        move=moved.at - lost_at,
        left=left_at - lost_at,
        accepted=None if new_accepted is None else new_accepted - lost_at,
        lost_work=last - resumed,
        last_count=last,
        resumed_from=resumed,
        pause_seconds=pause_seconds,
    )


def hold_port(member: Member) -> socket.socket:
    """A socket that never answers, on the provider's UDP port (once the killed
    process's own socket is gone)."""
    assert member.port is not None
    deadline = time.monotonic() + 10
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind(("127.0.0.1", member.port))
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{member.name}'s port was not freed by its killed process"
                ) from None
            time.sleep(0.005)
            continue
        return sock


STARTS = re.compile(r"^start (\d+) attempt (\d+) resumed", re.MULTILINE)
COUNTS = re.compile(r"^count (\d+)$", re.MULTILINE)


def finished(
    trio: Trio, job_id: str, first: Member, second: Member, trigger: str, dest: Path
) -> int:
    """Wait for the job's end and check it ran to its full count after one move;
    the count the second copy resumed from."""
    deadline = time.monotonic() + CEILING
    with store_of(trio.bob) as home:
        while (job := home.store.job(JobRole.SUBMITTED, job_id)) is None or (
            job.state not in FINAL_STATES
        ):
            if time.monotonic() > deadline:
                raise SystemExit(f"job {job_id} did not end within {CEILING:g}s")
            time.sleep(0.2)
    listed = json.loads(trio.cli(trio.bob, "jobs", "--json").stdout)
    entry = next((j for j in listed if j["job_id"] == job_id), None)
    if entry is None:
        raise SystemExit(f"`gpumesh jobs --json` does not list job {job_id}")
    hops = [(h["peer"], h["ended"]) for h in entry["hops"]]
    expected_end = "unreachable" if trigger == LOST else "preempted"
    if (entry["state"], entry["exit_code"]) != ("succeeded", 0) or hops != [
        (first.name, expected_end),
        (second.name, "succeeded"),
    ]:
        raise SystemExit(
            f"job {job_id} ({trigger}) ended {entry['state']} (exit {entry['exit_code']}, "
            f"{entry['message']!r}) after hops {entry['hops']}"
        )
    logs = trio.cli(trio.bob, "logs", job_id).stdout
    found = [(int(n), int(attempt)) for n, attempt in STARTS.findall(logs)]
    if len(found) != 2 or found[0] != (0, 1) or found[1][1] != 2:
        raise SystemExit(
            f"job {job_id}: its logs show starts (count, attempt) {found}, not (0, 1) then a "
            "resume at attempt 2"
        )
    resumed = found[1][0]
    later = [int(n) for n in COUNTS.findall(logs.split("start", 2)[2])]
    if later != list(range(resumed + 1, COUNT_TO + 1)):
        raise SystemExit(f"job {job_id}: the second copy counted {later} from {resumed}")
    home_copy = (dest / "count").read_text() if (dest / "count").exists() else ""
    if home_copy != f"{COUNT_TO} 2\n":
        raise SystemExit(f"job {job_id}: bob's checkpoint is {home_copy!r}, not '{COUNT_TO} 2'")
    return resumed


# --- the run -----------------------------------------------------------------------------


@dataclass
class Results:
    trials: list[Trial] = field(default_factory=list)

    def of(self, trigger: str) -> list[Trial]:
        return [t for t in self.trials if t.trigger == trigger]


def warm_up(trio: Trio, starts: Starts) -> None:
    """One untimed job on each provider (its job network and spare holders ready),
    which also proves the engine's events arrive."""
    for name in PROVIDERS:
        done = trio.cli(trio.bob, "run", "--peer", name, "--", "echo", "hi", timeout=CEILING)
        if done.stdout != "hi\n":
            raise SystemExit(f"the warm-up job on {name} printed {done.stdout!r}")
        with store_of(trio.bob) as home:
            (job,) = home.store.jobs(limit=1, role=JobRole.SUBMITTED)
        starts.wait(job.job_id, f"the warm-up job on {name}")


def measure(args: argparse.Namespace, tmp: Path) -> Results:
    import docker

    docker_ready(args.image)
    results = Results()
    trio = Trio(tmp, args.image, args.job_lease)
    engine = docker.from_env()
    starts = Starts()
    try:
        trio.set_up()
        warm_up(trio, starts)
        print(
            f"Timing {args.runs} moves after a lost provider ({args.loss}) and {args.runs} "
            f"after a pause, alternating, job_lease {args.job_lease}...",
            flush=True,
        )
        for index in range(args.runs):
            order = TRIGGERS if index % 2 == 0 else TRIGGERS[::-1]
            for trigger in order:
                dest = tmp / "outputs" / f"{trigger}-{index}"
                trial = one_trial(trio, starts, engine, trigger, args, dest)
                results.trials.append(trial)
                print(
                    f"  {index + 1:2d} {trigger:5s}  plain start {trial.plain:5.2f} s, "
                    f"move {trial.move:5.2f} s (hop ended {trial.left:5.2f} s), lost work "
                    f"{trial.lost_work} ({trial.last_count} -> {trial.resumed_from})",
                    flush=True,
                )
    finally:
        starts.close()
        trio.tear_down()
        engine.close()
    return results


# --- the report --------------------------------------------------------------------------


def _s(summary: Summary) -> list[str]:
    return [f"{summary.p50:.2f}", f"{summary.p90:.2f}", f"{summary.low:.2f}", f"{summary.high:.2f}"]


def report(args: argparse.Namespace, results: Results) -> None:
    lease = parse_duration(args.job_lease)
    plain = summarize([t.plain for t in results.trials])
    lost, paused = results.of(LOST), results.of(PAUSE)
    rows = {
        f"move after a lost provider ({args.loss})": (lost, lease + 2 * plain.p50),
        "move after `pause --grace 0s`": (paused, 2 * plain.p50),
    }
    print(
        f"\nA group's job moving between two providers on this machine, {args.runs} trials "
        f"of each kind, alternating;\njob_lease {lease:g} s; seconds to the container's start "
        "(the engine's event)"
    )
    table = [["plain `run --group --detach`: spawn to start", *_s(plain), "", ""]]
    for name, (trials, bound) in rows.items():
        summary = summarize([t.move for t in trials])
        table.append([name, *_s(summary), f"{bound:.2f}", f"{summary.p50 / bound:.2f}x"])
    print_rows(["", "p50 s", "p90 s", "min s", "max s", "goal <=", "p50/goal"], table)
    print(f"  plain start: all {plain.n} trials' own starts (each trial starts its job so)")
    for name, (trials, bound) in rows.items():
        p50 = summarize([t.move for t in trials]).p50
        verdict = "met" if p50 <= bound else "missed"
        print(
            f"  goal: {name} median <= {bound:.2f} s: {p50:.2f} s, {verdict} "
            f"({p50 / plain.p50:.1f}x the plain start)"
        )

    print("\nWhere the time goes (medians of the same trials, seconds from the trigger)")
    plain_accepted = [t.plain_accepted for t in results.trials if t.plain_accepted is not None]
    split = [
        ["plain: provider accepted the job", *_s(summarize(plain_accepted))],
        ["plain: container started", *_s(plain)],
    ]
    for trigger, trials in ((LOST, lost), (PAUSE, paused)):
        phases: list[tuple[str, list[float]]] = []
        if trigger == PAUSE:
            phases.append(("the pause command returned", [t.pause_seconds or 0 for t in trials]))
        phases.append(("bob's node process ended the hop", [t.left for t in trials]))
        accepted = [t.accepted for t in trials if t.accepted is not None]
        if accepted:
            phases.append(("the other provider accepted the job", accepted))
        phases.append(("its container started", [t.move for t in trials]))
        split += [[f"{trigger}: {what}", *_s(summarize(values))] for what, values in phases]
    print_rows(["", "p50 s", "p90 s", "min s", "max s"], split)
    every = min(5.0, max(0.5, lease / 6))
    print(
        f"  bob's node process asks the job's provider every {every:g} s (job_lease / 6, "
        "0.5 to 5 s),\n  no ask outlasting the lease; the hop ends job_lease after the "
        "provider's last answer"
    )

    print("\nLost work (counts; the job checkpoints every second; goal <= 1)")
    for trigger, trials in ((LOST, lost), (PAUSE, paused)):
        values = [t.lost_work for t in trials]
        verdict = "met" if max(values) <= 1 else "missed"
        print(f"  {trigger}: {values}, max {max(values)}: {verdict}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time how long a `gpumesh run --group` job takes to start again on the "
        "group's other provider after its provider is lost (node process killed, container "
        "killed, port silent) or paused (`pause --grace 0s`), next to a plain "
        "`run --group --detach` start in the same trials, and how much work it loses "
        "(a counter checkpointing every second into --outputs).",
    )
    parser.add_argument("--runs", type=int, default=10, help="trials of each kind (default 10)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 trial of each")
    parser.add_argument(
        "--job-lease", default="3s", help="bob's job_lease (default 3s); the goal scales with it"
    )
    parser.add_argument(
        "--loss",
        choices=("silent", "refused"),
        default="silent",
        help="silent (default): a socket that never answers takes the lost provider's port, "
        "as towards a machine switched off; refused: the port stays closed and the kernel "
        "refuses what reaches it",
    )
    parser.add_argument(
        "--image", default=DEFAULT_IMAGE, help=f"image with a busybox sh (default {DEFAULT_IMAGE})"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 1
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    try:
        lease = parse_duration(args.job_lease)
    except GPUMeshError:
        lease = 0.0
    if lease <= 0:
        parser.error(f"--job-lease {args.job_lease!r} is not a positive duration")
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
