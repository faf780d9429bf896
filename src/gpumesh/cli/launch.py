"""The ``gpumesh`` console script: ``run``'s head start, then the CLI.

The form of ``gpumesh run`` typed most, ``gpumesh run --peer P [--image I] [--]
COMMAND...``, is understood here without click: its request goes to the home's
node process first thing, and the rest of the CLI (click and the command's
modules, most of a thin command's start-up) loads while the node process
submits the job and the provider makes its container. ``run`` then reads the
answer of the request already sent (:func:`take`) instead of sending it.

Only exactly that form is taken here, with options click would read the same
way (each given once, a value that does not look like an option); any other
command line, a home that is not initialised, commands kept in-process
(``GPUMESH_NODE=off``) or a failure on the way to the node process leave the
command to the CLI as it always ran: nothing is ever sent twice.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # as typing's, which this module must not import

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gpumesh.daemon.client import NodeClient, SseEvent
    from gpumesh.errors import GPUMeshError

__all__ = ["entry", "plain_run", "run_body", "take"]

RUN_PATH = "/api/v1/jobs?stream=true"
"""The node process's route for a run that streams its events."""

_COMPLETE_VAR = "_GPUMESH_COMPLETE"
_OPTIONS = ("--peer", "--image")

_ahead: list[tuple[dict[str, object], NodeClient, Iterator[SseEvent]]] = []
"""The request sent ahead, if any: its body, the client, and its events (not read yet)."""
_failed: list[tuple[dict[str, object], GPUMeshError]] = []
"""Why the node process could not be reached for the request, if so: ``run`` says
it rather than trying again (a node process that never answers would make it
wait the whole start-up ceiling a second time)."""


def plain_run(argv: list[str]) -> tuple[str, str | None, list[str]] | None:
    """``(peer, image, command)`` of ``run --peer P [--image I] [--] COMMAND...``;
    None for any other command line (the CLI parses it)."""
    if not argv or argv[0] != "run":
        return None
    values: dict[str, str] = {}
    rest = argv[1:]
    index = 0
    while index < len(rest):
        arg = rest[index]
        if arg == "--":
            index += 1
            break
        if not arg.startswith("-"):
            break  # the command: everything from here on is its own
        name, equals, value = arg.partition("=")
        if name not in _OPTIONS or name in values:
            return None
        if not equals:
            if index + 1 >= len(rest):
                return None
            value = rest[index + 1]
            index += 1
        index += 1
        if not value or value.startswith("-"):
            return None
        values[name] = value
    command = rest[index:]
    if "--peer" not in values or not command:
        return None
    return values["--peer"], values.get("--image"), command


def run_body(peer: str, image: str | None, command: list[str]) -> dict[str, object]:
    """The node process's request for the plain form: what ``run`` sends for it."""
    from gpumesh.settings import ENV_IMAGE, env

    return {
        "command": list(command),
        "peer": peer,
        "group": None,
        "image": image or env(ENV_IMAGE),
        "env": {},
        "gpu_memory": None,
        "retries": None,
        "timeout": None,
        "mounts": [],
        "wait": 0.0,
    }


def start(argv: list[str]) -> bool:
    """Send the plain form's request to the node process now; whether it was sent."""
    parsed = plain_run(argv)
    if parsed is None or _COMPLETE_VAR in os.environ:
        return False
    from gpumesh.daemon import enabled

    if not enabled():
        return False
    from gpumesh.settings import ENV_HOME, home_dir

    # As the CLI's --home option reads it (its environment variable, else the default).
    home = home_dir(os.environ.get(ENV_HOME) or None)
    if not (home / "identity.key").exists():
        return False
    from gpumesh.daemon.client import connect
    from gpumesh.errors import GPUMeshError

    body = run_body(*parsed)
    try:
        client = connect(home)
    except GPUMeshError as exc:
        _failed.append((body, exc))
        return False
    try:
        events = client.send_events(RUN_PATH, "POST", body)
    except Exception:  # no whole request went out: the CLI sends it and says what went wrong
        return False
    _ahead.append((body, client, events))
    return True


def take(body: dict[str, object]) -> tuple[NodeClient, Iterator[SseEvent]] | None:
    """The client and events of the request sent ahead, for ``run`` with ``body``;
    None when none was sent. Raises what kept :func:`start` from the node process."""
    if _failed:
        failed_body, failure = _failed.pop()
        if failed_body == body:
            raise failure
    if not _ahead:
        return None
    sent = _ahead.pop()
    if sent[0] != body:
        raise RuntimeError(f"the run sent ahead was {sent[0]!r}, the command line means {body!r}")
    return sent[1], sent[2]


def entry() -> None:
    """Console-script entry: the head start, then :func:`gpumesh.cli.main.entry`."""
    sent = False
    try:
        sent = start(sys.argv[1:])
        from gpumesh.cli.main import entry as cli_entry
    except KeyboardInterrupt:
        # As `run` says it when interrupted before the job's acceptance was read.
        sys.stderr.write("Interrupted before the job started.\n" if sent else "Interrupted.\n")
        sys.stderr.flush()
        os._exit(130)
    cli_entry()
