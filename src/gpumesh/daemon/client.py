"""The thin client of a home's node process: HTTP/JSON over ``control.sock``.

A command that talks to peers asks the node process, starting one in the
background when none runs (:func:`connect`), over a small HTTP/1.1 reader of
its own (standard library): no QUIC, cryptography or Docker SDK is imported on
this path, which is what makes ``gpumesh jobs`` start fast. Each answer is read
into its view struct (:mod:`gpumesh.client.views`) with msgspec, loaded only
once the request is out, so the node process works on it meanwhile. Errors
come back as the error tree's ``{code, message}`` and are raised as the same
classes, so the CLI's one-line messages and exit codes stay what they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path

# As typing's: typing, dataclasses (and their inspect) and the node record's module
# stay out of a thin command's start-up.
from typing import TYPE_CHECKING

from gpumesh.errors import (
    AgentError,
    GPUMeshError,
    InUseError,
    NodeUnavailableError,
    error_from_code,
)
from gpumesh.settings import ENV_HOME
from gpumesh.store.sockets import socket_name
from gpumesh.version import VERSION_HEADER, __version__

if TYPE_CHECKING:
    import subprocess
    from typing import TypeVar

    from gpumesh.client.views.jobs import JobResultView

    T = TypeVar("T")

__all__ = [
    "NoAnswer",
    "NodeClient",
    "NodeUnavailableError",
    "Pending",
    "SseEvent",
    "connect",
    "job_events",
]

SOCKET_NAME = "control.sock"
START_TIMEOUT = 60.0
"""Seconds a command waits for the node process it started to answer (a generous
ceiling: a loaded machine imports slowly)."""
STOP_TIMEOUT = 20.0
LOG_NAME = "node.log"


class _Response:
    """One HTTP/1.1 response read off a socket: what our own server sends (a body
    with a length, or chunked), no more. ``http.client`` would do, but it imports
    ``ssl`` and the ``email`` package, a fifth of a thin command's start-up."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._file = sock.makefile("rb")
        status_line = self._file.readline(_LINE_MAX)
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise NodeUnavailableError.because(f"not an HTTP answer: {status_line[:80]!r}")
        self.status = int(parts[1])
        self.headers: dict[str, str] = {}
        while True:
            line = self._file.readline(_LINE_MAX)
            if not line:
                raise NodeUnavailableError.because("the answer ended in its headers")
            if line in (b"\r\n", b"\n"):
                break
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self._chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        self._left = int(self.headers.get("content-length", "-1"))

    def read(self) -> bytes:
        """The whole body."""
        if self._chunked:
            return b"".join(self._chunks())
        return self._file.read() if self._left < 0 else self._exactly(self._left)

    def lines(self) -> Iterator[bytes]:
        """The body line by line (each with its newline), until it ends."""
        buffer = b""
        for chunk in (
            self._chunks() if self._chunked else iter(lambda: self._file.read1(65536), b"")
        ):
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for line in complete:
                yield line + b"\n"
        if buffer:
            yield buffer

    def _chunks(self) -> Iterator[bytes]:
        while True:
            size_line = self._file.readline(_LINE_MAX)
            if not size_line:
                raise NodeUnavailableError.because("the answer ended before its last chunk")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise NodeUnavailableError.because(f"a bad chunk size {size_line[:40]!r}") from None
            if size == 0:
                return
            data = self._exactly(size)
            self._exactly(2)  # the chunk's CRLF
            yield data

    def _exactly(self, count: int) -> bytes:
        data = self._file.read(count)
        if len(data) < count:
            raise NodeUnavailableError.because("the answer ended early")
        return data

    def close(self) -> None:
        self._file.close()
        self._sock.close()


_LINE_MAX = 65536


class SseEvent:
    """One Server-Sent Event: its name, its id (a sequence number) and its data,
    decoded into the view struct its stream names for it."""

    __slots__ = ("event", "id", "view")

    def __init__(self, event: str, id: int | None, view: object) -> None:
        self.event = event
        self.id = id
        self.view = view

    def __repr__(self) -> str:
        return f"SseEvent({self.event!r}, {self.id!r}, {self.view!r})"


class NodeClient:
    """Requests to the node process of ``home``."""

    def __init__(self, home: Path) -> None:
        self.home = home

    def _send(
        self, method: str, path: str, body: object, timeout: float | None
    ) -> Callable[[], _Response]:
        """Send one request now; the function returned waits for its answer's head."""
        payload = _payload(body)
        head = f"{method} {path} HTTP/1.1\r\nhost: gpumesh\r\nconnection: close\r\n"
        if body is not None:
            head += f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n"
        if not _has_unix():
            return self._send_tcp(head, payload, timeout)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)

        def connect() -> None:
            with socket_name(self.home, SOCKET_NAME) as name:
                sock.connect(name)

        return _sent(sock, connect, head.encode("latin-1") + b"\r\n" + payload)

    def _send_tcp(
        self, head: str, payload: bytes, timeout: float | None
    ) -> Callable[[], _Response]:
        """:meth:`_send` where the system has no unix sockets: the node process's
        loopback TCP address (from the home's record) and the home's token."""
        from gpumesh.control.auth import api_token
        from gpumesh.daemon.record import read_record

        record = read_record(self.home)
        urls = [a for a in (record.api if record is not None else []) if a.startswith("http://")]
        if not urls:
            raise NodeUnavailableError.because("no node process has written its address")
        address = urls[0].removeprefix("http://")
        host, _, port = address.rpartition(":")
        # Our own request line: the Host of the address, and the token.
        head = head.replace("host: gpumesh\r\n", f"host: {address}\r\n", 1)
        head += f"authorization: Bearer {api_token(self.home)}\r\n"
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        except (OSError, ValueError) as exc:
            raise NodeUnavailableError.because(str(exc)) from None
        sock.settimeout(timeout)
        return _sent(sock, lambda: None, head.encode("latin-1") + b"\r\n" + payload)

    def send(
        self, method: str, path: str, body: object = None, timeout: float | None = None
    ) -> Pending:
        """Send one request now; its answer is read later (:class:`Pending`): the node
        process starts on it while this process does other things (such as loading
        the decoder)."""
        return Pending(self._send(method, path, body, timeout))

    def call(
        self,
        method: str,
        path: str,
        into: type[T],
        body: object = None,
        timeout: float | None = None,
    ) -> T:
        """The answer of one request, decoded into ``into`` (a view struct, a list
        of them, or :class:`NoAnswer`); an error answer is raised as the tree's."""
        return self.send(method, path, body, timeout).answer(into)

    def events(
        self,
        path: str,
        views: Mapping[str, type],
        method: str = "GET",
        body: object = None,
    ) -> Iterator[SseEvent]:
        """A Server-Sent Events stream (:meth:`Pending.events`), the request sent
        when the first event is asked for."""
        yield from self.send(method, path, body).events(views)


class Pending:
    """A request sent to the node process, its answer not read yet: read it once,
    as one answer or as a stream of events."""

    def __init__(self, response: Callable[[], _Response]) -> None:
        self._wait = response
        self._head: _Response | None = None

    def _response(self) -> _Response:
        if self._head is None:
            self._head = self._wait()
        return self._head

    def header(self, name: str) -> str | None:
        """A header of the answer (waiting for the answer's head)."""
        return self._response().headers.get(name.lower())

    def close(self) -> None:
        """Leave the answer unread."""
        self._response().close()

    def answer(self, into: type[T]) -> T:
        """The answer, decoded into ``into``; an error answer raised as the tree's."""
        return _decode(_body_of(self._response()), into)

    def events(self, views: Mapping[str, type]) -> Iterator[SseEvent]:
        """The answer as Server-Sent Events, event by event, until the stream ends
        (``end``, the last one yielded). ``views``: the struct of each event name
        (one not named is skipped: a newer node process may send it); an ``error``
        event is raised as the tree's error; a stream the node process dropped (it
        died) raises :class:`NodeUnavailableError`."""
        response = self._response()
        try:
            if response.status >= 400:
                raise _error(response.read(), response.status)
            event, event_id = "message", None
            data: list[str] = []
            lines = response.lines()
            while True:
                try:
                    line = next(lines, b"")
                except OSError as exc:
                    raise NodeUnavailableError.because(str(exc)) from None
                if not line:
                    raise NodeUnavailableError.because("the event stream ended early")
                text = line.decode("utf-8").rstrip("\r\n")
                if text == "":
                    if data and event == "error":
                        raise _error("\n".join(data).encode(), 200)
                    if data and event in views:
                        yield SseEvent(event, event_id, _decode("\n".join(data), views[event]))
                    if data and event == "end":
                        return
                    event, event_id, data = "message", None, []
                elif text.startswith(":"):
                    continue
                else:
                    name, _, value = text.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if name == "event":
                        event = value
                    elif name == "id":
                        event_id = int(value)
                    elif name == "data":
                        data.append(value)
        finally:
            response.close()


RESUME_TRIES = 5
"""Node processes in a row that may die under one follow before it gives up."""


def job_events(
    connect: Callable[[], NodeClient], job_id: str, log: str, *, live: bool = True, after: int = 0
) -> Generator[SseEvent, None, JobResultView]:
    """A job's events through the node process (not ``end``) until the stream ends;
    the job's result (the ``end`` event's view). ``connect`` reaches the home's node
    process, starting one when none runs; ``after``: the sequence number of the last
    event already read; ``log``: where the error of a follow that gives up points. A
    node process that dies meanwhile is replaced (up to :data:`RESUME_TRIES` failing
    in a row) and the follow resumes after the last numbered event read, so no event
    is lost or repeated."""
    from urllib.parse import quote

    from gpumesh.client.views.jobs import JOB_EVENTS, JobResultView

    failures = 0
    while True:
        path = (
            f"/api/v1/jobs/{quote(job_id, safe='')}/events"
            f"?follow={'true' if live else 'false'}&after={after}"
        )
        try:
            for event in connect().events(path, JOB_EVENTS):
                if isinstance(event.view, JobResultView):
                    return event.view
                if event.id is not None:
                    after = event.id
                    failures = 0
                yield event
        except NodeUnavailableError as exc:
            failures += 1
            if failures > RESUME_TRIES:
                raise AgentError(
                    f"the node process kept failing while following job {job_id} ({exc.detail}): "
                    f"see {log}"
                ) from None
        else:
            raise AgentError(f"the event stream of job {job_id} ended without its end")


class NoAnswer:
    """What a request whose answer is of no use decodes into: nothing is read of it."""


def _body_of(response: _Response) -> bytes:
    """An answer's body; an error answer raised as the tree's error."""
    try:
        raw = response.read()
    except OSError as exc:
        raise NodeUnavailableError.because(str(exc)) from None
    finally:
        response.close()
    if response.status >= 400:
        raise _error(raw, response.status)
    return raw


def _decode(raw: bytes | str, into: type[T]) -> T:
    """JSON from the node process as ``into``; anything else is its fault (logged
    there), said in one line."""
    if into is NoAnswer:
        return into()
    import msgspec

    try:
        return msgspec.json.decode(raw, type=into)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise AgentError(
            f"the node process answered with something else ({exc}): is it another "
            "version? `gpumesh daemon stop` ends it"
        ) from None


def _payload(body: object) -> bytes:
    """A request's JSON body: one of :mod:`gpumesh.client.bodies`'s structs."""
    if body is None:
        return b""
    import msgspec

    return msgspec.json.encode(body)


def _error(raw: bytes, status: int) -> GPUMeshError:
    """An error answer's body (the error tree's ``{code, message}``) as its error."""
    from gpumesh.client.views import ErrorView

    try:
        error = _decode(raw, ErrorView)
    except AgentError:
        return AgentError(f"the node process answered HTTP {status}: see its log")
    return error_from_code(error.code, error.message)


def connect(home: Path) -> NodeClient:
    """The node process of ``home``, started in the background when none runs,
    and restarted when it is a background one of another version."""
    client = NodeClient(home)
    deadline = time.monotonic() + START_TIMEOUT
    started: subprocess.Popen[bytes] | None = None
    logged = 0
    _reap()
    restarted = False
    while True:
        try:
            probe = client.send("GET", "/api/v1/node", timeout=START_TIMEOUT)
            if probe.header(VERSION_HEADER) == __version__:
                probe.close()  # its own version: nothing to decode on a thin command's way
                return client
            from gpumesh.control.views import NodeVersionView

            view: NodeVersionView | None = probe.answer(NodeVersionView)
        except NodeUnavailableError:
            view = None
        if view is not None:
            if view.version == __version__:
                return client
            if not view.detached or restarted:
                what = "`gpumesh share`" if view.sharing else "`gpumesh-control`"
                raise InUseError(
                    f"the node process of {home} (pid {view.pid}) is version "
                    f"{view.version} and this gpumesh is {__version__}: restart it "
                    f"(`gpumesh daemon stop`, then {what} again)"
                )
            stop(home, client)
            restarted = True
            continue
        from gpumesh.daemon.record import holder

        if holder(home) is None:
            if started is not None and started.poll() is not None:
                raise _start_failure(home, started.returncode, logged)
            if started is None:
                logged = _log_size(home)
                started = _spawn(home)
                _STARTED.append(started)
        if time.monotonic() > deadline:
            raise AgentError(
                f"the node process for {home} did not answer within {START_TIMEOUT:g} s: "
                f"see {home / 'logs' / LOG_NAME}"
            )
        time.sleep(0.02)


START_FAILURE = "gpumesh-node-error: "
"""How a node process started in the background ends its log when it cannot
start: this, then its error's ``{code, message}``."""


def start_failure_line(error: GPUMeshError) -> str:
    """The log line that tells the command that started a node process why it
    could not start."""
    return START_FAILURE + json.dumps({"code": error.code, "message": error.message})


def _log_size(home: Path) -> int:
    """How long the node log of ``home`` is now (0: there is none)."""
    try:
        return (home / "logs" / LOG_NAME).stat().st_size
    except OSError:
        return 0


def _start_failure(home: Path, code: int, since: int) -> GPUMeshError:
    """Why the node process started for ``home`` exited at once: its own error, as
    its log says it after ``since`` (:func:`start_failure_line`), else where to look."""
    log = home / "logs" / LOG_NAME
    try:
        fd = os.open(log, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as file:
            file.seek(max(since, os.fstat(fd).st_size - 65536))
            said = file.read().decode("utf-8", errors="replace")
    except OSError:
        said = ""
    lines = [line for line in said.splitlines() if line.startswith(START_FAILURE)]
    if lines:
        from gpumesh.client.views import ErrorView

        with contextlib.suppress(AgentError):
            error = _decode(lines[-1].removeprefix(START_FAILURE), ErrorView)
            return error_from_code(error.code, error.message)
    return AgentError(f"the node process for {home} exited at start (code {code}): see {log}")


_STARTED: list[subprocess.Popen[bytes]] = []
"""Node processes this process started: kept, so a long-lived caller (a script's
``gpumesh.Mesh``) neither drops a running child's handle (a warning) nor leaves an
exited one a zombie."""


def _reap() -> None:
    _STARTED[:] = [child for child in _STARTED if child.poll() is None]


def stop(home: Path, client: NodeClient | None = None) -> int | None:
    """Ask the node process of ``home`` to stop and wait until it let go of the
    home; its pid, or None when none ran."""
    from gpumesh.daemon.record import holder

    record = holder(home)
    if record is None:
        return None
    client = client or NodeClient(home)
    try:
        client.call("POST", "/api/v1/node/stop", NoAnswer, timeout=STOP_TIMEOUT)
    except NodeUnavailableError:
        if record.pid:
            import signal

            with contextlib.suppress(OSError):
                os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while holder(home) is not None:
        if time.monotonic() > deadline:
            raise AgentError(
                f"the node process (pid {record.pid}) of {home} did not stop within "
                f"{STOP_TIMEOUT:g} s: end it with `kill {record.pid}`"
            )
        time.sleep(0.02)
    return record.pid


def _spawn(home: Path) -> subprocess.Popen[bytes]:
    """A node process for ``home``, detached from this command (its own session, its
    output in the home's logs folder)."""
    import subprocess

    from gpumesh.store.modes import open_private

    logs = home / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    log = open_private(logs / LOG_NAME, os.O_WRONLY | os.O_APPEND)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "gpumesh.daemon", "--detached"],
            env={**os.environ, ENV_HOME: str(home)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # POSIX; Windows detaches with creationflags
            creationflags=getattr(subprocess, "DETACHED_PROCESS", 0)
            | getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0),
            close_fds=True,
        )
    finally:
        os.close(log)


def _sent(sock: socket.socket, connect: Callable[[], None], data: bytes) -> Callable[[], _Response]:
    """Connect ``sock`` (``connect``) and send the request ``data``; the function
    returned waits for its answer's head. The socket is closed on any failure."""

    def closing_on_failure(step: Callable[[], T]) -> T:
        try:
            return step()
        except OSError as exc:
            sock.close()
            raise NodeUnavailableError.because(str(exc)) from None
        except BaseException:
            sock.close()
            raise

    def send() -> None:
        connect()
        sock.sendall(data)

    closing_on_failure(send)
    return lambda: closing_on_failure(lambda: _Response(sock))


def _has_unix() -> bool:
    """``platform.has("unix")``, answered here when it is a plain yes (a POSIX
    system, no simulated platform): importing :mod:`gpumesh.platform` (logging,
    threading, its probes) costs a thin command milliseconds."""
    from gpumesh.settings import ENV_TEST_PLATFORM, ENV_TEST_WITHOUT, env

    simulated = env(ENV_TEST_PLATFORM) or env(ENV_TEST_WITHOUT)
    if not simulated and sys.platform != "win32" and hasattr(socket, "AF_UNIX"):
        return True
    from gpumesh import platform

    return platform.has("unix")
