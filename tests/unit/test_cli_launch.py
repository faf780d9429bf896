"""The head start of ``gpumesh run`` and ``gpumesh app sync`` (gpumesh.cli.launch)
takes a command line only when it means exactly what the CLI makes of it: the
same request to the node process, read by the same command. Everything else is
left to click."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import TypeVar

import msgspec
import pytest

from gpumesh.cli import launch
from gpumesh.cli import run as run_module
from gpumesh.client.bodies import JobBody, SyncBody
from gpumesh.client.views.apps import SyncView
from gpumesh.client.views.jobs import JobResultView, Output, Status
from gpumesh.client.views.runs import AcceptedView
from gpumesh.daemon.client import Pending, SseEvent
from gpumesh.protocol.states import JobRole, JobState

IMAGE = "busybox:1"
T = TypeVar("T")

TAKEN = [
    ["run", "--peer", "alice", "echo", "hi"],
    ["run", "--peer", "alice", "--image", IMAGE, "echo", "hi"],
    ["run", "--image", IMAGE, "--peer", "alice", "echo", "hi"],
    ["run", "--peer=alice", "--image=" + IMAGE, "--", "sh", "-c", "exit 3"],
    ["run", "--peer", "alice", "--", "--help"],
    ["run", "--peer", "alice", "--", "-q", "x"],
    ["run", "--peer", "alice", "echo", "-n", "--peer", "x", "--", "y"],
    ["run", "--peer", "alice", "ls", "-d"],
    ["run", "--peer", "a=b", "true"],
    ["run", "--peer", "alice", "--image", "reg.example:5000/x/y@sha256:00", "true"],
]

LEFT = [
    [],
    ["--help"],
    ["--home", "/h", "run", "--peer", "alice", "true"],
    ["jobs"],
    ["run"],
    ["run", "--peer", "alice"],  # no command
    ["run", "--peer", "alice", "--"],
    ["run", "echo", "hi"],  # the peer from $GPUMESH_PEER or nowhere: click's to say
    ["run", "--peer", "alice", "--peer", "bob", "true"],
    ["run", "--peer", "", "true"],
    ["run", "--peer=", "true"],
    ["run", "--peer", "-q", "true"],
    ["run", "--peer", "alice", "-q", "true"],
    ["run", "--peer", "alice", "--detach", "true"],
    ["run", "--peer", "alice", "-e", "A=1", "true"],
    ["run", "--peer", "alice", "--workdir", ".", "true"],
    ["run", "--peer", "alice", "--pe", "x", "true"],
    ["run", "--peer", "alice", "--image"],
    ["run", "--peer", "alice", "-", "x"],
    ["run", "--group", "lab", "true"],
    ["run", "-f", "job.yaml"],
    ["run", "--peer", "alice", "--help"],
]


def _click_body(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> JobBody:
    """The request click's ``run`` sends for ``argv`` (its sending replaced), as the
    one schema's struct: a plain run sends a dict (no msgspec loaded), which must
    convert into it field for field."""
    sent: list[tuple[JobBody | dict[str, object], bool, bool]] = []

    def through_node(
        body: JobBody | dict[str, object], *, detach: bool, quiet: bool, explain: bool
    ) -> None:
        sent.append((body, detach, quiet or explain))

    monkeypatch.setattr(run_module, "_through_node", through_node)
    run_module.run.main(args=argv[1:], prog_name="gpumesh run", standalone_mode=False)
    ((body, detach, other),) = sent
    assert not detach and not other
    return body if isinstance(body, JobBody) else msgspec.convert(body, JobBody)


@pytest.mark.parametrize("argv", TAKEN)
@pytest.mark.parametrize("image_env", [None, "from-env:2"])
def test_a_plain_run_sends_what_click_would(
    argv: list[str], image_env: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("GPUMESH_IMAGE", "GPUMESH_PEER"):
        monkeypatch.delenv(name, raising=False)
    if image_env is not None:
        monkeypatch.setenv("GPUMESH_IMAGE", image_env)
    parsed = launch.plain_run(argv)
    assert parsed is not None
    # What the head start sends is the one struct's body: it converts into it (no
    # field of its own) and equals the struct click's command builds.
    assert msgspec.convert(launch.run_body(*parsed), JobBody) == _click_body(argv, monkeypatch)


@pytest.mark.parametrize("argv", LEFT)
def test_any_other_command_line_is_left_to_click(argv: list[str]) -> None:
    assert launch.plain_run(argv) is None


def test_a_request_sent_ahead_is_taken_once_and_only_for_its_own_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = launch.run_body("alice", IMAGE, ["true"])
    marker = (object(), Scripted())
    monkeypatch.setattr(launch, "_ahead", [(launch.RUN, body, *marker)])
    struct = msgspec.convert(body, JobBody)
    assert launch.take(launch.RUN, struct) == marker
    assert launch.take(launch.RUN, struct) is None  # taken: never read twice
    monkeypatch.setattr(launch, "_ahead", [(launch.RUN, body, *marker)])
    with pytest.raises(RuntimeError, match="the run sent ahead was"):
        launch.take(launch.RUN, msgspec.convert({**body, "command": ["false"]}, JobBody))
    monkeypatch.setattr(launch, "_ahead", [(launch.RUN, body, *marker)])
    with pytest.raises(RuntimeError, match="the run sent ahead was"):
        # another command's request is never read
        launch.take(launch.APP_SYNC, SyncBody(peer="alice", dir="/"))


def test_nothing_is_sent_ahead_without_an_initialised_home(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUMESH_HOME", str(tmp_path / "none"))
    assert not launch.start(["run", "--peer", "alice", "true"])
    (tmp_path / "none").mkdir()
    assert not launch.start(["run", "--peer", "alice", "true"])  # no identity in it
    assert not launch._ahead


@pytest.mark.parametrize("value", ["off", "OFF", "0", "no"])
def test_gpumesh_node_off_is_said_to_be_gone_once(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpumesh.daemon import setting_gone

    monkeypatch.setenv("GPUMESH_NODE", value)
    setting_gone()
    setting_gone()  # the CLI's own look after the head start's: nothing more
    err = capsys.readouterr().err
    assert err == (
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


def test_a_node_process_that_cannot_be_reached_is_reported_once_not_waited_for_twice(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpumesh.daemon import client
    from gpumesh.errors import AgentError

    home = tmp_path / "home"
    home.mkdir()
    (home / "identity.key").write_bytes(b"")
    monkeypatch.setenv("GPUMESH_HOME", str(home))
    monkeypatch.delenv("GPUMESH_IMAGE", raising=False)
    calls: list[object] = []
    failure = AgentError("the node process did not answer")

    def connect(where: object) -> object:
        calls.append(where)
        raise failure

    monkeypatch.setattr(client, "connect", connect)
    monkeypatch.setattr(launch, "_failed", [])
    assert not launch.start(["run", "--peer", "alice", "true"])
    assert calls == [home]
    with pytest.raises(AgentError) as raised:
        launch.take(launch.RUN, msgspec.convert(launch.run_body("alice", None, ["true"]), JobBody))
    assert raised.value is failure
    again = msgspec.convert(launch.run_body("alice", None, ["true"]), JobBody)
    assert launch.take(launch.RUN, again) is None  # said once


# `run --workdir`: "D" is a folder, "F" a file, "M" a path that does not exist (each
# replaced by its path under the test's folder; relative forms run from there).
WORKDIR_TAKEN = [
    ["run", "--peer", "alice", "--workdir", "D", "true"],
    ["run", "--workdir", "D", "--peer", "alice", "--", "sh", "-c", "ls"],
    ["run", "--peer=alice", "--workdir=D", "--image=" + IMAGE, "--", "--help"],
    ["run", "--image", IMAGE, "--workdir", "D", "--peer", "alice", "ls", "-d"],
    ["run", "--peer", "alice", "--workdir", "proj", "true"],
    ["run", "--peer", "alice", "--workdir", "./proj/", "true"],
    ["run", "--peer", "alice", "--workdir", "proj/../proj//", "true"],
    ["run", "--peer", "alice", "--workdir", ".", "true"],
    ["run", "--peer", "alice", "--workdir", "link", "true"],  # resolved, as the spec does
]

WORKDIR_LEFT = [
    ["run", "--peer", "alice", "--workdir", "D"],  # no command
    ["run", "--peer", "alice", "--workdir", "D", "--"],
    ["run", "--workdir", "D", "true"],  # the peer from $GPUMESH_PEER or nowhere
    ["run", "--peer", " ", "--workdir", "D", "true"],  # blank: the command says so
    ["run", "--peer", "alice", "--image", "a b", "--workdir", "D", "true"],
    ["run", "--peer", "alice", "--workdir", "F", "true"],  # a file: the command refuses it
    ["run", "--peer", "alice", "--workdir", "M", "true"],  # missing: the command says so
    ["run", "--peer", "alice", "--workdir", "~nobody-here-at-all/x", "true"],
    ["run", "--peer", "alice", "--workdir", "", "true"],
    ["run", "--peer", "alice", "--workdir=", "true"],
    ["run", "--peer", "alice", "--workdir", "-x", "true"],
    ["run", "--peer", "alice", "--workdir", "D", "--workdir", "D", "true"],
    ["run", "--peer", "alice", "--workdir", "D", "-e", "A=1", "true"],
    ["run", "--peer", "alice", "--workdir", "D", "--detach", "true"],
    ["run", "--peer", "alice", "--workdir", "D", "-q", "true"],
    ["run", "--peer", "alice", "--workdir", "D", "--mount", "/a:/b", "true"],
    ["run", "--peer", "alice", "--workdir", "D", "--gpu-memory", "1GB", "true"],
    ["run", "--group", "lab", "--workdir", "D", "true"],
    ["run", "-f", "job.yaml", "--workdir", "D"],
    ["run", "--peer", "alice", "--workdir", "D", "--help"],
    ["--home", "/h", "run", "--peer", "alice", "--workdir", "D", "true"],
]


def _workdir_paths(argv: list[str], root) -> list[str]:
    (root / "link").symlink_to(root / "proj")
    return _paths(argv, root)


@pytest.mark.parametrize("argv", WORKDIR_TAKEN)
@pytest.mark.parametrize("image_env", [None, "from-env:2"])
def test_a_run_with_a_workdir_sends_what_click_would(
    argv: list[str], image_env: str | None, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("GPUMESH_IMAGE", "GPUMESH_PEER"):
        monkeypatch.delenv(name, raising=False)
    if image_env is not None:
        monkeypatch.setenv("GPUMESH_IMAGE", image_env)
    monkeypatch.chdir(tmp_path)
    argv = _workdir_paths(argv, tmp_path)
    assert launch.plain_run(argv) is None
    taken = launch.request(argv)
    assert taken is not None
    form, body = taken
    assert form == launch.RUN
    assert msgspec.convert(body, JobBody) == _click_body(argv, monkeypatch)
    assert body["workdir"] in (str(tmp_path / "proj"), str(tmp_path))  # absolute, resolved


@pytest.mark.parametrize("argv", WORKDIR_LEFT)
def test_any_other_run_with_a_workdir_is_left_to_click(
    argv: list[str], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert launch.request(_workdir_paths(argv, tmp_path)) is None


@pytest.mark.parametrize(
    ("workdir", "message"),
    [
        ("F", "is not a folder: give the folder to upload"),
        ("M", "does not exist: give an existing folder to upload"),
    ],
)
def test_a_workdir_left_to_click_is_refused_there_with_its_own_message(
    workdir: str, message: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the head start leaves alone, the command refuses as it always did (and
    the head start sends nothing for it)."""
    from gpumesh.errors import GPUMeshError

    monkeypatch.chdir(tmp_path)
    argv = _workdir_paths(["run", "--peer", "alice", "--workdir", workdir, "true"], tmp_path)
    assert launch.request(argv) is None
    with pytest.raises(GPUMeshError) as raised:
        _click_body(argv, monkeypatch)
    assert raised.value.message == f"--workdir {argv[4]} {message}"


# `app sync`: "D" is a folder, "F" a file, "M" a path that does not exist (each
# replaced by its path under the test's folder; relative forms run from there).
SYNC_TAKEN = [
    ["app", "sync", "--peer", "alice", "--dir", "D"],
    ["app", "sync", "--dir", "D", "--peer", "alice", "--json"],
    ["app", "sync", "--json", "--peer=alice", "--dir=D"],
    ["app", "sync", "--peer", "alice", "--dir", "D", "--dry-run"],
    ["app", "sync", "--dry-run", "--json", "--peer", "alice", "--dir", "D"],
    ["app", "sync", "--peer", "a=b", "--dir", "D"],
    ["app", "sync", "--peer", "alice", "--dir", "proj"],
    ["app", "sync", "--peer", "alice", "--dir", "./proj/"],
    ["app", "sync", "--peer", "alice", "--dir", "."],
]

SYNC_LEFT = [
    ["app"],
    ["app", "--help"],
    ["app", "sync"],
    ["app", "sync", "--help"],
    ["app", "sync", "--peer", "alice"],  # no folder: click's to say
    ["app", "sync", "--dir", "D"],  # the peer from $GPUMESH_PEER or nowhere
    ["--home", "/h", "app", "sync", "--peer", "alice", "--dir", "D"],
    ["app", "sync", "--peer", "alice", "--dir", "D", "--json", "--json"],
    ["app", "sync", "--peer", "alice", "--dir", "D", "--dry-run", "--dry-run"],
    ["app", "sync", "--peer", "alice", "--peer", "bob", "--dir", "D"],
    ["app", "sync", "--peer", "alice", "--dir", "D", "--dir", "D"],
    ["app", "sync", "--peer", "alice", "--dir", "D", "extra"],
    ["app", "sync", "--peer", "alice", "--dir", "D", "--"],
    ["app", "sync", "--", "--peer", "alice", "--dir", "D"],
    ["app", "sync", "--peer", "alice", "--dir", "D", "--help"],
    ["app", "sync", "--peer", "alice", "--dir", "D", "-h"],
    ["app", "sync", "--peer", "alice", "--dir", "D", "--json=1"],
    ["app", "sync", "--peer", "alice", "--dir", "D", "--js"],
    ["app", "sync", "--peer", "alice", "--dir", "F"],  # a file: click refuses it
    ["app", "sync", "--peer", "alice", "--dir", "M"],  # missing: the node process says so
    ["app", "sync", "--peer", "alice", "--dir", ""],
    ["app", "sync", "--peer", "alice", "--dir="],
    ["app", "sync", "--peer", "-q", "--dir", "D"],
    ["app", "sync", "--peer", "alice", "--dir", "-x"],
    ["app", "sync", "--peer", "alice", "--dir"],
    ["app", "run", "--peer", "alice", "--dir", "D", "true"],
    ["app", "pull", "--peer", "alice", "--job", "j", "--dir", "D"],
    ["sync", "--peer", "alice", "--dir", "D"],
]


def _paths(argv: list[str], root) -> list[str]:
    named = {"D": root / "proj", "F": root / "file", "M": root / "missing"}
    (root / "proj").mkdir(exist_ok=True)
    (root / "file").write_bytes(b"")

    def one(arg: str) -> str:
        name, equals, value = arg.partition("=")
        if equals and value in named:
            return f"{name}={named[value]}"
        return str(named[arg]) if arg in named else arg

    return [one(arg) for arg in argv]


def _click_sync(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> SyncBody:
    """The request click's ``app sync`` sends for ``argv`` (its node client replaced
    by one that records the request and answers an empty sync's view)."""
    from gpumesh.cli import app as app_module

    sent: list[tuple[str, str, object]] = []
    view = SyncView(
        peer="p", remote="/apps/proj", dry_run=False, bytes_sent=0, manifest_bytes=0,
        manifest="full", files_sent=0, files_deleted=0, files_unchanged=0, sent=[],
        deleted=[], skipped=[], channel="", no_channel="",
    )  # fmt: skip

    class Recorder:
        def send(self, method: str, path: str, body: object) -> Pending:
            sent.append((method, path, body))
            return answered(view)

    monkeypatch.setattr(app_module, "node_client", Recorder)
    app_module.sync.main(args=argv[2:], prog_name="gpumesh app sync", standalone_mode=False)
    ((method, path, body),) = sent
    assert (method, path) == ("POST", launch.APP_SYNC_PATH)
    assert isinstance(body, dict)  # the head start's own, with no msgspec loaded
    return msgspec.convert(body, SyncBody)


@pytest.mark.parametrize("argv", SYNC_TAKEN)
def test_a_plain_app_sync_sends_what_click_would(
    argv: list[str], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUMESH_PEER", raising=False)
    monkeypatch.chdir(tmp_path)
    argv = _paths(argv, tmp_path)
    taken = launch.request(argv)
    assert taken is not None
    form, body = taken
    assert form == launch.APP_SYNC
    assert msgspec.convert(body, SyncBody) == _click_sync(argv, monkeypatch)
    assert body["dir"] in (str(tmp_path / "proj"), str(tmp_path))  # absolute, as the node needs


@pytest.mark.parametrize("argv", SYNC_LEFT)
def test_any_other_app_command_line_is_left_to_click(argv: list[str], tmp_path) -> None:
    assert launch.request(_paths(argv, tmp_path)) is None


def test_a_request_sent_ahead_is_read_by_its_own_command_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    body = launch.app_sync_body("alice", str(tmp_path), False)
    marker = (object(), Scripted())
    monkeypatch.setattr(launch, "_ahead", [(launch.APP_SYNC, body, *marker)])
    with pytest.raises(RuntimeError, match="the app sync sent ahead was"):
        launch.take(launch.RUN, JobBody(peer="alice", command=["true"]))
    monkeypatch.setattr(launch, "_ahead", [(launch.APP_SYNC, body, *marker)])
    struct = msgspec.convert(body, SyncBody)
    assert launch.take(launch.APP_SYNC, struct) == marker
    assert launch.take(launch.APP_SYNC, struct) is None


def _sync_by_command(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``app sync`` as click runs it, reading only what was sent ahead."""
    from gpumesh.cli import app as app_module

    def no_second_request() -> object:
        raise AssertionError("the command sent its request again")

    monkeypatch.setattr(app_module, "node_client", no_second_request)
    app_module.sync.main(args=argv[2:], prog_name="gpumesh app sync", standalone_mode=False)


def test_an_app_sync_answer_is_printed_ahead_only_as_click_would_echo_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("GPUMESH_LOG", raising=False)
    argv = ["app", "sync", "--peer", "alice", "--dir", str(tmp_path)]
    body = launch.app_sync_body("alice", str(tmp_path), False)
    view = SyncView(
        peer="alice", remote="/apps/x", dry_run=False, bytes_sent=1500, manifest_bytes=0,
        manifest="full", files_sent=1, files_deleted=0, files_unchanged=2, sent=["a"],
        deleted=[], skipped=[], channel="tls", no_channel="",
    )  # fmt: skip
    line = "synced /apps/x on alice: 1 sent (1.5KB), 0 deleted, 2 unchanged\n"
    monkeypatch.setattr(launch, "_ahead", [(launch.APP_SYNC, body, None, answered(view))])
    assert launch.finish(argv) == 0
    assert capsys.readouterr().out == line
    assert not launch._ahead
    # The same view, printed by the command: the same bytes.
    monkeypatch.setattr(launch, "_ahead", [(launch.APP_SYNC, body, None, answered(view))])
    _sync_by_command(argv, monkeypatch)
    assert capsys.readouterr().out == line

    # What click.echo might re-encode is the command's to print (the view read once).
    other = Scripted(view=msgspec.structs.replace(view, remote="/apps/caf\u00e9"))
    monkeypatch.setattr(launch, "_ahead", [(launch.APP_SYNC, body, None, other)])
    assert launch.finish(argv) is None
    assert capsys.readouterr().out == ""
    _sync_by_command(argv, monkeypatch)
    assert (
        capsys.readouterr().out
        == "synced /apps/caf\u00e9 on alice: 1 sent (1.5KB), 0 deleted, 2 unchanged\n"
    )
    assert other.reads == 1 and not launch._ahead


def test_an_app_sync_failure_sent_ahead_is_raised_once_by_the_command(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpumesh.errors import AgentError

    monkeypatch.delenv("GPUMESH_LOG", raising=False)
    argv = ["app", "sync", "--peer", "nobody", "--dir", str(tmp_path), "--json"]
    body = launch.app_sync_body("nobody", str(tmp_path), False)
    failure = AgentError("no paired peer named 'nobody'")
    refused = Scripted(failure=failure)
    monkeypatch.setattr(launch, "_ahead", [(launch.APP_SYNC, body, None, refused)])
    assert launch.finish(argv) is None
    assert capsys.readouterr().out == ""
    with pytest.raises(AgentError) as raised:
        _sync_by_command(argv, monkeypatch)
    assert raised.value is failure and refused.reads == 1 and not launch._ahead
    # Nothing sent ahead (or a run's request): nothing to finish here.
    assert launch.finish(argv) is None
    monkeypatch.setattr(launch, "_ahead", [(launch.RUN, {}, None, Scripted())])
    assert launch.finish(argv) is None and len(launch._ahead) == 1


class Scripted(Pending):
    """An answer of the node process given as views: one view, or events, then
    ``failure`` raised when given (a reader's Ctrl-C); ``reads`` counts its reads."""

    def __init__(
        self, *events: SseEvent, view: object = None, failure: BaseException | None = None
    ) -> None:
        self._events, self._view, self._failure = events, view, failure
        self.reads = 0

    def answer(self, into: type[T]) -> T:
        self.reads += 1
        if self._failure is not None:
            raise self._failure
        assert isinstance(self._view, into)
        return self._view

    def events(self, views: Mapping[str, type]) -> Iterator[SseEvent]:
        self.reads += 1
        for event in self._events:
            assert isinstance(event.view, views[event.event])
            yield event
        if self._failure is not None:
            raise self._failure


def canned(body: bytes) -> Pending:
    """An answer of the node process as its bytes: ``body`` after an HTTP head, through
    a socket pair (closed after it), read by the client's own reader."""
    import socket

    from gpumesh.daemon.client import _Response

    ours, theirs = socket.socketpair()
    ours.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + body)
    ours.close()
    return Pending(lambda: _Response(theirs))


def streamed(events: list[SseEvent]) -> Pending:
    """``events`` as the node process streams them (JSON, as it encodes its views)."""
    chunks = []
    for event in events:
        head = f"event: {event.event}\n" + ("" if event.id is None else f"id: {event.id}\n")
        chunks.append(head.encode() + b"data: " + msgspec.json.encode(event.view) + b"\n\n")
    return canned(b"".join(chunks))


def answered(view: object) -> Pending:
    """One JSON answer, as the node process sends it."""
    return canned(msgspec.json.encode(view))


# A plain run's events, printed by the head start (finish_run) or by the command.
JOB = "0123456789ab"
RUN_ARGV = ["run", "--peer", "alice", "--", "sh", "-c", "echo hi; echo oops >&2; exit 3"]


def _status(seq: int, state: str, **more: object) -> SseEvent:
    fields: dict[str, object] = {"attempt": 1, "exit_code": None, "message": "", "exited": False}
    return SseEvent("status", seq, Status(seq=seq, state=JobState(state), **{**fields, **more}))


def _output(seq: int, stream: str, data: bytes) -> SseEvent:
    import base64

    view = Output(seq, stream, base64.b64encode(data).decode(), data.decode())
    return SseEvent("output", seq, view)


def _accepted() -> SseEvent:
    return SseEvent("acceptedview", None, AcceptedView(job_id=JOB, provider="alice", gpus=[]))


def _end(state: str, exit_code: int | None) -> SseEvent:
    view = JobResultView(
        job_id=JOB, peer="alice", role=JobRole.SUBMITTED, state=JobState(state), final=True,
        exit_code=exit_code, attempt=1, message="", gpus=[], output_dropped=0,
    )  # fmt: skip
    return SseEvent("end", None, view)


RUN_EVENTS = [
    _accepted(),
    _status(1, "starting"),
    _status(2, "running"),
    _output(3, "stdout", b"hi\n"),
    _output(4, "stderr", b"oops\n"),
    _status(5, "retrying", message="exited with 3; retrying in 1s"),  # a note on stderr
    _status(6, "failed", exit_code=3, exited=True),
    _end("failed", 3),
]


def _run_body() -> dict[str, object]:
    return launch.run_body("alice", None, RUN_ARGV[4:])


def _run_by_command(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """``run`` as click runs it, reading only what was sent ahead: its exit status."""
    with pytest.raises(SystemExit) as exited:
        run_module.run.main(args=argv[1:], prog_name="gpumesh run", standalone_mode=False)
    assert isinstance(exited.value.code, int)
    return exited.value.code


@pytest.fixture
def run_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUMESH_LOG", raising=False)
    monkeypatch.delenv("GPUMESH_IMAGE", raising=False)
    monkeypatch.setattr(launch, "_ahead", [])
    monkeypatch.setattr(launch, "_readers", [])

    def no_second_request() -> object:
        raise AssertionError("the command sent its request again")

    from gpumesh.cli import _node

    monkeypatch.setattr(_node, "node_client", no_second_request)


@pytest.mark.usefixtures("run_ahead")
def test_a_runs_events_are_printed_ahead_as_the_command_prints_them(
    monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    ahead = (launch.RUN, _run_body(), None, streamed(RUN_EVENTS))
    monkeypatch.setattr(launch, "_ahead", [ahead])
    assert launch.finish_run(RUN_ARGV) == 3
    printed = capsysbinary.readouterr()
    assert printed.out == b"hi\n"
    assert printed.err == b"oops\ngpumesh: exited with 3; retrying in 1s\n"
    assert not launch._ahead and not launch._readers
    # The same events read by the command: the same bytes, the same exit status.
    monkeypatch.setattr(launch, "_ahead", [(launch.RUN, _run_body(), None, streamed(RUN_EVENTS))])
    assert _run_by_command(RUN_ARGV, monkeypatch) == 3
    assert capsysbinary.readouterr() == printed


@pytest.mark.usefixtures("run_ahead")
def test_a_run_is_finished_ahead_only_when_one_was_sent_and_no_log_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert launch.finish_run(RUN_ARGV) is None  # nothing sent ahead
    sync = (launch.APP_SYNC, {}, None, Scripted())
    monkeypatch.setattr(launch, "_ahead", [sync])
    assert launch.finish_run(RUN_ARGV) is None and launch._ahead == [sync]
    ahead = (launch.RUN, _run_body(), None, Scripted(*RUN_EVENTS))
    monkeypatch.setattr(launch, "_ahead", [ahead])
    assert launch.finish_run(["run", "--peer", "alice", "-q", "true"]) is None
    monkeypatch.setenv("GPUMESH_LOG", "debug")  # the CLI sets its logging up as asked
    assert launch.finish_run(RUN_ARGV) is None and launch._ahead == [ahead]


@pytest.mark.usefixtures("run_ahead")
def test_a_node_process_lost_mid_run_is_followed_by_the_command_from_the_last_event(
    monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    from gpumesh.cli import _node

    # The stream stops after three events: the node process died.
    events = streamed([_accepted(), _status(1, "running"), _output(2, "stdout", b"a\n")])
    monkeypatch.setattr(launch, "_ahead", [(launch.RUN, _run_body(), None, events)])
    assert launch.finish_run(RUN_ARGV) is None
    assert capsysbinary.readouterr().out == b"a\n"
    followed: list[tuple[str, object, int]] = []

    def follow(job_id: str, printer: object, *, after: int) -> JobResultView:
        followed.append((job_id, printer, after))
        view = _end("succeeded", 0).view
        assert isinstance(view, JobResultView)
        return view

    monkeypatch.setattr(_node, "follow", follow)
    (reader,) = launch._readers
    assert _run_by_command(RUN_ARGV, monkeypatch) == 0
    assert followed == [(JOB, reader.printer, 2)]  # on from the last event printed
    assert capsysbinary.readouterr().out == b""  # nothing printed twice
    assert not launch._ahead and not launch._readers


@pytest.mark.usefixtures("run_ahead")
def test_a_refusal_read_ahead_is_raised_once_by_the_command(
    monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    from gpumesh.errors import NotFoundError

    refused = b'event: error\ndata: {"code": "not_found", "message": "no peer named \'x\'"}\n\n'
    monkeypatch.setattr(launch, "_ahead", [(launch.RUN, _run_body(), None, canned(refused))])
    assert launch.finish_run(RUN_ARGV) is None
    with pytest.raises(NotFoundError, match="no peer named 'x'"):
        run_module.run.main(args=RUN_ARGV[1:], prog_name="gpumesh run", standalone_mode=False)
    assert capsysbinary.readouterr() == (b"", b"")
    assert not launch._ahead and not launch._readers


@pytest.mark.usefixtures("run_ahead")
@pytest.mark.parametrize("accepted", [False, True])
def test_ctrl_c_while_a_run_is_read_ahead_is_the_commands_to_handle(
    accepted: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    before = [_accepted(), _status(1, "running")] if accepted else []
    events = Scripted(*before, failure=KeyboardInterrupt())
    monkeypatch.setattr(launch, "_ahead", [(launch.RUN, _run_body(), None, events)])
    assert launch.finish_run(RUN_ARGV) is None
    asked: list[tuple[str, str]] = []
    monkeypatch.setattr(run_module, "_interrupted", lambda *job: asked.append(job))
    assert _run_by_command(RUN_ARGV, monkeypatch) == 130
    if accepted:  # the command asks whether to cancel the job it now knows
        assert asked == [(JOB, "alice")]
    else:
        assert asked == [] and capsysbinary.readouterr().err == (
            b"Interrupted before the job started.\n"
        )


def test_a_note_on_a_terminal_is_what_click_writes_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head start notes a run's acceptance on a terminal without loading click."""
    import io

    import click

    from gpumesh.cli import _notes

    class Terminal(io.StringIO):
        encoding = "utf-8"

        def isatty(self) -> bool:
            return True

    text = "job 0123456789ab on alice \x1b[31m\u00e9 (no GPU)"
    ours, clicks = Terminal(), Terminal()
    monkeypatch.setattr("sys.stderr", ours)
    _notes._note(text)
    monkeypatch.setattr("sys.stderr", clicks)
    click.echo(click.style(f"gpumesh: {text}", dim=True), err=True)
    assert ours.getvalue() == clicks.getvalue() == f"\x1b[2mgpumesh: {text}\x1b[0m\n"
