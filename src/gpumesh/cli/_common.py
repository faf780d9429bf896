"""What every command shares: the node, async running, output and errors."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from gpumesh.errors import ExitCode, GPUMeshError

if TYPE_CHECKING:
    from pathlib import Path

    from gpumesh.store.home import AgentInfo, Home

# What only some commands need (logging and its handlers, the settings and their
# pathlib, the log file's modes) is imported where it is used: `gpumesh --help`
# and the thin commands through the node process start without it.

__all__ = [
    "DURATION",
    "click_error_line",
    "emit_json",
    "fail",
    "get_node",
    "json_option",
    "print_error",
    "run_async",
    "run_cli",
    "setup_logging",
]

T = TypeVar("T")


class _Duration(click.ParamType[float]):
    """Seconds from a duration as every flag takes one: ``5s``, ``2m``, ``1h30m``;
    a bare number is seconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float | int):
            return float(value)
        from gpumesh.units import parse_duration

        try:
            return parse_duration(str(value))
        except GPUMeshError as exc:
            self.fail(exc.message, param, ctx)


DURATION = _Duration()

json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
"""``--json``, as every command that says what it did takes it."""


class _LogState:
    file: Path | None = None


def get_node(ctx: click.Context | None = None) -> Any:
    """The :class:`gpumesh.client.node.Node` for ``--home`` / ``$GPUMESH_HOME``."""
    from gpumesh.client.node import Node

    ctx = ctx or click.get_current_context()
    root = ctx.find_root()
    node = Node(root.obj)
    setup_logging(node.home.logs_dir if node.home.initialized else None)
    ctx.call_on_close(node.close)
    if node.home.initialized:
        ctx.call_on_close(_share_seen_from(node.home))
    return node


class _NodeProcessShare:
    """The share of the node process holding a home, as the commands that run the
    client layer in this process see it (``status``, ``doctor``, the owner's
    views): what ``GET /api/v1/share`` says, asked once, when first needed. Owner
    actions never come here: they go through the node process (:mod:`gpumesh.cli._node`)."""

    def __init__(self, home: Path) -> None:
        self.home = home

    def info(self) -> AgentInfo | None:
        return self._answer

    @functools.cached_property
    def _answer(self) -> AgentInfo | None:
        from gpumesh.control.shareviews import ShareView
        from gpumesh.daemon.client import NodeClient, NodeUnavailableError

        try:
            return NodeClient(self.home).call("GET", "/api/v1/share", ShareView, timeout=30).agent
        except NodeUnavailableError:
            return None

    def changed(self) -> None:
        raise RuntimeError(_OWNER_ACTIONS)

    def end_session(self, session_id: str) -> bool:
        raise RuntimeError(_OWNER_ACTIONS)


_OWNER_ACTIONS = "an owner's action on a shared home goes through its node process"


def _share_seen_from(home: Home) -> Callable[[], None]:
    """Let this process's client layer see the share of the node process holding
    ``home``, if one does (it is the only place a share runs); returns what
    undoes it, for the command's end."""
    from gpumesh.daemon.record import holder

    record = holder(home.path)
    if record is None or record.pid == os.getpid() or home.agent is not None:
        return lambda: None
    seen = _NodeProcessShare(home.path)
    home.attach_agent(seen)
    return lambda: home.detach_agent(seen)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """:func:`gpumesh.blocking.run_async`, loaded when a command first runs a loop."""
    from gpumesh import blocking

    return blocking.run_async(coro)


def emit_json(view: object) -> None:
    """Print a view struct (:mod:`gpumesh.client.views`), or a list of them, as JSON."""
    from gpumesh.client.views import to_json

    click.echo(to_json(view))


def print_error(message: str) -> None:
    prefix = click.style("error:", fg="red", bold=True) if sys.stderr.isatty() else "error:"
    click.echo(f"{prefix} {message}", err=True)


def _warn(message: str) -> None:
    prefix = click.style("warning:", fg="yellow", bold=True) if sys.stderr.isatty() else "warning:"
    click.echo(f"{prefix} {message}", err=True)


def fail(message: str, code: int = ExitCode.FAILED) -> NoReturn:
    print_error(message)
    raise SystemExit(code)


def setup_logging(logs_dir: Path | None, *, console_level: str | None = None) -> None:
    """Console handler at GPUMESH_LOG (default warning); debug log file per node."""
    import logging

    from gpumesh.cli._logsetup import (
        LevelFilter,
        OneLineFormatter,
        PrivateLogFile,
        parse_log_filter,
    )
    from gpumesh.settings import ENV_LOG, env

    root = logging.getLogger("gpumesh")
    if getattr(root, "_gpumesh_configured", False):
        return
    root._gpumesh_configured = True  # type: ignore[attr-defined]
    root.setLevel(logging.DEBUG)
    spec = env(ENV_LOG) or console_level or "warning"
    default_level, per_logger, ignored = parse_log_filter(spec)
    if ignored:
        _warn(
            f"{ENV_LOG}={spec!r}: ignored {', '.join(repr(part) for part in ignored)}; "
            "a filter is a level (debug, info, warning, error) and/or LOGGER=LEVEL pairs "
            f"separated by commas, e.g. {ENV_LOG}=info,gpumesh.transport=debug"
        )
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.DEBUG)
    console.setFormatter(
        OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    console.addFilter(LevelFilter(default_level, per_logger))
    root.addHandler(console)
    if logs_dir is not None:
        try:
            logs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            _LogState.file = logs_dir / "gpumesh.log"
            handler = PrivateLogFile(
                _LogState.file,
                maxBytes=2_000_000,
                backupCount=3,
                encoding="utf-8",
                errors="backslashreplace",
            )
            handler.setLevel(logging.DEBUG)
            handler.setFormatter(
                OneLineFormatter(f"%(asctime)s {os.getpid()} %(levelname)s %(name)s: %(message)s")
            )
            root.addHandler(handler)
        except OSError:
            _LogState.file = None


def run_cli(command: click.Command, argv: list[str] | None) -> int:
    try:
        command.main(args=argv, prog_name="gpumesh", standalone_mode=False)
    except GPUMeshError as exc:
        _debug_log("command failed")
        print_error(exc.message)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return ExitCode.INTERRUPTED
    except click.exceptions.NoArgsIsHelpError as exc:  # a group alone: its help
        exc.show()
        return exc.exit_code
    except click.ClickException as exc:
        print_error(click_error_line(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        return ExitCode.INTERRUPTED
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:
        # The traceback goes to the debug log only (the console shows warnings and up).
        _debug_log("unexpected failure")
        where = f" (details in {_LogState.file})" if _LogState.file else ""
        print_error(f"unexpected internal failure{where}; please report it")
        from gpumesh.settings import ENV_LOG, env

        if env(ENV_LOG):
            raise
        return ExitCode.INTERNAL
    return ExitCode.OK


def click_error_line(exc: click.ClickException) -> str:
    """A usage error as one line, like every other error: what was wrong and
    where the command's help is (click prints its usage, a hint and ``Error:``)."""
    message = exc.format_message()
    ctx = exc.ctx if isinstance(exc, click.UsageError) else None
    if ctx is None:
        return message
    return f"{message.rstrip('.')} (see `{ctx.command_path} --help`)"


def _debug_log(message: str) -> None:
    """The failure being handled, with its traceback, to the debug log (if any).

    A command that never set logging up (a thin one) has no log to write to:
    it does not import :mod:`logging` just to find that out."""
    logging = sys.modules.get("logging")
    if logging is not None:
        logging.getLogger("gpumesh.cli").debug(message, exc_info=True)
