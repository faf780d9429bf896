"""The pieces :func:`gpumesh.cli._common.setup_logging` puts together: one-line
records, the ``GPUMESH_LOG`` filter, and the debug log file, private from its
first byte.

Apart from :mod:`gpumesh.cli._common` because ``logging`` and
``logging.handlers`` (with the ``socket``, ``pickle`` and ``queue`` they import)
are needed only by a command that logs, not by ``gpumesh --help`` or the thin
commands that ask the node process.
"""

from __future__ import annotations

import io
import logging
import logging.handlers
import os

from gpumesh.cli._text import escape_controls
from gpumesh.store.modes import open_private

__all__ = ["LevelFilter", "OneLineFormatter", "PrivateLogFile", "parse_log_filter"]

_CONTINUATION = "    "


class PrivateLogFile(logging.handlers.RotatingFileHandler):
    """The debug log, 0600 from its first byte (and after each rotation)."""

    def _open(self) -> io.TextIOWrapper:
        fd = open_private(self.baseFilename, os.O_WRONLY | os.O_APPEND)
        return open(fd, "a", encoding=self.encoding, errors=self.errors)


class OneLineFormatter(logging.Formatter):
    """A record's own text on one line, so text from peers cannot forge a record.

    Names, paths, commands and error texts from peers reach log lines through the
    arguments of logger calls all over the code base; escaping here, where the
    handlers are set up, covers every one of them. What a record carries over
    several lines on purpose (a traceback, a stack) follows with every line
    indented, so none of its lines can pass for a record either.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        # After the escaped first line, only a traceback or a stack can follow.
        first, _, rest = super().format(record).partition("\n")
        if not rest:
            return first
        lines = rest.split("\n")
        return "\n".join([first, *(_CONTINUATION + escape_controls(line) for line in lines)])


class LevelFilter(logging.Filter):
    def __init__(self, default: int, per_logger: dict[str, int]) -> None:
        super().__init__()
        self.default = default
        self.per_logger = per_logger

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "gpumesh_said", False):
            return False  # a share's line, which its output shows already
        level = self.default
        for name, value in self.per_logger.items():
            if record.name == name or record.name.startswith(name + "."):
                level = value
        return record.levelno >= level


def parse_log_filter(spec: str) -> tuple[int, dict[str, int], list[str]]:
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
