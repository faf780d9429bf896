"""What every command shares: the node, async running, output and errors."""

from __future__ import annotations

import io
import logging
import logging.handlers
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from gpumesh.errors import ExitCode, GPUMeshError
from gpumesh.settings import ENV_LOG, env
from gpumesh.store.modes import open_private

__all__ = [
    "emit_json",
    "fail",
    "get_node",
    "print_error",
    "run_async",
    "run_cli",
    "setup_logging",
]

T = TypeVar("T")


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
    return node


def run_async(coro: Coroutine[Any, Any, T]) -> T:

    from gpumesh import platform

    return platform.run(coro)


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
    root = logging.getLogger("gpumesh")
    if getattr(root, "_gpumesh_configured", False):
        return
    root._gpumesh_configured = True  # type: ignore[attr-defined]
    root.setLevel(logging.DEBUG)
    spec = env(ENV_LOG) or console_level or "warning"
    default_level, per_logger, ignored = _parse_log_filter(spec)
    if ignored:
        _warn(
            f"{ENV_LOG}={spec!r}: ignored {', '.join(repr(part) for part in ignored)}; "
            "a filter is a level (debug, info, warning, error) and/or LOGGER=LEVEL pairs "
            f"separated by commas, e.g. {ENV_LOG}=info,gpumesh.transport=debug"
        )
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.DEBUG)
    console.setFormatter(
        _OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    console.addFilter(_LevelFilter(default_level, per_logger))
    root.addHandler(console)
    if logs_dir is not None:
        try:
            logs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            _LogState.file = logs_dir / "gpumesh.log"
            handler = _PrivateLogFile(
                _LogState.file,
                maxBytes=2_000_000,
                backupCount=3,
                encoding="utf-8",
                errors="backslashreplace",
            )
            handler.setLevel(logging.DEBUG)
            handler.setFormatter(
                _OneLineFormatter(f"%(asctime)s {os.getpid()} %(levelname)s %(name)s: %(message)s")
            )
            root.addHandler(handler)
        except OSError:
            _LogState.file = None


# Line breaks and terminal controls a peer could put in a name, a path or an error text.
# U+2028 and U+2029 are not controls but end a line for many readers.
_ESCAPES = {code: f"\\x{code:02x}" for code in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
_ESCAPES |= {ord("\n"): "\\n", 0x2028: "\\u2028", 0x2029: "\\u2029"}
_CONTINUATION = "    "


def _escape_controls(text: str) -> str:
    """``text`` on one line: a newline as ``\\n``, other controls as ``\\xNN``."""
    return text.translate(_ESCAPES)


class _OneLineFormatter(logging.Formatter):
    """A record's own text on one line, so text from peers cannot forge a record.

    Names, paths, commands and error texts from peers reach log lines through the
    arguments of logger calls all over the code base; escaping here, where the
    handlers are set up, covers every one of them. What a record carries over
    several lines on purpose (a traceback, a stack) follows with every line
    indented, so none of its lines can pass for a record either.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        return _escape_controls(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        # After the escaped first line, only a traceback or a stack can follow.
        first, _, rest = super().format(record).partition("\n")
        if not rest:
            return first
        lines = rest.split("\n")
        return "\n".join([first, *(_CONTINUATION + _escape_controls(line) for line in lines)])


class _PrivateLogFile(logging.handlers.RotatingFileHandler):
    """The debug log, 0600 from its first byte (and after each rotation)."""

    def _open(self) -> io.TextIOWrapper:
        fd = open_private(self.baseFilename, os.O_WRONLY | os.O_APPEND)
        return open(fd, "a", encoding=self.encoding, errors=self.errors)


class _LevelFilter(logging.Filter):
    def __init__(self, default: int, per_logger: dict[str, int]) -> None:
        super().__init__()
        self.default = default
        self.per_logger = per_logger

    def filter(self, record: logging.LogRecord) -> bool:
        level = self.default
        for name, value in self.per_logger.items():
            if record.name == name or record.name.startswith(name + "."):
                level = value
        return record.levelno >= level


def _parse_log_filter(spec: str) -> tuple[int, dict[str, int], list[str]]:
    """The default level, the levels per logger, and the parts that are neither."""
    default = logging.WARNING
    per_logger: dict[str, int] = {}
    ignored: list[str] = []
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            continue
        name, sep, level_text = part.rpartition("=")
        level = logging.getLevelName(level_text.upper())
        if not isinstance(level, int) or "=" in name or (sep and not name):
            ignored.append(part)
        elif name:
            per_logger[name] = level
        else:
            default = level
    return default, per_logger, ignored


def run_cli(command: click.Command, argv: list[str] | None) -> int:
    try:
        command.main(args=argv, prog_name="gpumesh", standalone_mode=False)
    except GPUMeshError as exc:
        logging.getLogger("gpumesh.cli").debug("command failed", exc_info=True)
        print_error(exc.message)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return ExitCode.INTERRUPTED
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        return ExitCode.INTERRUPTED
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:
        # The traceback goes to the debug log only (the console shows warnings and up).
        logging.getLogger("gpumesh.cli").debug("unexpected failure", exc_info=True)
        where = f" (details in {_LogState.file})" if _LogState.file else ""
        print_error(f"unexpected internal failure{where}; please report it")
        if env(ENV_LOG):
            raise
        return ExitCode.INTERNAL
    return ExitCode.OK
