"""``gpumesh connect`` through the home's node process: it measures the path on
the warm session when there is one (and says so), dials and keeps one warm when
there is none, and the next ``run`` is lent that session without a dial. Its
refusals read as the in-process command's, with the same exit codes. Real
`gpumesh share`, bob's real node process, Docker running the offline busybox
image."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from gpumesh.errors import ExitCode
from tests.integration.conftest import shared_pair
from tests.integration.node import CEILING, cli, status
from tests.integration.test_cli import _one_line_error

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")


def _same(one: subprocess.CompletedProcess[str], other: subprocess.CompletedProcess[str]) -> None:
    """The same exit code and message (the warm session and a fresh dial)."""
    assert (one.returncode, one.stderr) == (other.returncode, other.stderr)


def _uses(home: Path) -> int:
    (warm,) = status(home)["node"]["warm_sessions"]
    assert warm["peer"] == "alice-pc"
    uses: int = warm["uses"]
    return uses


def test_connect_through_the_node_dials_once_then_measures_on_the_warm_session(
    tmp_path: Path,
) -> None:
    with shared_pair(tmp_path) as (_alice, bob):
        try:
            first = cli(bob, "connect", "alice-pc", "--json")
            assert first.returncode == 0, first.stderr
            dialled = json.loads(first.stdout)
            assert (dialled["reachable"], dialled["path"], dialled["warm"]) == (
                True,
                "direct",
                False,
            )
            assert dialled["connect_ms"] > 0 and dialled["rtt_ms"] > 0
            assert _uses(bob) == 1  # kept warm after it

            again = cli(bob, "connect", "alice-pc", "--json")
            assert again.returncode == 0, again.stderr
            reused = json.loads(again.stdout)
            assert reused["warm"] is True
            assert reused["peer"] == "alice-pc" and reused["sharing"] is True
            assert reused["connect_ms"] > 0  # that session's own dial
            # --fresh: the node process dials anew and times it, and keeps the warm
            # session as it was (neither lent nor replaced: still one, same uses).
            anew = cli(bob, "connect", "alice-pc", "--json", "--fresh")
            assert anew.returncode == 0, anew.stderr
            dialled_anew = json.loads(anew.stdout)
            assert list(dialled_anew) == list(reused)
            assert dialled_anew["warm"] is False and dialled_anew["connect_ms"] > 0
            assert _uses(bob) == 2

            human = cli(bob, "connect", "alice-pc")
            assert human.returncode == 0, human.stderr
            line = human.stdout.strip()
            assert re.fullmatch(
                r"alice-pc is reachable: path direct via 127\.0\.0\.1:\d+, rtt [0-9.]+ ms "
                r"\(warm session: no dial now, its dial took \d+ ms\)",
                line,
            ), line

            speed = cli(bob, "connect", "alice-pc", "--speed", "1MB", "--timeout", "20")
            assert speed.returncode == 0, speed.stderr
            assert "(warm session" in speed.stdout
            assert re.search(r"^upload [0-9.]+[KMG]?B/s \(1MB\)$", speed.stdout, re.M), speed.stdout
            uses = _uses(bob)
            assert uses == 5  # connect, connect, connect, and --speed's two

            run = cli(bob, "run", "--peer", "alice-pc", "--", "echo", "hi")
            assert (run.returncode, run.stdout) == (0, "hi\n"), run.stderr
            # Lent the session connect left (a new one would count only the run's).
            assert _uses(bob) > uses
        finally:
            cli(bob, "daemon", "stop")


def test_connect_refusals_read_the_same_on_a_fresh_dial(tmp_path: Path) -> None:
    with shared_pair(tmp_path) as (alice, bob):
        try:
            unknown = cli(bob, "connect", "nobody")
            _one_line_error(unknown, 2, "no paired peer named 'nobody'")
            _same(unknown, cli(bob, "connect", "nobody", "--fresh"))

            assert cli(bob, "connect", "alice-pc").returncode == 0  # a warm session now
            assert cli(alice, "deny", "bob-laptop").returncode == 0
            # alice closes the session at once; bob's node process drops it when the
            # close arrives (a connect that crossed it is told the access was revoked).
            deadline = time.monotonic() + CEILING
            while status(bob)["node"]["warm_sessions"]:
                assert time.monotonic() < deadline, "the denied session stayed warm"
                time.sleep(0.1)
            denied = cli(bob, "connect", "alice-pc")
            _one_line_error(denied, 3, "alice-pc has denied you access")
            _same(denied, cli(bob, "connect", "alice-pc", "--fresh"))

            assert cli(alice, "allow", "bob-laptop").returncode == 0
            assert cli(alice, "share", "stop").returncode == 0
            gone = cli(bob, "connect", "alice-pc", "--timeout", "3")
            _one_line_error(gone, ExitCode.UNREACHABLE, "nothing is listening")
            _same(gone, cli(bob, "connect", "alice-pc", "--timeout", "3", "--fresh"))

            bad = cli(bob, "connect", "alice-pc", "--timeout", "0")
            assert bad.returncode == 2 and "--timeout" in bad.stderr
        finally:
            cli(bob, "daemon", "stop")
