"""A node process that cannot start says why in its log; the command that started
it raises that error (its class, message and exit code), not "see the log"."""

from __future__ import annotations

from pathlib import Path

from gpumesh.daemon.client import _start_failure, start_failure_line
from gpumesh.errors import AgentError, ConfigError, ExitCode, IdentityError


def _log(home: Path, text: str) -> int:
    logs = home / "logs"
    logs.mkdir(exist_ok=True)
    with (logs / "node.log").open("a") as file:
        file.write(text)
    return (logs / "node.log").stat().st_size


def test_the_node_process_own_error_is_raised(tmp_path: Path) -> None:
    since = _log(tmp_path, "an earlier run\n")
    failure = ConfigError("/h/gpumesh.db is a link: remove it")
    _log(tmp_path, f"error: {failure.message}\n{start_failure_line(failure)}\n")
    raised = _start_failure(tmp_path, 2, since)
    assert isinstance(raised, ConfigError) and raised.message == failure.message
    assert raised.exit_code == ExitCode.USAGE


def test_only_what_this_start_logged_counts(tmp_path: Path) -> None:
    stale = start_failure_line(IdentityError("an old failure, since fixed"))
    since = _log(tmp_path, f"{stale}\n")
    _log(tmp_path, "Traceback (most recent call last):\n  ...\n")
    raised = _start_failure(tmp_path, 1, since)
    assert type(raised) is AgentError
    assert "exited at start (code 1): see" in raised.message
    assert str(tmp_path / "logs" / "node.log") in raised.message


def test_a_garbled_line_or_no_log_says_where_to_look(tmp_path: Path) -> None:
    assert type(_start_failure(tmp_path, 1, 0)) is AgentError  # no log at all
    _log(tmp_path, 'gpumesh-node-error: {"code": 7}\n')
    assert type(_start_failure(tmp_path, 1, 0)) is AgentError
