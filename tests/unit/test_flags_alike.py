"""The same flag means the same everywhere: a usage error is one ``error:`` line
like every other error, ``--timeout`` takes a duration, ``$GPUMESH_PEER`` stands
for a missing peer wherever a peer is taken, and ``gpumesh-control`` answers
``-h`` and ``--version`` as the other servers do.

Commands run in this process against a home that was never made: a flag that
parsed shows as the home's error, one that did not as the usage error."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.cli._common import run_cli
from gpumesh.cli.main import cli
from gpumesh.daemon import main as control
from gpumesh.errors import ExitCode
from tests.cli import own_logging

NO_HOME = "no GPUMesh node in"


@pytest.fixture(autouse=True)
def _no_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMESH_HOME", str(tmp_path / "never-made"))
    monkeypatch.delenv("GPUMESH_PEER", raising=False)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The exit code and the one line of stderr of ``gpumesh ARGS``."""
    with own_logging():  # as the command's own process's end would
        code = run_cli(cli, list(args))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return code, lines[0]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (("jobs", "--bogus"), "error: No such option '--bogus' (see `gpumesh jobs --help`)"),
        (("connect",), "error: Missing argument 'PEER' (see `gpumesh connect --help`)"),
        (("bogus",), "error: No such command 'bogus' (see `gpumesh --help`)"),
        (
            ("cuda", "demo"),
            "error: Missing option '--peer' (env var: 'GPUMESH_PEER') "
            "(see `gpumesh cuda demo --help`)",
        ),
    ],
)
def test_a_usage_error_is_one_error_line_that_points_at_the_help(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], line: str
) -> None:
    assert _run(capsys, *args) == (ExitCode.USAGE, line)


@pytest.mark.parametrize(
    "args",
    [
        ("connect", "alice-pc", "--timeout", "5s"),
        ("connect", "alice-pc", "--timeout", "2"),
        ("sync", "--timeout", "1m"),
        ("share", "stop", "--timeout", "500ms"),
    ],
)
def test_timeout_takes_a_duration_or_seconds(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...]
) -> None:
    code, line = _run(capsys, *args)
    # `share stop` with no node process: nothing to stop, said on stdout.
    assert NO_HOME in line or code == ExitCode.OK, line


def test_a_timeout_that_is_no_duration_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, line = _run(capsys, "connect", "alice-pc", "--timeout", "soon")
    assert code == ExitCode.USAGE
    assert line == (
        "error: Invalid value for '--timeout': invalid duration 'soon': use seconds or a "
        "number with a unit, such as 90s, 30m, 2h or 1h30m (see `gpumesh connect --help`)"
    )


@pytest.mark.parametrize(
    "args",
    [
        ("exec",),
        ("desktop", "connect"),
        ("cuda", "demo"),
        ("cuda", "bench"),
        ("cuda", "bridge"),
        ("connect",),
    ],
)
def test_gpumesh_peer_stands_for_a_missing_peer(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    monkeypatch.setenv("GPUMESH_PEER", "alice-pc")
    code, line = _run(capsys, *args)
    assert NO_HOME in line and code == ExitCode.USAGE, line


def test_cuda_takes_gpu_memory_and_still_memory(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--gpu-memory", "--memory"):
        code, line = _run(capsys, "cuda", "demo", "--peer", "alice-pc", flag, "0")
        assert (code, line) == (
            ExitCode.USAGE,
            "error: --gpu-memory '0' must be a size above zero, such as 2GB",
        )


def test_gpumesh_control_answers_h_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    with own_logging():  # its console handler, on this test's stderr
        assert control.main(["-V"]) == 0
        assert capsys.readouterr().out.startswith("gpumesh-control, version ")
        assert control.main(["-h"]) == 0
        assert "Serve this node's control API" in capsys.readouterr().out
        assert control.main(["--bogus"]) == ExitCode.USAGE
        assert capsys.readouterr().err == "error: No such option '--bogus'.\n"
