"""``gpumesh run``'s head start (gpumesh.cli.launch) takes a command line only
when it means exactly what the CLI makes of it: the same request to the node
process, sent by the same run. Everything else is left to click."""

from __future__ import annotations

import pytest

from gpumesh.cli import launch
from gpumesh.cli import run as run_module

IMAGE = "busybox:1"

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


def _click_body(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The request click's ``run`` sends for ``argv`` (its sending replaced)."""
    sent: list[tuple[dict[str, object], bool, bool]] = []

    def through_node(body: dict[str, object], *, detach: bool, quiet: bool, explain: bool) -> None:
        sent.append((body, detach, quiet or explain))

    monkeypatch.setattr(run_module, "_through_node", through_node)
    monkeypatch.setattr(run_module, "node_enabled", lambda: True)
    run_module.run.main(args=argv[1:], prog_name="gpumesh run", standalone_mode=False)
    ((body, detach, other),) = sent
    assert not detach and not other
    return body


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
    assert launch.run_body(*parsed) == _click_body(argv, monkeypatch)


@pytest.mark.parametrize("argv", LEFT)
def test_any_other_command_line_is_left_to_click(argv: list[str]) -> None:
    assert launch.plain_run(argv) is None


def test_a_request_sent_ahead_is_taken_once_and_only_for_its_own_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = launch.run_body("alice", IMAGE, ["true"])
    marker = (object(), iter(()))
    monkeypatch.setattr(launch, "_ahead", [(body, *marker)])
    assert launch.take(dict(body)) == marker
    assert launch.take(body) is None  # taken: never read twice
    monkeypatch.setattr(launch, "_ahead", [(body, *marker)])
    with pytest.raises(RuntimeError, match="the run sent ahead was"):
        launch.take({**body, "command": ["false"]})


def test_nothing_is_sent_ahead_without_an_initialised_home_or_with_the_node_off(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUMESH_HOME", str(tmp_path / "none"))
    assert not launch.start(["run", "--peer", "alice", "true"])
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "identity.key").write_bytes(b"")
    monkeypatch.setenv("GPUMESH_NODE", "off")
    assert not launch.start(["run", "--peer", "alice", "true"])
    assert not launch._ahead


def test_a_node_process_that_cannot_be_reached_is_reported_once_not_waited_for_twice(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpumesh.daemon import client
    from gpumesh.errors import AgentError

    home = tmp_path / "home"
    home.mkdir()
    (home / "identity.key").write_bytes(b"")
    monkeypatch.setenv("GPUMESH_HOME", str(home))
    monkeypatch.delenv("GPUMESH_NODE", raising=False)
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
        launch.take(launch.run_body("alice", None, ["true"]))
    assert raised.value is failure
    assert launch.take(launch.run_body("alice", None, ["true"])) is None  # said once
