"""Jobs move: a group's job leaves a provider that is paused, killed or cut off, and
resumes on another member from the checkpoint it brought home; only its newest copy
delivers. Real `gpumesh share` processes, the real Docker engine, the real CLI (bob's
node process keeps the job); a cut link is real iptables in a network namespace of
the test's own, where the cut-off provider runs (this machine's firewall is left
alone).

The job is a counter that checkpoints every second into its outputs and resumes
from the checkpoint it finds there. Every wait is bounded by a generous ceiling;
``job_lease`` and the pause's grace are a few seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpumesh.errors import ExitCode
from tests.integration.conftest import gpumesh, ok, sharing_trio, until
from tests.integration.node import wait_gone
from tests.integration.test_cli import _one_line_error

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

_CEILING = 90.0
_COUNT_TO = 15
# Resumes from its checkpoint, then counts on, writing the checkpoint each second
# (count, then the start it was written by) and saying each count.
_COUNTER = (
    'f="$GPUMESH_OUTPUTS/count"; n=0; [ -f "$f" ] && n=$(cut -d" " -f1 "$f"); '
    'echo "start $n attempt $GPUMESH_ATTEMPT resumed $GPUMESH_RESUMED"; '
    f"while [ $n -lt {_COUNT_TO} ]; do n=$((n+1)); "
    'echo "$n $GPUMESH_ATTEMPT" > "$f.tmp"; mv "$f.tmp" "$f"; echo "count $n"; sleep 1; done'
)


def _start(bob: Path, home: Path, *flags: str) -> str:
    out = ok(
        bob,
        "run",
        "--group",
        "research",
        "--detach",
        "--outputs",
        "/out",
        "--outputs-to",
        str(home),
        *flags,
        "--",
        "sh",
        "-c",
        _COUNTER,
        timeout=60,
    )
    return out.strip().split()[-1]


def _listed(home: Path, job_id: str) -> dict[str, Any]:
    result = gpumesh(home, "jobs", "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return next(j for j in json.loads(result.stdout) if j["job_id"] == job_id)


def _count(home: Path) -> int:
    """The checkpoint's count that came home (0: none yet)."""
    try:
        return int((home / "count").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0


def _ended(bob: Path, job_id: str) -> dict[str, Any]:
    return until(
        lambda: (j := _listed(bob, job_id))["state"] in ("succeeded", "failed", "preempted") and j,
        f"job {job_id} to end",
        within=_CEILING,
        every=0.5,
    )


def _starts(logs: str) -> list[tuple[int, int]]:
    """(count it started from, its attempt) of every start the logs show."""
    found = re.findall(r"^start (\d+) attempt (\d+) resumed", logs, re.MULTILINE)
    return [(int(n), int(attempt)) for n, attempt in found]


def _check_counted(bob: Path, job_id: str, outputs: Path, checkpoint: int) -> str:
    """The job counted to the end on its second provider, resumed from a checkpoint
    at least ``checkpoint`` (never from 0), and its outputs are the newest hop's."""
    logs = gpumesh(bob, "logs", job_id, timeout=60)
    text = logs.stdout
    starts = _starts(text)
    assert starts[0] == (0, 1), text
    assert len(starts) == 2, text
    resumed_from, attempt = starts[1]
    assert attempt == 2
    assert resumed_from >= max(checkpoint, 1), (resumed_from, checkpoint)
    later = [int(n) for n in re.findall(r"^count (\d+)$", text.split("start", 2)[2], re.M)]
    assert later == list(range(resumed_from + 1, _COUNT_TO + 1))
    assert (outputs / "count").read_text() == f"{_COUNT_TO} 2\n"
    return logs.stderr


def _homes(trio: tuple[Path, Path, Path]) -> dict[str, Path]:
    alice, carol, _bob = trio
    return {"alice-pc": alice, "carol": carol}


def _running_on(bob: Path, job_id: str, outputs: Path, past: int) -> str:
    """The provider the job runs on once its checkpoint passed ``past``."""
    until(lambda: _count(outputs) > past, f"the checkpoint past {past}", within=_CEILING)
    return str(_listed(bob, job_id)["hops"][-1]["peer"])


def _counting(bob: Path, tmp_path: Path, past: int) -> tuple[Path, str, str]:
    """The counter started on the group with bob's job_lease 3s: its outputs folder,
    its id, and the provider it runs on once its checkpoint passed ``past``."""
    ok(bob, "config", "set", "job_lease", "3s")
    outputs = tmp_path / "out"
    job_id = _start(bob, outputs)
    return outputs, job_id, _running_on(bob, job_id, outputs, past)


def test_a_paused_provider_moves_the_job_which_resumes_from_its_checkpoint(
    trio: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _alice, _carol, bob = trio
    outputs, job_id, first = _counting(bob, tmp_path, 2)
    follower = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "logs", "-f", job_id],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        paused = ok(_homes(trio)[first], "pause", "--grace", "2s", timeout=90)
        assert "1 guest job preempted" in paused
        checkpoint = _count(outputs)
        followed, followed_err = follower.communicate(timeout=_CEILING)
    finally:
        follower.kill()
    # One `logs -f` saw the whole job, across the move, nothing lost or repeated.
    assert follower.returncode == 0, followed_err
    assert _starts(followed)[0] == (0, 1)
    assert followed == gpumesh(bob, "logs", job_id).stdout
    assert f"--- moved from {first} (preempted: " in followed_err
    job = _ended(bob, job_id)
    assert (job["state"], job["exit_code"]) == ("succeeded", 0), job
    hops = job["hops"]
    assert [h["peer"] for h in hops] == [first, "carol" if first == "alice-pc" else "alice-pc"]
    assert (hops[0]["ended"], hops[0]["epoch"], hops[1]["epoch"]) == ("preempted", 1, 2)
    assert hops[0]["reason"] == f"{first}'s owner paused sharing"
    stderr = _check_counted(bob, job_id, outputs, checkpoint)
    assert f"--- moved from {first} (preempted: {first}'s owner paused sharing) to " in stderr


def _moved(bob: Path, job_id: str) -> dict[str, Any]:
    return until(
        lambda: len((j := _listed(bob, job_id))["hops"]) == 2 and j,
        f"job {job_id} to move",
        within=_CEILING,
        every=0.3,
    )


def _stopped_copy(home: Path, job_id: str) -> None:
    """``home``'s copy of the job stops: it heard that the job moved."""
    hosted = until(
        lambda: (j := _listed(home, job_id))["state"] != "running" and j,
        "the left provider to stop its copy",
        within=_CEILING,
        every=0.3,
    )
    assert (hosted["state"], hosted["message"]) == (
        "cancelled",
        "moved to another provider by its submitter",
    )


def test_a_killed_provider_loses_the_job_after_job_lease_and_its_copy_stops_when_it_returns(
    trio: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _alice, _carol, bob = trio
    outputs, job_id, first = _counting(bob, tmp_path, 2)
    home = _homes(trio)[first]
    pid = json.loads(ok(home, "status", "--json"))["agent_pid"]
    os.kill(pid, signal.SIGKILL)  # no goodbye; its container runs on
    assert wait_gone(pid)
    checkpoint = _count(outputs)
    hop = _moved(bob, job_id)["hops"][0]
    assert hop["ended"] == "unreachable"
    assert hop["reason"] == f"{first} did not answer for 3s (job_lease)"
    # It comes back while its copy still counts: it hears that the job moved, stops
    # its copy, and nothing of it reaches bob's outputs.
    ok(home, "share", "--detach", timeout=90)
    _stopped_copy(home, job_id)
    job = _ended(bob, job_id)
    assert job["state"] == "succeeded", job
    _check_counted(bob, job_id, outputs, checkpoint)


@dataclass(frozen=True)
class Apart:
    """A network namespace of a test's own, joined to this machine's by a veth pair
    on a /30 of its own."""

    name: str
    address: str
    """Its end of the pair, where this machine reaches what listens inside."""

    def inside(self, *argv: str) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def apart(network_lab: None) -> Iterator[Apart]:
    """:class:`Apart`, removed with whatever still runs in it, whatever the test did.
    Its name and /30 are random, so that test processes side by side never share
    one (10.220-249.x.y: no other test's range)."""
    tag = secrets.token_hex(3)
    name, here, there = f"gmv{tag}", f"gmv{tag}h", f"gmv{tag}n"
    net = f"10.{random.randrange(220, 250)}.{random.randrange(256)}"
    first = 4 * random.randrange(64)
    ns = Apart(name=name, address=f"{net}.{first + 2}")
    _ip("netns", "add", name)
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there, "netns", name)
        _ip("addr", "add", f"{net}.{first + 1}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", name, "addr", "add", f"{ns.address}/30", "dev", there)
        _ip("-n", name, "link", "set", there, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield ns
    finally:
        try:
            _empty(name)
        finally:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", here)  # both ends, and its route
            _ip("netns", "del", name)


def _pids(namespace: str) -> list[int]:
    found = subprocess.run(
        ["ip", "netns", "pids", namespace], check=False, capture_output=True, text=True, timeout=30
    )
    return [int(pid) for pid in found.stdout.split()]


def _empty(namespace: str) -> None:
    """Kill what still runs in ``namespace`` (a node process started there), and
    wait until it is gone."""
    for pid in _pids(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    until(lambda: not _pids(namespace), f"the processes in {namespace} to end", within=30)


@pytest.fixture
def carol_apart(
    tmp_path: Path, gpumesh_processes: None, apart: Apart
) -> Iterator[tuple[Path, Path, Path]]:
    """:func:`trio` where carol's node process runs in :func:`apart`'s namespace,
    listening at its end of the veth pair (her pairing code's one address). The
    engine and its containers stay in this machine's namespace, so job network
    rules made in hers would filter nothing: her jobs get Docker's bridge."""
    homes = sharing_trio(
        tmp_path,
        carol_inside=apart.inside(),
        listen_host=apart.address,
        job_network="bridge",
    )
    with homes as (alice, carol, bob):
        agent = json.loads(ok(carol, "status", "--json"))
        assert agent["agent_pid"] in _pids(apart.name), (agent, _pids(apart.name))
        assert agent["listen"].startswith(f"{apart.address}:"), agent
        # Her pairing code gave bob that one address to dial.
        peers = {p["name"]: p for p in json.loads(ok(bob, "peers", "--json"))}
        assert peers["carol"]["addresses"] == [agent["listen"]], peers["carol"]
        yield alice, carol, bob


@contextlib.contextmanager
def _cut_off(apart: Apart, home: Path) -> Iterator[None]:
    """Drop every UDP packet to ``home``'s node, which runs in ``apart``, at its port,
    with a rule in that namespace while the block runs."""
    port = str(json.loads(ok(home, "status", "--json"))["listen"]).rsplit(":", 1)[1]
    rule = ["INPUT", "-p", "udp", "--dport", port, "-j", "DROP"]
    subprocess.run(apart.inside("iptables", "-w", "-I", *rule), check=True, timeout=30)
    try:
        yield
    finally:
        subprocess.run(apart.inside("iptables", "-w", "-D", *rule), check=False, timeout=30)


def test_a_provider_cut_off_loses_the_job_and_its_late_copy_delivers_nothing(
    carol_apart: tuple[Path, Path, Path], apart: Apart, tmp_path: Path
) -> None:
    alice, carol, bob = carol_apart
    ok(bob, "config", "set", "job_lease", "3s")
    outputs = tmp_path / "out"
    # The job starts on carol, whose link can be cut: alice is paused until it runs
    # there, then resumes, so that the move has somewhere to go.
    ok(alice, "pause", timeout=90)
    job_id = _start(bob, outputs)
    assert _running_on(bob, job_id, outputs, 2) == "carol"
    ok(alice, "resume")
    with _cut_off(apart, carol):
        checkpoint = _count(outputs)
        hop = _moved(bob, job_id)["hops"][0]
        assert hop["ended"] == "unreachable"
        # The cut-off copy runs on: its provider cannot tell a cut link from a
        # submitter asleep.
        assert _listed(carol, job_id)["state"] == "running"
    # The link heals: the copy stops, and what it wrote meanwhile never comes.
    _stopped_copy(carol, job_id)
    job = _ended(bob, job_id)
    assert job["state"] == "succeeded", job
    assert [h["peer"] for h in job["hops"]] == ["carol", "alice-pc"]
    _check_counted(bob, job_id, outputs, checkpoint)


def test_max_moves_ends_a_preempted_job_and_wait_places_one_when_a_member_resumes(
    trio: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    alice, carol, bob = trio
    job_id = _start(bob, tmp_path / "out", "--max-moves", "0")
    first = _running_on(bob, job_id, tmp_path / "out", 0)
    ok(_homes(trio)[first], "pause", "--grace", "1s", timeout=90)
    job = _ended(bob, job_id)
    assert job["state"] == "preempted"
    assert job["message"] == (
        f"moved 0 times (--max-moves 0); {first}: {first}'s owner paused sharing"
    )
    ok(_homes(trio)["carol" if first == "alice-pc" else "alice-pc"], "pause", timeout=90)

    refused = gpumesh(bob, "run", "--group", "research", "--", "true", timeout=60)
    _one_line_error(refused, ExitCode.USAGE, "paused by its owner")
    waiting = gpumesh(bob, "run", "--group", "research", "--wait", "5m", "-d", "--", "echo", "hi")
    assert waiting.returncode == 0, waiting.stderr
    assert "no outputs: a move restarts this job from the beginning" in waiting.stderr
    queued = waiting.stdout.strip()
    listed = _listed(bob, queued)
    assert (listed["state"], listed["hops"]) == ("queued", [])
    status = json.loads(ok(bob, "status", "--json"))
    (entry,) = status["queue"]
    assert (entry["job_id"], entry["moving"]) == (queued, False)
    assert "paused by its owner" in entry["message"]
    ok(carol, "resume")
    done = _ended(bob, queued)
    assert (done["state"], [h["peer"] for h in done["hops"]]) == ("succeeded", ["carol"])
    assert gpumesh(bob, "logs", queued).stdout == "hi\n"
    assert json.loads(ok(bob, "status", "--json"))["queue"] == []

    # A --peer job waits for its provider the same way, and a queued job cancels.
    ok(carol, "pause", timeout=90)
    ids = [
        gpumesh(bob, "run", "--peer", "carol", "--wait", "5m", "-d", "--", "echo", word).stdout
        for word in ("never", "later")
    ]
    never, later = (text.strip() for text in ids)
    assert _listed(bob, later)["state"] == "queued"
    cancelled = gpumesh(bob, "cancel", never)
    assert cancelled.returncode == 0, cancelled.stderr
    assert _listed(bob, never)["state"] == "cancelled"
    ok(carol, "resume")
    assert _ended(bob, later)["state"] == "succeeded"
    assert gpumesh(bob, "logs", later).stdout == "later\n"
    assert _listed(bob, never)["state"] == "cancelled"  # never placed after its cancel
    del alice


def test_a_provider_that_denies_you_loses_the_job_which_waits_for_a_member_to_resume(
    trio: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    alice, carol, bob = trio
    ok(bob, "config", "set", "job_lease", "3s")
    ok(carol, "pause", timeout=90)  # the job starts on alice-pc
    outputs = tmp_path / "out"
    job_id = _start(bob, outputs, "--wait", "5m")
    assert _running_on(bob, job_id, outputs, 2) == "alice-pc"
    ok(alice, "deny", "bob-laptop")
    checkpoint = _count(outputs)
    # Its only other member is paused: the job waits for it, moving.
    entry = until(
        lambda: next(iter(json.loads(ok(bob, "status", "--json"))["queue"]), None),
        "the job to wait in the queue",
        within=_CEILING,
    )
    assert (entry["job_id"], entry["moving"]) == (job_id, True)
    assert entry["wait_until"] is not None
    hop = _listed(bob, job_id)["hops"][0]
    assert (hop["peer"], hop["ended"]) == ("alice-pc", "denied")
    assert hop["reason"] == "alice-pc denied you: alice-pc has denied you access"
    assert "→ (moving: research)" in ok(bob, "jobs")
    ok(carol, "resume")
    job = _ended(bob, job_id)
    assert (job["state"], [h["peer"] for h in job["hops"]]) == ("succeeded", ["alice-pc", "carol"])
    logs = gpumesh(bob, "logs", job_id, timeout=60)
    # alice-pc no longer answers bob: its part of the output is not readable now.
    assert "its output there could not all be read" in logs.stderr
    resumed_from, attempt = _starts(logs.stdout)[-1]
    assert attempt == 2 and resumed_from >= max(checkpoint, 1)
    assert (outputs / "count").read_text() == f"{_COUNT_TO} 2\n"


def test_the_submitter_asleep_catches_up_without_moving_the_job(
    trio: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _alice, _carol, bob = trio
    outputs, job_id, first = _counting(bob, tmp_path, 1)
    ok(bob, "daemon", "stop")
    time.sleep(4)  # longer than job_lease: the job runs on where it is meanwhile
    job = _ended(bob, job_id)  # the listing starts bob's node process again
    assert job["state"] == "succeeded"
    assert [h["peer"] for h in job["hops"]] == [first]
    until(lambda: _count(outputs) == _COUNT_TO, "every checkpoint home", within=_CEILING)
    assert _starts(gpumesh(bob, "logs", job_id).stdout) == [(0, 1)]


def test_bad_moves_and_waits_are_refused_in_one_line(trio: tuple[Path, Path, Path]) -> None:
    _alice, _carol, bob = trio
    for args, message in [
        (["--group", "research", "--max-moves", "11"], "--max-moves must be 0 to 10, got 11"),
        (["--peer", "carol", "--max-moves", "2"], "--max-moves (max_moves:) needs --group"),
        (["--group", "research", "--wait", "soon"], "--wait 'soon' is not a duration"),
    ]:
        _one_line_error(gpumesh(bob, "run", *args, "--", "true"), ExitCode.USAGE, message)
    _one_line_error(
        gpumesh(bob, "config", "set", "job_lease", "0"),
        ExitCode.USAGE,
        "invalid job_lease '0': it must be longer than 0",
    )
    note = gpumesh(bob, "run", "--group", "research", "--", "true", timeout=60)
    assert note.returncode == 0, note.stderr
    assert "no outputs: a move restarts this job from the beginning" in note.stderr
