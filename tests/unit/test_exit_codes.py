"""One table of exit codes (errors.ExitCode): every error keeps to it, and the
README and `gpumesh --help` show exactly it."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from gpumesh.cli.main import cli
from gpumesh.errors import (
    EXIT_MEANINGS,
    JOB_CODES_NOTE,
    ExitCode,
    GPUMeshError,
    exit_code_rows,
)

ROOT = Path(__file__).resolve().parents[2]


def _error_classes() -> list[type[GPUMeshError]]:
    found: list[type[GPUMeshError]] = []
    pending: list[type[GPUMeshError]] = [GPUMeshError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def test_every_code_has_a_meaning_and_the_codes_are_distinct() -> None:
    assert set(EXIT_MEANINGS) == set(ExitCode)
    codes = [code for code, _ in exit_code_rows()]
    assert codes == sorted(set(codes))
    assert all(meaning.strip() for _, meaning in exit_code_rows())


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda cls: cls.__name__)
def test_every_error_exits_with_a_code_of_the_table(cls: type[GPUMeshError]) -> None:
    assert isinstance(cls.exit_code, ExitCode)
    assert cls.exit_code not in (ExitCode.OK, ExitCode.INTERNAL)
    assert cls.exit_code < ExitCode.JOB_TIMED_OUT  # the codes above are the jobs'


def test_clicks_usage_errors_agree_with_the_table() -> None:
    assert click.UsageError("x").exit_code == ExitCode.USAGE


def test_the_readme_shows_the_table() -> None:
    text = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- exit codes:.*?-->\n(.*?)<!-- end of exit codes -->", text, re.S)
    assert found is not None, "the README's exit code table lost its markers"
    rows = "\n".join(f"| `{code}` | {meaning} |" for code, meaning in exit_code_rows())
    expected = f"| exit code | meaning |\n|---|---|\n{rows}\n\n{JOB_CODES_NOTE}.\n"
    assert found.group(1) == expected


def test_help_shows_the_table() -> None:
    result = CliRunner().invoke(cli, ["--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.output.splitlines()]
    start = lines.index("Exit codes:")
    shown = lines[start + 1 : start + 1 + len(ExitCode)]
    assert shown == [f"{code}  {meaning}" for code, meaning in exit_code_rows()]
    note = " ".join(lines[start + 1 + len(ExitCode) :]).strip()
    assert note == JOB_CODES_NOTE


def test_a_node_process_that_stops_answering_is_one_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gpumesh.cli._common import run_cli
    from gpumesh.errors import NodeUnavailableError

    @click.command()
    def lost() -> None:
        raise NodeUnavailableError.because("the answer ended early")

    assert issubclass(NodeUnavailableError, GPUMeshError)
    assert run_cli(lost, []) == ExitCode.FAILED  # was an internal failure (70)
    err = capsys.readouterr().err
    assert err == "error: the node process did not answer: the answer ended early\n"
