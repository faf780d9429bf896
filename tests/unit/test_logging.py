"""cli/_common.setup_logging: a private log file."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.cli import _common
from gpumesh.cli._common import setup_logging


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
    handler = _common._PrivateLogFile(logs / "gpumesh.log")
    try:
        assert stat.S_IMODE(os.stat(logs / "gpumesh.log").st_mode) == 0o600
    finally:
        handler.close()
