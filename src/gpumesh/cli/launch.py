"""The ``gpumesh`` console script: the head start of the forms typed most, then the CLI.

Three command lines are understood here without click: the plain ``gpumesh run
--peer P [--image I] [--] COMMAND...``, the same with ``--workdir D`` (its
folder made absolute as the command's job spec makes it) and ``gpumesh app
sync --peer P --dir D [--dry-run] [--json]``. Their request goes to the home's
node process first thing, and the rest of the CLI (click and the command's
modules, most of a thin command's start-up) loads while the node process works
on it (submits the job, uploads its workdir and the provider makes its
container; scans the folder and syncs it). The command then reads the answer
of the request already sent (:func:`take`) instead of sending it. An app
sync's answer is even printed here (:func:`finish`), as the command prints it,
so a sync that went through never loads click at all; a failure, or output
click might echo differently, is left to the command, which raises or prints
the answer already read. A run's events are printed here too
(:func:`finish_run`), by the command's own printer, so a run that ends never
loads click either: the provider's engine starts the container meanwhile, and
on a small machine the CPU the CLI's imports took made that start slower.
Anything but the run's end (a failure, the node process gone, Ctrl-C) is left
to the command, where the reading stopped (:func:`read_ahead`).

Only exactly those forms are taken here, with options click would read the
same way (each given once, a value that does not look like an option, for
``--dir`` a folder click's check passes, for ``--workdir`` a folder the job
spec's check passes); any other command line, a home that is not initialised
or a failure on the way to the node process leave the command to the CLI as it
always ran: nothing is ever sent twice.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumesh.cli._notes import RunReader
    from gpumesh.client.bodies import JobBody, SyncBody
    from gpumesh.daemon.client import NodeClient, Pending
    from gpumesh.errors import GPUMeshError

__all__ = [
    "APP_SYNC",
    "APP_SYNC_PATH",
    "RUN",
    "RUN_PATH",
    "app_sync_body",
    "entry",
    "finish",
    "finish_run",
    "plain_app_sync",
    "plain_run",
    "read_ahead",
    "request",
    "run_body",
    "take",
    "workdir_run",
    "workdir_run_body",
]

RUN = "run"
APP_SYNC = "app sync"
"""The forms taken here, as :func:`take` names them."""

RUN_PATH = "/api/v1/jobs?stream=true"
"""The node process's route for a run that streams its events."""
APP_SYNC_PATH = "/api/v1/apps/sync"
"""The node process's route for an app sync (one JSON answer: the sync's view)."""

_INTERRUPTED = {RUN: "Interrupted before the job started.\n", APP_SYNC: "Interrupted.\n"}
"""What each form says when interrupted before its answer was read (as the command
says it then)."""

_COMPLETE_VAR = "_GPUMESH_COMPLETE"

_ahead: list[tuple[str, dict[str, object], NodeClient, Pending]] = []
"""The request sent ahead, if any: its form, its body, the client, and its answer
(not read yet, or :class:`~gpumesh.daemon.client.Read` when :func:`finish` or
:func:`finish_run` read it and left it to the command)."""
_failed: list[tuple[str, dict[str, object], GPUMeshError]] = []
"""Why the node process could not be reached for the request, if so: the command
says it rather than trying again (a node process that never answers would make it
wait the whole start-up ceiling a second time)."""
_readers: list[RunReader] = []
"""The reader of a run sent ahead that :func:`finish_run` began and left to the
command (what it printed, the job, the last event id)."""


def _options(
    rest: list[str], valued: tuple[str, ...], flags: tuple[str, ...]
) -> tuple[dict[str, str], int] | None:
    """The options at the start of ``rest`` and the index where they end (at
    ``--`` or the first argument that is not an option); None unless click would
    read each the same way: a known name, given once, a value (after ``=`` or as
    the next argument) that is not empty and does not look like an option, a flag
    without a value."""
    values: dict[str, str] = {}
    index = 0
    while index < len(rest):
        arg = rest[index]
        if arg == "--" or not arg.startswith("-"):
            break
        if arg in values:
            return None
        if arg in flags:
            values[arg] = ""
            index += 1
            continue
        name, equals, value = arg.partition("=")
        if name not in valued or name in values:
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
    return values, index


def _run_form(argv: list[str], valued: tuple[str, ...]) -> tuple[dict[str, str], list[str]] | None:
    """The options (among ``valued``) and the command of ``run --peer P [OPTIONS] [--]
    COMMAND...``; None for any other command line (the CLI parses it)."""
    if not argv or argv[0] != "run":
        return None
    rest = argv[1:]
    options = _options(rest, valued, ())
    if options is None:
        return None
    values, index = options
    if index < len(rest) and rest[index] == "--":
        index += 1
    command = rest[index:]
    if "--peer" not in values or not command:
        return None
    return values, command


def plain_run(argv: list[str]) -> tuple[str, str | None, list[str]] | None:
    """``(peer, image, command)`` of ``run --peer P [--image I] [--] COMMAND...``;
    None for any other command line (the CLI parses it)."""
    form = _run_form(argv, ("--peer", "--image"))
    if form is None:
        return None
    values, command = form
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


def workdir_run(argv: list[str]) -> tuple[str, str | None, str, list[str]] | None:
    """``(peer, image, workdir, command)`` of ``run --peer P [--image I] --workdir D
    [--] COMMAND...`` (options in any order) where the command's own checks pass: a
    peer name that is not blank, an image name without spaces, D an existing folder
    (after ``~`` is expanded, as the command expands it); None for any other command
    line, whose refusal, if any, the command then says itself."""
    form = _run_form(argv, ("--peer", "--image", "--workdir"))
    if form is None or "--workdir" not in form[0]:
        return None
    values, command = form
    peer, image, workdir = values["--peer"], values.get("--image"), values["--workdir"]
    if not peer.strip() or (image is not None and any(ch.isspace() for ch in image)):
        return None
    from pathlib import Path

    try:
        if not Path(workdir).expanduser().is_dir():
            return None
    except (RuntimeError, OSError):  # a ~user unknown here, a path the system refuses
        return None
    return peer, image, workdir, command


def workdir_run_body(
    peer: str, image: str | None, workdir: str, command: list[str]
) -> dict[str, object]:
    """The node process's request for ``run`` with a workdir: what the command sends
    for it once its job spec is built (the folder made absolute as the spec makes it,
    the spec's defaults for the options not given)."""
    from pathlib import Path

    return {
        **run_body(peer, image, command),
        "gpu_memory": 0,
        "retries": 0,
        "timeout": 0.0,
        "workdir": str(Path(workdir).expanduser().resolve()),
    }


def plain_app_sync(argv: list[str]) -> tuple[str, str, bool, bool] | None:
    """``(peer, folder, dry_run, as_json)`` of ``app sync --peer P --dir D [--dry-run]
    [--json]`` (in any order) where D is a readable folder (click refuses a file or
    an unreadable path itself, and a missing one is the node process's to refuse
    after click); None for any other command line."""
    if argv[:2] != ["app", "sync"]:
        return None
    rest = argv[2:]
    options = _options(rest, ("--peer", "--dir"), ("--dry-run", "--json"))
    if options is None:
        return None
    values, index = options
    if index != len(rest) or "--peer" not in values or "--dir" not in values:
        return None
    folder = values["--dir"]
    if not (os.path.isdir(folder) and os.access(folder, os.R_OK)):
        return None
    return values["--peer"], folder, "--dry-run" in values, "--json" in values


def app_sync_body(peer: str, folder: str, dry_run: bool) -> dict[str, object]:
    """The node process's request for ``app sync``: what the command sends for it."""
    return {"peer": peer, "dir": os.path.abspath(folder), "dry_run": dry_run}


def request(argv: list[str]) -> tuple[str, dict[str, object]] | None:
    """``(form, body)`` of a command line taken here; None for any other."""
    run = plain_run(argv)
    if run is not None:
        return RUN, run_body(*run)
    with_workdir = workdir_run(argv)
    if with_workdir is not None:
        return RUN, workdir_run_body(*with_workdir)
    sync = plain_app_sync(argv)
    if sync is not None:
        return APP_SYNC, app_sync_body(*sync[:3])
    return None


def start(argv: list[str]) -> bool:
    """Send the request of a form taken here to the node process now; whether it was sent."""
    if _COMPLETE_VAR in os.environ:
        return False
    taken = request(argv)
    if taken is None:
        return False
    from gpumesh.settings import ENV_HOME, home_dir

    # As the CLI's --home option reads it (its environment variable, else the default).
    home = home_dir(os.environ.get(ENV_HOME) or None)
    # click checks the home as a readable folder before any command runs.
    if not (os.access(home, os.R_OK) and (home / "identity.key").exists()):
        return False
    from gpumesh.daemon.client import connect
    from gpumesh.errors import GPUMeshError

    form, body = taken
    try:
        client = connect(home)
    except GPUMeshError as exc:
        _failed.append((form, body, exc))
        return False
    try:
        answer = client.send("POST", RUN_PATH if form == RUN else APP_SYNC_PATH, body)
    except Exception:  # no whole request went out: the CLI sends it and says what went wrong
        return False
    _ahead.append((form, body, client, answer))
    return True


def take(
    form: str, body: dict[str, object] | JobBody | SyncBody
) -> tuple[NodeClient, Pending] | None:
    """The client and the answer of the request sent ahead, for the command ``form``
    with ``body``; None when none was sent. Raises what kept :func:`start`
    from the node process. What was sent ahead is compared as a dict beside a
    dict, else as the struct it converts to (see :func:`_as`)."""
    if _failed:
        failed_form, failed_body, failure = _failed.pop()
        if (failed_form, _as(failed_body, body)) == (form, body):
            raise failure
    if not _ahead:
        return None
    sent = _ahead.pop()
    if (sent[0], _as(sent[1], body)) != (form, body):
        raise RuntimeError(
            f"the {sent[0]} sent ahead was {sent[1]!r}, the command line means {form} {body!r}"
        )
    return sent[2], sent[3]


def _as(sent: dict[str, object], like: dict[str, object] | JobBody | SyncBody) -> object:
    """The body sent ahead in ``like``'s form: as it is beside a dict (no msgspec
    loaded for a plain run or sync), else as the struct of ``like``'s kind (None
    if it is not one)."""
    if isinstance(like, dict):
        return sent
    import msgspec

    try:
        return msgspec.convert(sent, type(like))
    except msgspec.ValidationError:
        return None


def finish(argv: list[str]) -> int | None:
    """For an app sync sent ahead: read its answer and print it as the command would,
    without loading the CLI; the exit status, or None to leave it to the command
    (no app sync sent; a failure, which the command then raises as its own call
    would; output click might not echo byte for byte, which it then prints)."""
    sync = plain_app_sync(argv)
    if sync is None or not _ahead or _ahead[-1][0] != APP_SYNC:
        return None
    from gpumesh.settings import ENV_LOG

    if os.environ.get(ENV_LOG) or sys.stdout is None:
        return None  # the CLI's logging set up as it asks; no stdout: click's way
    from gpumesh.client.views.apps import SyncView
    from gpumesh.daemon.client import Read

    form, body, client, answer = _ahead.pop()
    try:
        view = answer.answer(SyncView)
    except Exception as exc:  # the command's own reading raises it, said once as ever
        _ahead.append((form, body, client, Read(error=exc)))
        return None
    from gpumesh.cli._syncview import view_output

    texts = view_output(view, as_json=sync[3], dry_run=sync[2])
    if not all(text.isascii() and "\x1b" not in text for text in texts):
        # click.echo may re-encode or strip escapes: the command prints it.
        _ahead.append((form, body, client, Read(view)))
        return None
    try:
        for text in texts:
            sys.stdout.write(text + "\n")  # as click.echo writes a str
            sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        return 1  # as the CLI's entry when its output cannot be flushed
    return 0


def finish_run(argv: list[str]) -> int | None:
    """For a run sent ahead: print its events as the command would (its printer)
    without loading the CLI, and the exit status once it ended; None to leave it
    to the command: no run sent ahead, logging asked for, or something other than
    the end came out of the events (a failure, the node process gone, Ctrl-C). The
    command then meets that where the reading stopped, with the reader
    (:func:`read_ahead`), and nothing is printed or sent twice."""
    if plain_run(argv) is None and workdir_run(argv) is None:
        return None
    if not _ahead or _ahead[-1][0] != RUN:
        return None
    from gpumesh.settings import ENV_LOG

    if os.environ.get(ENV_LOG) or sys.stdout is None or sys.stderr is None:
        return None  # the CLI's logging set up as it asks; no stdout: click's way
    from gpumesh.cli._notes import RunReader, ViewPrinter, exit_status_of
    from gpumesh.client.views.runs import RUN_EVENTS
    from gpumesh.daemon.client import Read

    form, body, client, answer = _ahead.pop()
    # The plain form has no --quiet or --explain: the command's printer for it.
    reader = RunReader(ViewPrinter(""))
    try:
        result = reader.read(answer.events(RUN_EVENTS))
    except BaseException as exc:  # the command's own reading meets it
        _ahead.append((form, body, client, Read(error=exc)))
        _readers.append(reader)
        return None
    code = exit_status_of(result.state, result.exit_code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        return code or 1  # as the CLI's entry when its output cannot be flushed
    return code


def read_ahead() -> RunReader | None:
    """The reader :func:`finish_run` left to the command of the run it began to read;
    None when it read nothing (for the run that :func:`take` just gave)."""
    return _readers.pop() if _readers else None


def entry() -> None:
    """Console-script entry: the head start, then :func:`gpumesh.cli.main.entry`
    (not for an app sync that :func:`finish` printed, nor a run :func:`finish_run`
    saw to its end)."""
    from gpumesh.daemon import setting_gone

    setting_gone()
    try:
        if start(sys.argv[1:]):
            code = finish(sys.argv[1:])
            if code is None:
                code = finish_run(sys.argv[1:])
            if code is not None:
                os._exit(code)
        from gpumesh.cli.main import entry as cli_entry
    except KeyboardInterrupt:
        # As the command says it when interrupted before its answer was read.
        form = _ahead[-1][0] if _ahead else ""
        sys.stderr.write(_INTERRUPTED.get(form, "Interrupted.\n"))
        sys.stderr.flush()
        os._exit(130)
    cli_entry()
