"""The CLI's tables as a user sees them: on an 80-column terminal (a real pty) they
fit and cut only what may give way; piped, nothing is cut at all."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from gpumesh.store.config import KEYS, value_text
from gpumesh.units import format_duration
from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _init

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def on_terminal(home: Path, *args: str, cols: int = 80) -> list[str]:
    """Run the CLI with its stdout on a real pty ``cols`` wide; the lines it shows."""
    master, slave = os.openpty()
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
    env = dict(os.environ, GPUMESH_HOME=str(home), COLUMNS=str(cols), TERM="xterm")
    env.pop("GPUMESH_LOG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(slave)
    seen = bytearray()
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the CLI is gone and everything was read
                    break
                if not data:
                    break
                seen += data
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        os.close(master)
        if proc.stderr:
            proc.stderr.close()
    text = _ANSI.sub("", seen.decode()).replace("\r\n", "\n")
    return [line.rstrip() for line in text.splitlines()]


def piped(home: Path, *args: str, cols: int = 80) -> list[str]:
    """Run the CLI with its stdout on a pipe (and COLUMNS set, which must not matter)."""
    env = dict(os.environ, GPUMESH_HOME=str(home), COLUMNS=str(cols))
    env.pop("GPUMESH_LOG", None)
    result = subprocess.run(
        [sys.executable, "-m", "gpumesh", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout
    return result.stdout.splitlines()


@pytest.mark.usefixtures("docker_daemon")
def test_jobs_never_cut_times_and_are_whole_when_piped(pair) -> None:
    alice, bob = pair
    words = "a-command-long-enough-that-eighty-columns-cannot-hold-it-whole"
    script = f"echo {words}\ntrue"  # a newline in a cell must not break its row
    ran = gpumesh(bob, "run", "--peer", "alice-pc", "--image", IMAGE, "sh", "-c", script)
    assert ran.returncode == 0, ran.stderr
    headers = ["ID", "PEER", "STATE", "EXIT", "ATTEMPT", "GPU", "COMMAND", "CREATED", "TIME"]
    for home in (bob, alice):  # the consumer's and the provider's own tables
        [job] = json.loads(gpumesh(home, "jobs", "--json").stdout)
        took = format_duration(job["duration"])

        # At 80 columns the long command and the creation time go under the row,
        # whole, rather than the command cut to a few letters.
        lines = on_terminal(home, "jobs")
        header, row, *command, created = lines
        assert header.split() == [h for h in headers if h not in ("COMMAND", "CREATED")]
        assert all(len(line) <= 80 for line in lines), lines
        assert row.startswith(job["job_id"])
        assert row.endswith(f" {took}")  # a 148ms job never reads `148m`
        assert " succeeded " in row and "…" not in row
        assert all(line.startswith("    ") for line in command)  # wrapped, never cut
        assert " ".join(line.strip() for line in command) == f"sh -c echo {words}\\ntrue"
        assert created.startswith("    created: ") and created.endswith(" ago"), created

        header, row = piped(home, "jobs")
        assert header.split() == headers
        assert f"  sh -c echo {words}\\ntrue  " in row and "…" not in row
        assert row.endswith(f" {took}")


def test_config_show_fits_80_columns_and_keeps_every_value(tmp_path: Path) -> None:
    home = tmp_path / "bob"
    _init(home, "bob-laptop")
    values = json.loads(gpumesh(home, "config", "show", "--json").stdout)
    assert len(str(values["image"])) > 30  # the long default must show whole

    lines = on_terminal(home, "config", "show")
    assert lines[0].split() == ["KEY", "VALUE", "FROM"]  # the meaning moves under its key
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    for name, value in values.items():
        [row] = [line for line in lines if line.startswith(f"{name} ")]
        assert f" {value_text(value)} " in f"{row} ", row
    shown = " ".join(" ".join(lines).split())
    for key in KEYS.values():  # every meaning whole, on lines of its own
        assert key.help in shown, key.name

    lines = piped(home, "config", "show")
    assert lines[0].split() == ["KEY", "VALUE", "FROM", "MEANING"]
    assert len(lines) == 1 + len(KEYS)  # one line per key: nothing wrapped
    for line, key in zip(lines[1:], KEYS.values(), strict=True):
        assert line.startswith(f"{key.name} ") and line.endswith(f"  {key.help}"), line


def test_peers_give_way_in_their_addresses_only(pair) -> None:
    _alice, bob = pair
    [peer] = json.loads(gpumesh(bob, "peers", "--json").stdout)
    headers = ["NAME", "ID", "ACCESS", "LAST", "SEEN", "PATH", "ADDRESSES"]
    whole = piped(bob, "peers", cols=40)
    assert whole[0].split() == headers
    assert all(address in whole[1] for address in peer["addresses"]), whole
    assert "…" not in whole[1]

    # Narrow enough that the addresses must give way, wide enough for the rest.
    cols = len(whole[1]) - 2
    header, row = on_terminal(bob, "peers", cols=cols)
    assert header.split() == headers
    assert len(row) <= cols and row.endswith("…")
    assert row.split()[:3] == ["alice-pc", peer["node_id"][:12], "allowed"]
    # The two listings ran a moment apart: "2s ago" may have become "3s ago" (and
    # its column a character wider), so compare them word by word without it.
    cut, full = _words(row[: -len("…")]), _words(whole[1])
    assert cut[:-1] == full[: len(cut) - 1]
    assert full[len(cut) - 1].startswith(cut[-1])  # the address that gave way


def _words(line: str) -> list[str]:
    return re.sub(r"\d+[smhd] ago|just now|never", "WHEN", line).split()


def test_group_tables_cut_only_names_and_addresses(tmp_path: Path) -> None:
    home = tmp_path / "bob"
    _init(home, "bob-laptop")
    assert gpumesh(home, "group", "create", "research").returncode == 0
    [member] = json.loads(gpumesh(home, "group", "members", "research", "--json").stdout)

    header, row = piped(home, "group", "members", "research", cols=40)
    assert header.split() == ["NAME", "ID", "ACCESS", "ADDRESSES"]
    assert row.endswith(", ".join(member["addresses"])) and "…" not in row

    cols = len(row) - 2  # the addresses must give way, the rest fits
    header, row = on_terminal(home, "group", "members", "research", cols=cols)
    assert header.split() == ["NAME", "ID", "ACCESS", "ADDRESSES"]
    assert len(row) <= cols and row.endswith("…")
    assert row.split()[:4] == ["bob-laptop", member["node_id"][:12], "this", "node"]

    header, row = piped(home, "group", "list", cols=40)
    assert header.split() == ["NAME", "ID", "MEMBERS", "PAIRED", "SINCE"]
    assert row.startswith("research ") and row.endswith(" ago, created here")


def test_doctor_wraps_under_its_text_at_80_columns_and_not_when_piped(tmp_path: Path) -> None:
    """Doctor's long lines ran past the edge and wrapped at column 0."""
    home = tmp_path / "bob"
    _init(home, "bob-laptop")
    lines = on_terminal(home, "doctor", cols=80)
    assert lines and all(len(line) <= 80 for line in lines), "\n".join(lines)
    piped_lines = piped(home, "doctor")
    assert any(len(line) > 80 for line in piped_lines)  # some check says more than fits
    assert len(lines) > len(piped_lines)
    for line in lines:  # a check's mark, or text under the start of a check's text
        assert line[0] in "✓!✗" or (line.startswith(" " * 17) and line[17] != " "), line

    # Nothing lost or changed (a path longer than a line is cut into pieces; the
    # clock check's time moved on between the two runs).
    def text(shown: list[str]) -> str:
        return re.sub(r"\d\d:\d\d:\d\d", "T", "".join("".join(shown).split()))

    assert text(lines) == text(piped_lines)
