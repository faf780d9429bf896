"""What ``gpumesh run`` makes of the node process's answer: the run's events printed
as they come (the job's stdout and stderr apart, its notes on stderr), the job's
exit code as its own, a refusal raised once, a node process lost mid-run followed
on from the last event printed, and Ctrl-C before and after the job started.

The node process's answer is given as its bytes on a socket pair, read by the
client's own reader; what is sent is the command's (see test_cli_bodies.py)."""

from __future__ import annotations

import base64
import os
import socket
from collections.abc import Iterator, Mapping

import msgspec
import pytest

from gpumesh.cli import _node
from gpumesh.cli import run as run_module
from gpumesh.client.views.jobs import JobResultView, Output, Status
from gpumesh.client.views.runs import AcceptedView
from gpumesh.daemon.client import Pending, SseEvent, _Response
from gpumesh.errors import NotFoundError
from gpumesh.protocol.states import JobRole, JobState

JOB = "0123456789ab"
ARGS = ["--peer", "alice", "--", "sh", "-c", "echo hi; echo oops >&2; exit 3"]


def _status(seq: int, state: str, **more: object) -> SseEvent:
    fields: dict[str, object] = {"attempt": 1, "exit_code": None, "message": "", "exited": False}
    return SseEvent("status", seq, Status(seq=seq, state=JobState(state), **{**fields, **more}))


def _output(seq: int, stream: str, data: bytes) -> SseEvent:
    view = Output(seq, stream, base64.b64encode(data).decode(), data.decode())
    return SseEvent("output", seq, view)


def _accepted() -> SseEvent:
    return SseEvent("acceptedview", None, AcceptedView(job_id=JOB, provider="alice", gpus=[]))


def _end(state: str, exit_code: int | None) -> JobResultView:
    return JobResultView(
        job_id=JOB, peer="alice", role=JobRole.SUBMITTED, state=JobState(state), final=True,
        exit_code=exit_code, attempt=1, message="", gpus=[], output_dropped=0,
    )  # fmt: skip


def _canned(body: bytes) -> Pending:
    """``body`` after an HTTP head, through a socket pair (closed after it)."""
    ours, theirs = socket.socketpair()
    ours.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + body)
    ours.close()
    return Pending(lambda: _Response(theirs))


def _streamed(events: list[SseEvent], end: JobResultView | None = None) -> Pending:
    """``events`` (and the run's end) as the node process streams them."""
    chunks = []
    for event in [*events, *([] if end is None else [SseEvent("end", None, end)])]:
        head = f"event: {event.event}\n" + ("" if event.id is None else f"id: {event.id}\n")
        chunks.append(head.encode() + b"data: " + msgspec.json.encode(event.view) + b"\n\n")
    return _canned(b"".join(chunks))


class _Interrupted(Pending):
    """A stream that gives ``events``, then Ctrl-C while it is read."""

    def __init__(self, *events: SseEvent) -> None:
        self._events = events

    def events(self, views: Mapping[str, type]) -> Iterator[SseEvent]:
        yield from self._events
        raise KeyboardInterrupt


class _Node:
    """The node process's client, answering the one request a run sends."""

    def __init__(self, answer: Pending) -> None:
        self.answer = answer
        self.sent: list[tuple[str, str]] = []

    def send(self, method: str, path: str, body: object = None) -> Pending:
        self.sent.append((method, path))
        return self.answer


def _run(answer: Pending, monkeypatch: pytest.MonkeyPatch) -> tuple[int, _Node]:
    """``gpumesh run ARGS`` against ``answer``: its exit status, and the client."""
    node = _Node(answer)
    monkeypatch.setattr(_node, "node_client", lambda: node)
    monkeypatch.delenv("GPUMESH_IMAGE", raising=False)
    with pytest.raises(SystemExit) as exited:
        run_module.run.main(args=ARGS, prog_name="gpumesh run", standalone_mode=False)
    assert isinstance(exited.value.code, int)
    return exited.value.code, node


def test_a_runs_events_are_printed_and_its_exit_code_is_the_commands(
    monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    events = [
        _accepted(),
        _status(1, "starting"),
        _status(2, "running"),
        _output(3, "stdout", b"hi\n"),
        _output(4, "stderr", b"oops\n"),
        _status(5, "retrying", message="exited with 3; retrying in 1s"),  # a note on stderr
        _status(6, "failed", exit_code=3, exited=True),
    ]
    code, node = _run(_streamed(events, _end("failed", 3)), monkeypatch)
    assert code == 3
    assert node.sent == [("POST", "/api/v1/jobs?stream=true")]  # one request
    printed = capsysbinary.readouterr()
    assert printed.out == b"hi\n"
    assert printed.err == b"oops\ngpumesh: exited with 3; retrying in 1s\n"


def test_a_node_process_lost_mid_run_is_followed_from_the_last_event(
    monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    followed: list[tuple[str, int]] = []

    def follow(job_id: str, printer: object, *, after: int) -> JobResultView:
        followed.append((job_id, after))
        return _end("succeeded", 0)

    monkeypatch.setattr(_node, "follow", follow)
    # The stream stops after three events: the node process died.
    events = [_accepted(), _status(1, "running"), _output(2, "stdout", b"a\n")]
    code, _ = _run(_streamed(events), monkeypatch)
    assert (code, followed) == (0, [(JOB, 2)])  # on from the last event printed
    assert capsysbinary.readouterr().out == b"a\n"  # nothing printed twice


def test_a_node_process_lost_before_acceptance_says_where_to_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpumesh.errors import AgentError

    with pytest.raises(AgentError, match="`gpumesh jobs` shows whether the job started"):
        _run(_streamed([]), monkeypatch)


def test_a_refusal_is_raised_as_its_error_and_nothing_is_printed(
    monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    refused = b'event: error\ndata: {"code": "not_found", "message": "no peer named \'x\'"}\n\n'
    with pytest.raises(NotFoundError, match="no peer named 'x'"):
        _run(_canned(refused), monkeypatch)
    assert capsysbinary.readouterr() == (b"", b"")


@pytest.mark.parametrize("accepted", [False, True])
def test_ctrl_c_before_the_job_started_says_so_and_after_asks_about_the_job(
    accepted: bool, monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    asked: list[tuple[str, str]] = []
    monkeypatch.setattr(run_module, "_interrupted", lambda *job: asked.append(job))
    before = [_accepted(), _status(1, "running")] if accepted else []
    code, _ = _run(_Interrupted(*before), monkeypatch)
    assert code == 130
    if accepted:  # the command asks whether to cancel the job it now knows
        assert asked == [(JOB, "alice")]
    else:
        assert asked == []
        assert capsysbinary.readouterr().err == b"Interrupted before the job started.\n"


@pytest.mark.parametrize("value", ["off", "OFF", "0", "no"])
def test_gpumesh_node_off_is_said_to_be_gone_once(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpumesh.daemon import setting_gone

    monkeypatch.setenv("GPUMESH_NODE", value)
    setting_gone()
    setting_gone()  # a second look: nothing more
    assert capsys.readouterr().err == (
        f"gpumesh: GPUMESH_NODE={value} is gone and changes nothing: every command goes "
        "through the node process (in Python, gpumesh.Mesh(in_process=True) runs the "
        "client layer in your own process)\n"
    )
    assert "GPUMESH_NODE" not in os.environ  # nor does a node process started now say it


def test_gpumesh_node_set_otherwise_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpumesh.daemon import setting_gone

    monkeypatch.setenv("GPUMESH_NODE", "on")
    setting_gone()
    assert capsys.readouterr().err == ""
