"""A job container's log, read from the engine with resumable cursors.

Docker stamps each log entry with a nanosecond time; a :class:`LogCursor`
names the last entry read (its time and how many entries of that time came
before it), so a reader resumes after it with nothing lost or repeated, and
learns (``LogLine.lost``) when the entry at its cursor was rotated out of the
engine's log before it was read. Entries are the job's bytes as it wrote them,
read from the Engine API's multiplexed frames.
"""

from __future__ import annotations

import calendar
import contextlib
import dataclasses
import re
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import requests.exceptions

from gpumesh.errors import AgentError, ConfigError, NotFoundError
from gpumesh.runtime.base import ContainerState, LogCursor, LogLine, Stream
from gpumesh.runtime.states import ALIVE

__all__ = ["Engine", "LogReader", "check_cursors"]

Engine = Callable[[str, str], contextlib.AbstractContextManager[Any]]
"""The runtime's engine access: a context manager yielding Docker's low-level
client for an action on a container, both named in its errors."""

# Docker cuts output without a newline into entries of this size that share
# one timestamp; the "local" driver then drops the newline that ended the
# series (json-file keeps it).
_LOG_PIECE = 16 * 1024
# While a container's log grows, it is read without follow at most this often
# (see LogReader.lines).
_LOG_POLL = 0.02
# Bytes read at once from a log response without follow.
_LOG_BLOCK = 256 * 1024
_REREAD_BYTES = 64 * 1024
"""Most bytes of a log read from its start that a reader reads again, rather than
reading a stream with a cursor and one without apart (see LogReader._read)."""
_STREAM_IDS: dict[Stream, int] = {"stdout": 1, "stderr": 2}
"""The stream byte of a multiplexed log frame."""

# Docker's log timestamps: RFC 3339 in UTC with a fixed 9-digit fraction.
_TIMESTAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z")


def check_cursors(cursors: dict[Stream, LogCursor]) -> None:
    """Refuse (ConfigError) a stream that is not one, or a cursor that is not a
    Docker log timestamp."""
    for stream, cursor in cursors.items():
        if stream not in ("stdout", "stderr"):
            raise ConfigError(f"unknown log stream {stream!r}: use 'stdout' or 'stderr'")
        if cursor.timestamp and _timestamp_key(cursor.timestamp) is None:
            raise ConfigError(
                f"log cursor {cursor.timestamp!r} is not a Docker log timestamp: "
                "resume from an empty cursor to read from the start"
            )


class LogReader:
    """Reads the logs of a runtime's containers: ``engine`` reaches it,
    ``inspect`` tells a container's state, and ``stopped`` is the event set for
    a container once the runtime's wait saw it stop."""

    def __init__(
        self,
        engine: Engine,
        inspect: Callable[[str], ContainerState],
        stopped: Callable[[str], threading.Event],
    ) -> None:
        self._engine = engine
        self._inspect = inspect
        self._stopped = stopped

    def lines(
        self,
        container_id: str,
        cursors: dict[Stream, LogCursor],
        follow: bool,
        alive: bool,
    ) -> Generator[LogLine, None, None]:
        """The log after ``cursors`` (moved along as entries are read); with
        ``follow``, until the container stops. ``alive``: whether it was running
        just now (saves asking again first)."""
        if not follow:
            yield from self._read(container_id, cursors, False)
            return
        # Docker's follower moves to the new file when the log rotates and skips
        # whatever it had not read of the old one (20.10), so a reader behind a fast
        # job would lose lines. Entries are therefore only ever taken from reads
        # without follow (from the cursor; they read the rotated files too, and
        # cost the engine little when they return little), one every _LOG_POLL
        # while the log grows. A quiet log is waited on with a followed stream and
        # only its first entry taken, which the follower sends as soon as it is
        # written, before it could have moved on to a newer file. A read that
        # began after the container stopped is the last one: nothing is written
        # after it.
        stopped = self._stopped(container_id)
        # Read from the start until now (no cursor was set): while what was read is
        # small, reading it all again is cheaper than a request per stream.
        read = 0 if not any(cursor.timestamp for cursor in cursors.values()) else None
        while True:
            got = False
            whole = read is not None and read <= _REREAD_BYTES
            for line in self._read(container_id, cursors, False, whole=whole):
                got = True
                cursors[line.stream] = line.cursor
                if read is not None:
                    read += len(line.data)
                yield line
            if not alive:
                return
            ended = False
            if got:
                stopped.wait(_LOG_POLL)  # a growing log: let it gather a batch
            else:
                whole = read is not None and read <= _REREAD_BYTES
                waiting = self._read(container_id, cursors, True, whole=whole)
                try:
                    # Ends at the next entry, or when the stream does (the container
                    # stopped, or the connection dropped: the SDK reports both alike).
                    first = next(waiting, None)
                    if first is not None and not first.lost:  # else read again, to be sure
                        cursors[first.stream] = first.cursor
                        if read is not None:
                            read += len(first.data)
                        yield first
                finally:
                    waiting.close()
                ended = first is None
            # Known before the next read begins, so that a stopped container's
            # next read is its last: from the wait that saw it stop, else asked.
            if stopped.is_set():
                alive = False
            else:
                try:
                    alive = self._inspect(container_id).status in ALIVE
                except NotFoundError:
                    return
            if ended and alive:
                stopped.wait(_LOG_POLL)  # an engine that keeps ending the stream: don't spin

    def _read(
        self,
        container_id: str,
        cursors: dict[Stream, LogCursor],
        follow: bool,
        *,
        whole: bool = False,
    ) -> Generator[LogLine, None, None]:
        """One read of the engine's log after ``cursors``. Each stream starts at the
        entry at its cursor; when its first line comes without that entry before
        it, the entry was rotated out of the engine's log (and maybe more after
        it) before it was read: that line is marked ``lost``.

        The streams are read in one request when their cursors bound it alike
        (all empty, or all set: each stream's entries are written in the order
        of their timestamps, so the oldest cursor bounds them all), or with
        ``whole``: from the log's start, each stream passing over what lies
        before its cursor. Otherwise a stream without a cursor next to one with
        a cursor is read from the start, on its own, rather than from the
        other's cursor: an entry of one stream may reach the log after a newer
        one of the other. A followed read of such a pair waits from the cursor
        that is set; an entry it brings of the stream without one is marked
        ``lost`` (a wake-up only: the next read takes it)."""
        set_keys = [
            key
            for cursor in cursors.values()
            if (key := _timestamp_key(cursor.timestamp) if cursor.timestamp else None)
        ]
        if whole:
            set_keys = []
        if not follow and 0 < len(set_keys) < len(cursors):
            for stream, cursor in cursors.items():
                yield from self._read(container_id, {stream: cursor}, False)
            return
        readers: dict[int, _EntryReader] = {}
        for stream, cursor in cursors.items():
            after = _timestamp_key(cursor.timestamp) if cursor.timestamp else None
            readers[_STREAM_IDS[stream]] = _EntryReader(stream, after, cursor.count)
        unbounded = {
            _STREAM_IDS[stream]
            for stream, cursor in cursors.items()
            if set_keys and not cursor.timestamp
        }
        since = _since(min(set_keys)) if set_keys else None
        with self._engine("read the logs of container", container_id) as api:
            response = _log_response(api, container_id, list(cursors), follow, since)
            try:
                # One frame is one log entry; a followed one is delivered as soon as
                # Docker has it, and a read without follow goes by blocks.
                frames = _followed_frames(response) if follow else _frames_in_blocks(response)
                for kind, frame in frames:
                    reader = readers.get(kind)
                    if reader is None:
                        continue
                    line = reader.entry(frame)
                    if line is None:
                        continue
                    if kind in unbounded:
                        line = dataclasses.replace(line, lost=True)
                    elif not reader.reached:
                        reader.reached = True
                        line = dataclasses.replace(line, lost=True)
                    yield line
            finally:
                _close_response(response)

    # --- plumbing -----------------------------------------------------------------------


class _EntryReader:
    """Turns Docker log frames of one stream into LogLines after a cursor."""

    def __init__(self, stream: Stream, after: tuple[str, int] | None, skip: int) -> None:
        self._stream = stream
        self._after = after
        self._skip = skip
        self._key: tuple[str, int] | None = None
        self._count = 0
        self._in_piece_series = False
        self.reached = after is None or skip == 0
        """Whether the entry at the cursor went by (nothing to pass without one)."""

    def entry(self, frame: bytes) -> LogLine | None:
        stamp, sep, data = frame.partition(b" ")
        timestamp = stamp.decode("ascii", "replace")
        key = _timestamp_key(timestamp)
        if not sep or key is None:
            raise AgentError(
                "Docker sent a log entry without a timestamp: check the engine's log driver"
            )
        same = key == self._key
        self._count = self._count + 1 if same else 1
        self._key = key
        ends_line = data.endswith(b"\n")
        if (
            same
            and self._in_piece_series
            and not ends_line
            and len(data) < _LOG_PIECE
            and data  # keep empty entries empty
        ):
            # The last piece of a long line, whose newline the "local" driver
            # dropped. (A program that ends with over 16 KiB unterminated
            # output looks the same, and gains a newline.)
            data += b"\n"
        self._in_piece_series = len(data) == _LOG_PIECE and not ends_line
        if self._after is not None and (
            key < self._after or (key == self._after and self._count <= self._skip)
        ):
            if key == self._after and self._count == self._skip:
                self.reached = True
            return None
        return LogLine(self._stream, data, LogCursor(timestamp, self._count))


def _timestamp_key(timestamp: str) -> tuple[str, int] | None:
    """A sortable key for a Docker log timestamp; None if it is not one."""
    match = _TIMESTAMP.fullmatch(timestamp)
    if match is None:
        return None
    return match.group(1), int((match.group(2) or "").ljust(9, "0"))


def _since(key: tuple[str, int]) -> float | None:
    """Docker's ``since`` (entries at or after it) for a cursor, never past it."""
    seconds = calendar.timegm(time.strptime(key[0], "%Y-%m-%dT%H:%M:%S"))
    # Floor to whole milliseconds: such a float prints back as exactly those
    # three decimals, so rounding can never move the bound past the cursor.
    millis = seconds * 1000 + key[1] // 1_000_000
    return millis / 1000 if millis > 0 else None


def _log_response(
    api: Any, container_id: str, streams: list[Stream], follow: bool, since: float | None
) -> Any:
    """The engine's answer to one read of a job's log, not yet read: what the
    SDK's ``logs(..., stream=True)`` gets, without the inspect it makes first to
    learn whether the container has a TTY (a job container never has one; its
    log is read several times for every job, the last reads after it exited, on
    the way to reporting its end) and with the stream of each frame kept."""
    params: dict[str, Any] = {
        "stdout": int("stdout" in streams),
        "stderr": int("stderr" in streams),
        "timestamps": 1,
        "follow": int(follow),
        "tail": "all",
    }
    if since is not None:
        params["since"] = since
    response = api._get(api._url("/containers/{0}/logs", container_id), params=params, stream=True)
    try:
        # Raises the engine's answer (no such container, ...) now, as logs() does.
        api._raise_for_status(response)
    except BaseException:
        response.close()
        raise
    if follow:
        # A job may stay quiet for days: no read timeout while following.
        with contextlib.suppress(AttributeError, OSError):
            api._disable_socket_timeout(api._get_raw_response_socket(response))
    return response


def _frames_in_blocks(response: Any) -> Iterator[tuple[int, bytes]]:
    """The frames of a multiplexed log response (``u8 stream, 3 zero bytes, u32
    length``, then the entry) as (stream, entry), read in large blocks: the SDK
    reads each frame's header and body apart, some tens of microseconds a frame."""
    buffer = b""
    while block := response.raw.read(_LOG_BLOCK):
        buffer = buffer + block if buffer else block
        offset, size = 0, len(buffer)
        while size - offset >= 8:
            end = offset + 8 + int.from_bytes(buffer[offset + 4 : offset + 8], "big")
            if end > size:
                break
            if end > offset + 8:
                yield buffer[offset], buffer[offset + 8 : end]
            offset = end
        buffer = buffer[offset:]


def _followed_frames(response: Any) -> Iterator[tuple[int, bytes]]:
    """The frames of a followed log response, each as soon as the engine sent it."""
    while len(header := response.raw.read(8)) == 8:
        length = int.from_bytes(header[4:8], "big")
        if not length:
            continue
        data = response.raw.read(length)
        if len(data) < length:
            return  # the connection ended mid-frame
        yield header[0], data


def _close_response(response: Any) -> None:
    # A response left before its end (its reader stopped): the socket closes only
    # once the response lets go of it.
    with contextlib.suppress(AttributeError, OSError, requests.exceptions.RequestException):
        response.close()
