"""A job's output however fast it prints, however slowly it is read: credited,
bounded by job_log_limit, and exact across a provider killed mid-job.

The jobs print numbered 1000-byte lines with busybox awk (tens of MB/s), so
every byte a reader gets can be checked against what the job printed, and
every gap against what the reader was told. What Docker itself keeps of a
container's log is bounded too (5 files of 20MB): a job printing more than
that while the provider is down shows what a reader is told of that loss.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpumesh.client.jobs import FINAL, JobCallbacks, follow_job, run_job
from gpumesh.client.node import Node
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.joboutput import EventSection, OutputPosition
from gpumesh.protocol.messages import JobLogs, JobOutput, JobStatus, decode_message
from gpumesh.store.jobs import JobRecord
from tests.integration import test_jobs
from tests.integration.conftest import gpumesh, pair_both, shared_pair
from tests.integration.test_cli import _free_udp_port
from tests.integration.test_cp import _start_agent
from tests.integration.test_jobs import providing, spec

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

# The same fixtures as the job tests: nodes whose job containers are removed afterwards.
cluster = test_jobs.cluster

T = TypeVar("T")
LINE = 1000
"""Bytes per line of a numbered job, newline included."""


def _awk(first: int, last: int) -> str:
    """Shell words printing numbered lines ``first`` to ``last`` of LINE bytes each."""
    return (
        f"""awk 'BEGIN {{ s = sprintf("%{LINE - 10}s", ""); gsub(/ /, "x", s); """
        f"""for (i = {first}; i <= {last}; i++) printf "%08d %s\\n", i, s }}'"""
    )


def _numbered_job(lines: int, exit_code: int = 0) -> list[str]:
    """A command printing ``lines`` numbered lines of LINE bytes, then exiting so."""
    return ["sh", "-c", f"{_awk(1, lines)}; exit {exit_code}"]


def _numbered(start: int, size: int) -> bytes:
    """Bytes ``start`` to ``start + size`` of what a numbered job prints."""
    first, last = start // LINE, (start + size - 1) // LINE
    text = b"".join(b"%08d %s\n" % (n + 1, b"x" * (LINE - 10)) for n in range(first, last + 1))
    return text[start - first * LINE :][:size]


class Checked(JobCallbacks):
    """A reader that checks the output of a numbered job as it comes: lines in
    order, none twice, and wherever lines are missing, it was told so first.

    Pieces of output hold whole lines, so each says where it lies. Output the
    provider dropped (job_log_limit) is told with its size; output the engine
    dropped before the provider read it is told by a line on stderr, without.
    """

    def __init__(self, pause: float = 0.0) -> None:
        super().__init__()
        self.position = 0
        """The end of the output received so far (an offset in what the job printed)."""
        self.received = 0
        self.told: list[int] = []
        self.engine_gaps = 0
        self.err = bytearray()
        self._told = 0
        self._engine = False
        self._pause = pause
        self.stdout = self._stdout
        self.dropped = self._dropped
        self.stderr = self._stderr

    def _stdout(self, data: bytes) -> None:
        start = (int(data[:8]) - 1) * LINE
        assert len(data) % LINE == 0 and data == _numbered(start, len(data)), start
        missing = start - self.position
        assert missing >= 0, f"output at {start} again"
        if missing:
            assert self._engine or self._told >= missing, (start, self.position, self._told)
        self._told, self._engine = 0, False
        self.position = start + len(data)
        self.received += len(data)
        if self._pause:
            time.sleep(self._pause)  # a consumer slower than the job: blocks its whole loop

    def _dropped(self, count: int) -> None:
        assert count > 0
        self.told.append(count)
        self._told += count

    def _stderr(self, data: bytes) -> None:
        self.err.extend(data)
        if b"output may be missing here" in data:
            self.engine_gaps += 1
            self._engine = True


def _run(coro: Coroutine[Any, Any, T], ceiling: float = 300) -> T:
    """Run a scenario with a generous ceiling (a hang fails; no timing is asserted)."""

    async def bounded() -> T:
        async with asyncio.timeout(ceiling):
            return await coro

    return asyncio.run(bounded())


def _stored_output(node: Node, job_id: str) -> int:
    """Bytes of output the store holds for a job."""
    rows = node.home.store._query(
        "SELECT COALESCE(SUM(length(data)), 0) FROM job_events "
        "WHERE job_id = ? AND kind != 'state'",
        (job_id,),
    )
    return int(rows[0][0])


def _hosted(node: Node, job_id: str) -> JobRecord:
    record = node.home.store.job("hosted", job_id)
    assert record is not None
    return record


@pytest.fixture
def shared(cluster) -> Iterator[tuple[Node, Node, Callable[[], subprocess.Popen[bytes]]]]:
    """alice, who shares as a `gpumesh share` process (restartable on its port), and bob."""
    alice, bob = cluster("alice"), cluster("bob")
    alice.home.config.set("listen_port", str(_free_udp_port()))
    alice.home.config.save()
    pair_both(alice, bob)
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        procs.append(_start_agent(alice.home.path))
        return procs[-1]

    yield alice, bob, start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_slow_reader_gets_100mb_in_order_every_byte_or_where_it_was_dropped(shared) -> None:
    alice, bob, start = shared
    start()
    lines = 100_000  # 100 MB
    got = Checked(pause=0.002)

    async def scenario() -> None:
        result = await run_job(bob, spec("alice", *_numbered_job(lines, 3)), callbacks=got)
        assert (result.state, result.exit_code) == ("failed", 3)
        assert got.position == lines * LINE  # to the last line, each one or where it went
        hosted = _hosted(alice, result.job_id)
        assert sum(got.told) <= result.output_dropped <= hosted.output_dropped
        if not got.engine_gaps:  # the provider read all of it: every byte is accounted for
            assert hosted.output_bytes == lines * LINE
            assert got.received + sum(got.told) == lines * LINE
            assert got.err == b""

    _run(scenario())


def test_beyond_job_log_limit_the_oldest_output_goes_and_a_reader_is_told(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    alice.home.config.set("job_log_limit", "1MB")
    lines = 20_000  # 20 MB, twenty times the limit

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            job = await run_job(bob, spec("alice", *_numbered_job(lines, 5)), detach=True)
            peer = bob.peer("alice")
            async with bob.session(peer.node_id) as session:
                stream = session.open_stream()
                request = JobLogs(job_id=job.job_id, after_seq=0, follow=True, credited=True)
                stream.send_message(request)
                frames = [await stream.read_frame()]
                # This reader now takes nothing more, so its credit runs out; the job
                # runs on to its end regardless, and the store stays within the limit.
                while _hosted(alice, job.job_id).state not in FINAL:
                    assert _stored_output(alice, job.job_id) <= 1_000_000
                    await asyncio.sleep(0.1)
                hosted = _hosted(alice, job.job_id)
                assert hosted.output_bytes == lines * LINE
                assert _stored_output(alice, job.job_id) <= 1_000_000
                assert hosted.output_dropped == lines * LINE - _stored_output(alice, job.job_id)
                # Now it reads everything there is.
                while (frame := await stream.read_frame()) is not None:
                    frames.append(frame)
        section, reader, position = EventSection(), OutputPosition(), 0
        gaps, states = [], []
        for frame in frames:
            assert frame is not None and frame.kind is FrameKind.DATA
            if not frame.body:
                section.end()
                continue
            for message in section.feed(frame.body):
                if isinstance(message, JobStatus):
                    states.append((message.state, message.exit_code))
                    continue
                assert isinstance(message, JobOutput)
                dropped = reader.on_output(message.offset, len(message.data))
                if dropped:
                    gaps.append(dropped)
                position += dropped
                assert message.data == _numbered(position, len(message.data))
                position += len(message.data)
        assert position == lines * LINE
        assert gaps and sum(gaps) <= hosted.output_dropped
        assert states[-1] == ("failed", 5)
        # What is kept starts at a line: the drop took whole lines.
        assert hosted.output_dropped % LINE == 0

    _run(scenario())
    db = alice.home.path / "gpumesh.db"
    wal = alice.home.path / "gpumesh.db-wal"
    assert db.stat().st_size < 4_000_000  # the limit, plus SQLite's own pages
    assert not wal.exists() or wal.stat().st_size < 12_000_000  # its WAL: a few MB


def test_output_the_engine_dropped_before_the_provider_read_it_is_marked(cluster, engine) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    alice.home.config.set("job_log_limit", "200MB")  # only the engine drops here
    lines = 120_000  # more than the engine keeps of a container's log (5 files of 20MB)
    script = f"{_awk(1, 1)}; while [ ! -e /tmp/go ]; do sleep 0.1; done; {_awk(2, lines)}; exit 3"

    async def scenario() -> Checked:
        async with providing(alice) as first:
            pair_both(alice, bob)
            port = first.address[1]
            job = await run_job(bob, spec("alice", "sh", "-c", script), detach=True)
            for _ in range(600):  # until line 1 is stored, and the cursor with it
                if _hosted(alice, job.job_id).output_bytes >= LINE:
                    break
                await asyncio.sleep(0.1)
        # The provider is down while the job prints far more than the engine keeps.
        container = engine.containers.get(_hosted(alice, job.job_id).container_id)
        container.exec_run(["touch", "/tmp/go"])
        assert container.wait(timeout=120)["StatusCode"] == 3
        got = Checked()
        async with providing(alice, port=port):
            result = await follow_job(bob, job.job_id, callbacks=got)
        assert (result.state, result.exit_code) == ("failed", 3)
        return got

    got = _run(scenario())
    assert got.engine_gaps == 1  # told once, where the lines went
    assert got.position == lines * LINE  # and every line after it is there, in order
    assert got.told == []


def test_an_older_consumer_is_told_of_dropped_output_in_its_stderr(cluster) -> None:
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with providing(alice):
            pair_both(alice, bob)
            store, peer = alice.home.store, alice.peer("bob")
            store.add_job(
                JobRecord(
                    role="hosted",
                    job_id="abcdef123456",
                    peer_id=peer.node_id,
                    peer_name=peer.name,
                    image="busybox",
                    command=["true"],
                    env={},
                    gpu_memory=0,
                    gpus=[],
                    retries=0,
                    timeout=0.0,
                    workdir="",
                    created_at=time.time(),
                    state="succeeded",
                )
            )
            for n in range(10):
                store.append_job_event("abcdef123456", 1, "stdout", b"%d\n" % n, log_limit=6)
            async with bob.session(bob.peer("alice").node_id) as session:
                stream = session.open_stream()
                # As a consumer from before credited sections asks: plain messages.
                stream.send_message(JobLogs(job_id="abcdef123456", after_seq=0, follow=False))
                got = []
                while (frame := await stream.read_frame()) is not None:
                    assert frame.kind is FrameKind.MESSAGE
                    got.append(frame)
        messages = [decode_message(f.body) for f in got]
        assert [(m.stream, m.data) for m in messages if isinstance(m, JobOutput)] == [
            (
                "stderr",
                b"gpumesh: 14B of output dropped here (the provider keeps the newest "
                b"job_log_limit of a job's output)\n",
            ),
            ("stdout", b"7\n"),
            ("stdout", b"8\n"),
            ("stdout", b"9\n"),
        ]

    _run(scenario(), 60)


def test_an_attached_run_neither_loses_nor_repeats_a_line_when_its_provider_is_killed(
    shared, monkeypatch
) -> None:
    from gpumesh.transport import quicsetup as quic

    monkeypatch.setattr(quic, "IDLE_TIMEOUT", 1.5)  # bob notices a silent provider soon
    _alice, bob, start = shared
    agents = [start()]
    script = "for i in $(seq 1 40); do echo line $i; sleep 0.1; done; exit 7"

    async def scenario() -> None:
        out = bytearray()
        lost = asyncio.Event()
        drops: list[object] = []

        def stdout(data: bytes) -> None:
            out.extend(data)
            if b"line 8\n" in out and agents[0].poll() is None:
                os.kill(agents[0].pid, signal.SIGKILL)  # mid-job, no goodbye
                agents[0].wait()

        def reconnecting(error: object) -> None:
            drops.append(error)
            lost.set()

        async def restart() -> None:
            await lost.wait()
            agents.append(await asyncio.to_thread(start))  # same home, same port

        restarter = asyncio.create_task(restart())
        callbacks = JobCallbacks(stdout=stdout, reconnecting=reconnecting)
        result = await run_job(bob, spec("alice", "sh", "-c", script), callbacks=callbacks)
        await restarter
        assert (result.state, result.exit_code) == ("failed", 7)
        assert drops  # the link did drop, and the same run went on
        assert bytes(out).decode().splitlines() == [f"line {i}" for i in range(1, 41)]
        assert len(agents) == 2 and agents[0].returncode == -signal.SIGKILL

    _run(scenario(), 120)


# --- the CLI ---------------------------------------------------------------------------------


@pytest.fixture
def limited_pair(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """alice shares (a `gpumesh share` process) keeping 1MB of each job's output; bob."""
    with shared_pair(tmp_path, job_log_limit="1MB") as homes:
        yield homes


def test_logs_and_jobs_say_how_much_output_was_dropped(limited_pair) -> None:
    alice, bob = limited_pair
    lines = 3000  # 3 MB, three times alice's limit
    started = gpumesh(bob, "run", "--peer", "alice-pc", "--detach", "--", *_numbered_job(lines, 3))
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()
    deadline = time.monotonic() + 120
    while json.loads(gpumesh(alice, "jobs", "--json").stdout)[0]["state"] not in FINAL:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    hosted = json.loads(gpumesh(alice, "jobs", "--json").stdout)[0]
    kept = lines * LINE - hosted["output_dropped"]
    assert 0 < kept <= 1_000_000

    logs = gpumesh(bob, "logs", job_id)
    assert logs.returncode == 3, logs.stderr
    dropped = re.findall(r"gpumesh: ([\d.]+MB) of output dropped here", logs.stderr)
    assert len(dropped) == 1, logs.stderr
    assert logs.stdout.encode() == _numbered(hosted["output_dropped"], kept)
    assert logs.stdout.startswith(f"{hosted['output_dropped'] // LINE + 1:08d} ")  # a whole line
    submitted = json.loads(gpumesh(bob, "jobs", "--json").stdout)[0]
    assert submitted["output_dropped"] == hosted["output_dropped"] > 0
    local = gpumesh(alice, "logs", job_id)  # the provider reads its own copy the same way
    assert "of output dropped here" in local.stderr
    assert local.stdout == logs.stdout


def test_run_into_a_pipe_read_slowly_gets_all_output_and_the_jobs_exit_code(pair) -> None:
    _alice, bob = pair
    lines = 20_000  # 20 MB: the provider once gave up on such a reader after 600 KB
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpumesh",
            "run",
            "--peer",
            "alice-pc",
            "--",
            *_numbered_job(lines, 4),
        ],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    position = 0
    time.sleep(2)  # nobody reads: `run` blocks on its full pipe
    while chunk := proc.stdout.read(256 * 1024):
        assert chunk == _numbered(position, len(chunk))
        position += len(chunk)
        time.sleep(0.01)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err
    assert position == lines * LINE  # 64MB is kept, so nothing was dropped
    assert b"error" not in err
