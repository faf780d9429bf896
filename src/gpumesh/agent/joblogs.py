"""The event logs of hosted jobs: output and states stored, changes told, consumers fed.

Owns what goes into a hosted job's event log in the store (its attempts'
output, its state changes, diagnostics on its stderr), the wake-ups of those
who follow it (:meth:`JobLog.wait_changed`: the node process's own
followers; one in another process reads the store on a short timer), and the
streaming of the log to consumers (``JobSubmit`` with attach, ``JobLogs``).

Durability: output read from the engine is appended to the job's event log
together with the engine-log cursor, in one transaction, so a restarted agent
resumes each log where the store says (:class:`OutputPump`).

Output never waits for consumers: the engine's log is read into the store as
fast as the store takes it, the oldest output dropped beyond ``job_log_limit``,
and each consumer is streamed from the store at its own pace (within its
credit: :mod:`gpumesh.protocol.joboutput`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, overload

import msgspec

from gpumesh.agent.deps import Settings
from gpumesh.blocking import in_thread
from gpumesh.protocol.joboutput import UNKNOWN, OutputPosition, encode_events
from gpumesh.protocol.messages import MAX_OUTPUT_CHUNK, JobOutput, JobStatus
from gpumesh.protocol.states import FINAL_STATES, LEGACY_STATES, JobRole
from gpumesh.runtime.base import JobRuntime, LogCursor, LogLine
from gpumesh.runtime.base import Stream as LogStream
from gpumesh.store.db import Store
from gpumesh.store.jobs import JobRecord
from gpumesh.units import format_size, parse_size

if TYPE_CHECKING:
    from gpumesh.transport.stream import Stream

__all__ = ["JobLog", "OutputPump", "told"]

logger = logging.getLogger(__name__)

_LOG_STREAMS: tuple[LogStream, ...] = ("stdout", "stderr")
_LOG_DRAIN_TIMEOUT = 15.0
"""After a container exits, how long its log reader may go without progress."""
_PIPE_BYTES = 4 * 1024 * 1024
"""Most engine-log bytes read but not yet stored. Beyond it the reader waits: only
our reading of the engine's log waits, never the container, whose output the
engine keeps meanwhile."""
_LINE_OVERHEAD = 100
"""What a line held in memory costs beside its bytes, roughly (an empty one too)."""
_BATCH_BYTES = 256 * 1024
"""Most output stored in one transaction."""
_EVENTS_PER_SEND = 128
"""Most events read from the store at once for one consumer (each at most 32 KiB)."""
_ENGINE_LOST = (
    b"gpumesh: output may be missing here: the job printed faster than the provider "
    b"could read it, and Docker had already dropped the oldest of its log\n"
)
"""Where output is stored after entries the engine rotated out of its log unread."""


class JobLog:
    """The event logs of this agent's hosted jobs, and who is woken when they grow."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self._settings = settings
        self._store = store
        self._changed = asyncio.Condition()

    def limit(self) -> int:
        """Most bytes of a job's output this provider keeps (config job_log_limit)."""
        return parse_size(str(self._settings.get("job_log_limit")))

    async def notify(self) -> None:
        """A hosted job got events: wake everyone following one."""
        async with self._changed:
            self._changed.notify_all()

    async def wait_changed(self, timeout: float) -> None:
        """Return when a hosted job gets events (or after ``timeout`` seconds)."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    async def state(
        self,
        job_id: str,
        attempt: int,
        state: str,
        exit_code: int | None,
        message: str,
        *,
        exited: bool = False,
    ) -> None:
        """Store a state change of the job (with its peak GPU memory so far)."""
        peak = self._record(job_id).peak_gpu_memory
        info = {
            "state": str(state),
            "exit_code": exit_code,
            "message": message,
            "peak_gpu_memory": peak,
            "exited": exited,
        }
        self._store.append_job_event(job_id, attempt, "state", json.dumps(info).encode())
        await self.notify()

    async def diagnostic(self, job_id: str, attempt: int, message: str) -> None:
        """Store a line for the job's user, on its stderr."""
        text = f"gpumesh: {message.strip()}\n".encode()
        self._store.append_job_event(job_id, attempt, "stderr", text, log_limit=self.limit())
        await self.notify()

    def pump(
        self,
        runtime: JobRuntime,
        job_id: str,
        attempt: int,
        container_id: str,
        cursor: dict[str, list[object]],
    ) -> OutputPump:
        """Start storing the output of an attempt's container, from ``cursor`` on."""
        return OutputPump(self, self._store, runtime, job_id, attempt, container_id, cursor)

    async def follow(
        self,
        stream: Stream,
        job_id: str,
        after: int,
        follow: bool = True,
        *,
        credited: bool,
        knows_preempted: bool,
    ) -> None:
        """:meth:`_stream_events` until the stream fails (reset or stopped by the consumer,
        its link closed, over its limits): a follow waiting for output would otherwise
        hold the stream, and the link under it, until the job ends."""
        events = asyncio.ensure_future(
            self._stream_events(
                stream, job_id, after, follow, credited=credited, knows_preempted=knows_preempted
            )
        )
        failed = asyncio.ensure_future(stream.wait_failed())
        try:
            await asyncio.wait({events, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()  # nothing, once it is done
            if not events.done():
                events.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await events
        if events.cancelled():
            raise failed.result()
        events.result()

    async def _stream_events(
        self,
        stream: Stream,
        job_id: str,
        after: int,
        follow: bool,
        *,
        credited: bool,
        knows_preempted: bool,
    ) -> None:
        """Send a job's events after seq ``after`` from the store, and with ``follow``
        new ones until it ends; ``credited``: inside one DATA section, at the pace of
        the consumer's credit (an older consumer gets plain messages)."""
        # What an older consumer was not sent is told in a line on its stderr; a
        # credited consumer tells that itself, from the offsets.
        position = OutputPosition(0 if after == 0 else UNKNOWN)
        epoch = self._record(job_id).epoch
        while True:
            events = self._store.job_events(job_id, after, _EVENTS_PER_SEND)
            if events:
                after = events[-1].seq
                messages = [told(event.to_message(), knows_preempted, epoch) for event in events]
                if credited:
                    await stream.send_data(encode_events(messages))
                    continue
                for message in messages:
                    if isinstance(message, JobOutput):
                        dropped = position.on_output(message.offset, len(message.data))
                        if dropped:
                            stream.send_message(_dropped_line(message, dropped))
                    stream.send_message(message)
                await stream.drain()
                continue
            job = self._record(job_id)
            if not follow or (job.state in FINAL_STATES and after >= job.last_seq):
                break
            await self.wait_changed(1.0)
        if credited:
            stream.end_data()
        stream.finish()

    def _record(self, job_id: str) -> JobRecord:
        job = self._store.job(JobRole.HOSTED, job_id)
        assert job is not None
        return job


@overload
def told(message: JobStatus, knows_preempted: bool, epoch: int) -> JobStatus: ...
@overload
def told(
    message: JobOutput | JobStatus, knows_preempted: bool, epoch: int
) -> JobOutput | JobStatus: ...
def told(
    message: JobOutput | JobStatus, knows_preempted: bool, epoch: int
) -> JobOutput | JobStatus:
    """``message`` as a requester is told it, the one way a hosted job's status leaves
    this provider: stamped with the ``epoch`` of the copy that runs here (events
    are stored without it: a job id has one epoch here for good), and for one from
    before ``preempted``, the state it knows instead
    (:data:`~gpumesh.protocol.states.LEGACY_STATES`)."""
    if not isinstance(message, JobStatus):
        return message
    changes: dict[str, object] = {}
    if message.epoch != epoch:
        changes["epoch"] = epoch
    older = None if knows_preempted else LEGACY_STATES.get(message.state)
    if older is not None:
        changes["state"] = older
    return msgspec.structs.replace(message, **changes) if changes else message


class OutputPump:
    """One attempt's output from the engine's log into the job's event log: a reader
    thread from the stored cursor, and a writer task that stores what it read, a
    batch of lines per transaction, the cursor (updated in place) with it."""

    def __init__(
        self,
        log: JobLog,
        store: Store,
        runtime: JobRuntime,
        job_id: str,
        attempt: int,
        container_id: str,
        cursor: dict[str, list[object]],
    ) -> None:
        self._log = log
        self._store = store
        self._job_id = job_id
        self._attempt = attempt
        self._cursor = cursor
        self._pipe = _LogPipe(asyncio.get_running_loop())
        self._reader = in_thread(_read_logs, runtime, self._pipe, container_id, cursor)
        self._writer = asyncio.create_task(self._write_logs())

    async def finish(self) -> None:
        """After the container exited: let the reader reach the end of its log (as long
        as it makes progress) and the writer store it (within a drain timeout)."""
        await _drain(self._reader, self._pipe)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._writer), _LOG_DRAIN_TIMEOUT)

    def stop(self) -> None:
        """Stop the writer, and the reader waiting on a full pipe. Stopping the agent
        must stop the writer too, or it would keep writing beside the next agent's
        (the cursor in the store is the truth)."""
        self._writer.cancel()
        self._pipe.close()

    async def _write_logs(self) -> None:
        """Store what the reader read: a batch of lines per transaction, the cursor
        with it, consecutive lines of a stream joined into pieces of up to 32 KiB."""
        cursor = self._cursor
        while (lines := await self._pipe.take()) is not None:
            limit = self._log.limit()
            start = 0
            while start < len(lines):
                end, size = start, 0
                while end < len(lines) and size < _BATCH_BYTES:
                    size += len(lines[end].data)
                    end += 1
                batch = lines[start:end]
                start = end
                for line in batch:
                    cursor[line.stream] = [line.cursor.timestamp, line.cursor.count]
                self._store.append_job_events(
                    self._job_id,
                    self._attempt,
                    _pieces(batch),
                    log_cursor=dict(cursor),
                    log_limit=limit,
                )
                await self._log.notify()


def _read_logs(
    runtime: JobRuntime, pipe: _LogPipe, container_id: str, cursors: dict[str, list[object]]
) -> None:
    """Read the engine's log (both streams, in one request a read) from the
    cursors into ``pipe`` (a thread)."""
    try:
        start: dict[LogStream, LogCursor] = {}
        for stream in _LOG_STREAMS:
            saved = cursors.get(stream) or ["", 0]
            start[stream] = LogCursor(str(saved[0]), int(str(saved[1])))
        for line in runtime.job_logs(container_id, start, True):
            if not pipe.put(line):
                return  # the writer stopped: the cursor in the store is the truth
    finally:
        pipe.end()


class _LogPipe:
    """Engine-log lines from the reader thread to the writer task, bounded in bytes.

    The writer takes everything queued at once, so a busy loop is woken once
    for many lines, not once per line.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._cond = threading.Condition()
        self._lines: deque[LogLine] = deque()
        self._bytes = 0
        self._ended = False
        self._closed = False
        self._woken = False
        self._ready = asyncio.Event()
        self.received = 0
        """Lines put so far: how the drain tells progress from a stuck reader."""

    def put(self, line: LogLine) -> bool:
        """Queue a line (the reader thread), waiting while the pipe is full; False once
        the writer stopped."""
        with self._cond:
            while self._bytes >= _PIPE_BYTES and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._lines.append(line)
            self._bytes += len(line.data) + _LINE_OVERHEAD
            self.received += 1
            self._wake()
        return True

    def end(self) -> None:
        """The reader is done (its thread)."""
        with self._cond:
            self._ended = True
            self._wake()

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            with contextlib.suppress(RuntimeError):  # the loop is gone: the agent stopped
                self._loop.call_soon_threadsafe(self._ready.set)

    async def take(self) -> list[LogLine] | None:
        """Every line queued so far, once there is one; None when the reader ended."""
        while True:
            with self._cond:
                if self._lines:
                    lines = list(self._lines)
                    self._lines.clear()
                    self._bytes = 0
                    self._cond.notify_all()
                    return lines
                if self._ended:
                    return None
                self._woken = False
                self._ready.clear()
            await self._ready.wait()

    def close(self) -> None:
        """The writer stopped: the reader waiting on a full pipe gives up."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


async def _drain(reader: asyncio.Future[None], pipe: _LogPipe) -> None:
    """After the container exited: wait for the reader to reach the end of its log,
    however long that takes, as long as it makes progress."""
    progress = -1
    while not reader.done() and pipe.received != progress:
        progress = pipe.received
        await asyncio.wait({reader}, timeout=_LOG_DRAIN_TIMEOUT)
    if not reader.done():
        reader.cancel()  # stuck: given up on (its thread ends with the engine's stream)
    elif not reader.cancelled() and reader.exception() is not None:
        logger.info("a log reader failed: %s", reader.exception())


def _pieces(lines: list[LogLine]) -> list[tuple[str, bytes]]:
    """Consecutive entries of a stream joined into pieces of at most MAX_OUTPUT_CHUNK.

    A piece holds whole entries (the engine splits longer lines into 16 KiB
    entries), so output dropped beyond job_log_limit goes a line at a time and
    what is kept starts at a line.
    """
    pieces: list[tuple[str, bytearray]] = []
    for line in lines:
        data = line.data
        if line.lost:
            pieces.append(("stderr", bytearray(_ENGINE_LOST)))
        if pieces and pieces[-1][0] == line.stream:
            piece = pieces[-1][1]
            if len(piece) + len(data) <= MAX_OUTPUT_CHUNK:
                piece += data
                continue
        for start in range(0, max(1, len(data)), MAX_OUTPUT_CHUNK):
            pieces.append((line.stream, bytearray(data[start : start + MAX_OUTPUT_CHUNK])))
    return [(stream, bytes(piece)) for stream, piece in pieces]


def _dropped_line(before: JobOutput, dropped: int) -> JobOutput:
    """The line that tells an older consumer that output was dropped before ``before``."""
    text = (
        f"gpumesh: {format_size(dropped)} of output dropped here (the provider keeps the "
        "newest job_log_limit of a job's output)\n"
    )
    return JobOutput(
        seq=before.seq - 1, attempt=before.attempt, stream="stderr", data=text.encode()
    )
