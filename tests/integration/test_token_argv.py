"""The curl lines the project documents never put the API token on a command line,
which every local user reads in ``/proc``: the TCP example of
``gpumesh-control --help``, run as written in bash against a real server, is
answered while the ``curl`` it runs (a stand-in that records its argv and then
runs the real one) holds no token; every curl line of ``--help``, the README and
the docs goes through the unix socket or reads its headers from a file (-H @)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import _in_ci
from tests.integration.conftest import gpumesh
from tests.integration.test_control_api import CONTROL, start_control

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

ROOT = Path(__file__).resolve().parents[2]
RECORDER = """#!/bin/sh
printf '%s\\n' "$@" >> {record}
exec {curl} "$@"
"""


def _help() -> str:
    return subprocess.run(
        [CONTROL, "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def _curl_lines(text: str) -> list[str]:
    """Each curl command of ``text``, its continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if re.match(r"\s*curl\s", line)]


def test_the_documented_tcp_curl_line_puts_no_token_on_a_command_line(tmp_path: Path) -> None:
    curl = shutil.which("curl")
    bash = shutil.which("bash")
    if curl is None or bash is None:
        if _in_ci():
            raise AssertionError("CI runs the documented curl line: it needs curl and bash")
        pytest.skip("needs curl and bash")
    (tcp,) = [line for line in _curl_lines(_help()) if "127.0.0.1:8080" in line]
    home = tmp_path / "h"
    assert gpumesh(home, "init", "--name", "curl-node").returncode == 0
    api = start_control(home)
    try:
        stand_in = tmp_path / "bin"
        stand_in.mkdir()
        record = tmp_path / "curl-argv"
        (stand_in / "curl").write_text(RECORDER.format(record=record, curl=curl))
        (stand_in / "curl").chmod(0o755)
        line = tcp.replace("~/.gpumesh", str(home)).replace("127.0.0.1:8080", api.url[7:])
        run = subprocess.run(
            [bash, "-c", line],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={"PATH": f"{stand_in}:/usr/bin:/bin", "HOME": str(tmp_path)},
        )
        assert run.returncode == 0, run.stderr
        assert isinstance(json.loads(run.stdout), list), run.stdout  # the peers, answered
        argv = record.read_text()
        assert api.url in argv and api.token not in argv, argv
    finally:
        api.stop()


def test_every_documented_curl_line_keeps_the_token_off_the_command_line() -> None:
    sources = {
        "gpumesh-control --help": _help(),
        "README.md": (ROOT / "README.md").read_text(),
        **{str(doc.relative_to(ROOT)): doc.read_text() for doc in (ROOT / "docs").glob("*.md")},
    }
    seen = 0
    for where, text in sources.items():
        for line in _curl_lines(text):
            seen += 1
            assert "--unix-socket" in line or "-H @" in line, (where, line)
            # The header itself on curl's command line: the token with it.
            assert not re.search(r"(-H|--header)\s+[\"']?authorization", line, re.I), (where, line)
    assert seen >= 4
