"""cli/_common.setup_logging: one line per record whatever peers send, a private log file."""

from __future__ import annotations

import io
import logging
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.cli import _common
from gpumesh.cli._common import setup_logging
from gpumesh.cli._logsetup import PrivateLogFile

FORGED = "busybox\n2026-01-01 00:00:00 1 INFO gpumesh.agent: forged"
ESCAPED = "busybox\\n2026-01-01 00:00:00 1 INFO gpumesh.agent: forged"
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \d+ [A-Z]+ gpumesh")


@pytest.fixture
def configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The project's logging set up for a node's logs folder; the log file's path.

    Logging is process-wide: whatever the test set up is taken down again.
    """
    monkeypatch.setenv("GPUMESH_LOG", "debug")
    root = logging.getLogger("gpumesh")
    before = (list(root.handlers), root.level, root.__dict__.get("_gpumesh_configured"))
    root.__dict__.pop("_gpumesh_configured", None)
    logs = tmp_path / "logs"
    setup_logging(logs)
    try:
        yield logs / "gpumesh.log"
    finally:
        for handler in list(root.handlers):
            if handler not in before[0]:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(before[1])
        root.__dict__.pop("_gpumesh_configured", None)
        if before[2] is not None:
            root._gpumesh_configured = before[2]  # type: ignore[attr-defined]
        _common._LogState.file = None


def _lines(path: Path) -> list[str]:
    for handler in logging.getLogger("gpumesh").handlers:
        handler.flush()
    return path.read_text(encoding="utf-8").splitlines()


def test_a_peers_newline_cannot_forge_a_record(configured: Path) -> None:
    console = io.StringIO()
    for handler in logging.getLogger("gpumesh").handlers:
        if type(handler) is logging.StreamHandler:
            handler.setStream(console)
    logging.getLogger("gpumesh.agent.jobs").info("[job %s] accepted: %s", "abc123", FORGED)
    lines = _lines(configured)
    assert len(lines) == 1
    assert lines[0].endswith(f"[job abc123] accepted: {ESCAPED}")
    (shown,) = console.getvalue().splitlines()
    assert shown.endswith(f"[job abc123] accepted: {ESCAPED}")


def test_controls_are_escaped_and_other_text_kept(configured: Path) -> None:
    name = "a\rb\tc\x1b[31md\x7fe\x85f\u2028g é 日本 ü"
    logging.getLogger("gpumesh.agent.files").info("received %s", name)
    (line,) = _lines(configured)
    assert line.endswith("received a\\x0db\\x09c\\x1b[31md\\x7fe\\x85f\\u2028g é 日本 ü")


def test_a_traceback_stays_readable_and_cannot_pass_for_a_record(configured: Path) -> None:
    try:
        raise ValueError(f"bad image {FORGED}")
    except ValueError:
        logging.getLogger("gpumesh.agent.server").exception("request failed for %s", FORGED)
    lines = _lines(configured)
    assert [bool(RECORD.match(line)) for line in lines] == [True] + [False] * (len(lines) - 1)
    assert lines[0].endswith(f"request failed for {ESCAPED}")
    assert lines[1] == "    Traceback (most recent call last):"
    assert all(line.startswith("    ") for line in lines[1:])
    assert '    raise ValueError(f"bad image {FORGED}")' in "\n".join(lines)
    assert lines[-2:] == [
        "    ValueError: bad image busybox",
        "    2026-01-01 00:00:00 1 INFO gpumesh.agent: forged",
    ]


def test_a_stack_is_indented_too(configured: Path) -> None:
    logging.getLogger("gpumesh.cli").debug("where %s", "am I", stack_info=True)
    lines = _lines(configured)
    assert lines[0].endswith("where am I")
    assert lines[1] == "    Stack (most recent call last):"
    assert all(line.startswith("    ") for line in lines[1:])


@pytest.mark.usefixtures("open_umask")
def test_the_log_file_is_private_and_stays_so_after_rotation(
    configured: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = logging.getLogger("gpumesh.agent")
    logger.debug("first")
    assert stat.S_IMODE(os.stat(configured).st_mode) == 0o600
    (handler,) = [h for h in logging.getLogger("gpumesh").handlers if hasattr(h, "doRollover")]
    handler.doRollover()  # type: ignore[attr-defined]
    logger.debug("second")
    rotated = configured.with_name("gpumesh.log.1")
    assert rotated.read_text().endswith("first\n")
    assert stat.S_IMODE(os.stat(rotated).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(configured).st_mode) == 0o600


@pytest.mark.usefixtures("open_umask")
def test_a_wider_log_file_is_narrowed_when_opened(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "gpumesh.log").write_text("old\n")
    (logs / "gpumesh.log").chmod(0o644)
    handler = PrivateLogFile(logs / "gpumesh.log")
    try:
        assert stat.S_IMODE(os.stat(logs / "gpumesh.log").st_mode) == 0o600
    finally:
        handler.close()
