"""The thin CLI through real node processes: `run`, `logs -f`, `jobs` and `cancel`
of bob (a consumer) ask his home's node process, which talks to alice (a real
`gpumesh share` process) and dockerd. Nothing is mocked."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration.conftest import until
from tests.integration.node import CEILING, cli, node_env, status, wait_gone

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

HEAVY = ("qh3", "cryptography", "docker", "sqlite3")
LISTING = (*HEAVY, "rich", "asyncio", "logging", "shutil")
"""Not imported by `gpumesh jobs --json` through the node process either (msgspec
is: it reads the answer into its view structs, loaded once the request is out)."""
RUNNING = (*LISTING, "base64")
"""Not imported by `jobs` (its table piped), `logs -f` and `run` either: what a
command started for one job pays for at start-up, besides click and the decoder."""


def test_run_streams_output_apart_and_exits_with_the_jobs_code(pair: tuple[Path, Path]) -> None:
    _alice, bob = pair
    result = cli(
        bob, "run", "--peer", "alice-pc", "--", "sh", "-c", "echo out; echo err >&2; exit 3"
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout == "out\n"
    assert "err" in result.stderr
    node = status(bob)["node"]
    assert node["detached"]  # it went through the node process the command started
    listed = json.loads(cli(bob, "jobs", "--json").stdout)
    assert [j["state"] for j in listed] == ["failed"] and listed[0]["exit_code"] == 3
    # The node's JSON, printed as it comes, is byte for byte what the command
    # prints in-process from its view structs.
    thin = cli(bob, "jobs", "--offline", "--json")
    in_process = subprocess.run(
        [sys.executable, "-m", "gpumesh", "jobs", "--offline", "--json"],
        env={**node_env(bob), "GPUMESH_NODE": "off"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert thin.returncode == in_process.returncode == 0, thin.stderr + in_process.stderr
    assert thin.stdout == in_process.stdout and '"exit_code": 3' in thin.stdout
    table = cli(bob, "jobs", "--offline")
    assert table.returncode == 0, table.stderr
    assert "→ alice-pc" in table.stdout and "failed" in table.stdout


def test_detach_logs_and_cancel_through_the_node_process(pair: tuple[Path, Path]) -> None:
    _alice, bob = pair
    started = cli(bob, "run", "--peer", "alice-pc", "-d", "--", "sh", "-c", "echo begun; sleep 120")
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()
    # Cancelled once it ran (a cancel that overtakes its container's start would
    # leave no output to check).
    until(lambda: "begun" in cli(bob, "logs", job_id).stdout, "the job to say begun", every=0.2)
    cancelled = cli(bob, "cancel", job_id[:6])
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.startswith(f"Job {job_id} on alice-pc: cancelled")
    logs = cli(bob, "logs", job_id)
    assert logs.returncode == 130, logs.stderr
    assert logs.stdout == "begun\n"
    assert "--- cancelled" in logs.stderr
    unknown = cli(bob, "cancel", "ffffffff")
    assert unknown.returncode == 2
    assert (
        unknown.stderr.startswith("error: no job 'ffffffff'") and "\n" not in unknown.stderr.strip()
    )


def test_a_follow_survives_the_node_process_being_killed(pair: tuple[Path, Path]) -> None:
    """The node process dies mid-follow: the follow starts another and resumes after
    the last line it printed, so every line comes exactly once."""
    _alice, bob = pair
    script = "for i in $(seq 1 30); do echo line-$i; sleep 0.3; done"
    started = cli(bob, "run", "--peer", "alice-pc", "-d", "--", "sh", "-c", script)
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()
    follow = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "logs", "-f", job_id],
        env=node_env(bob),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert follow.stdout is not None
    lines = [follow.stdout.readline() for _ in range(3)]
    first = status(bob)["node"]["pid"]
    os.kill(first, signal.SIGKILL)
    assert wait_gone(first)
    rest, err = follow.communicate(timeout=120)
    assert follow.returncode == 0, err
    printed = "".join(lines) + rest
    assert printed == "".join(f"line-{i}\n" for i in range(1, 31))
    assert status(bob)["node"]["pid"] != first  # a new node process carried the rest


def test_the_thin_commands_import_no_quic_crypto_docker_or_sqlite(pair: tuple[Path, Path]) -> None:
    _alice, bob = pair
    job = cli(bob, "run", "--peer", "alice-pc", "-d", "--", "echo", "hi")
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip()
    check = textwrap.dedent(
        f"""
        import sys
        from gpumesh.cli.main import main
        codes = [int(main(["jobs", "--json"]))]
        listing = sorted(m for m in sys.modules if m.split(".")[0] in {LISTING!r})
        print("LISTING", listing, file=sys.stderr)
        for argv in (["jobs"], ["logs", "-f", "{job_id}"],
                     ["run", "--peer", "alice-pc", "--", "echo", "again"]):
            codes.append(int(main(argv)))
        running = sorted(m for m in sys.modules if m.split(".")[0] in {RUNNING!r})
        print("RUNNING", running, file=sys.stderr)
        codes.append(int(main(["cancel", "{job_id}"])))
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print("RESULT", codes, heavy, file=sys.stderr)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", check],
        env=node_env(bob),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RESULT"), result.stderr
    codes, heavy = last.removeprefix("RESULT ").split("] ", 1)
    assert codes == "[0, 0, 0, 0, 0", result.stderr
    assert heavy == "[]", f"imported on the thin path: {heavy}"
    assert "LISTING []\n" in result.stderr, result.stderr
    assert "RUNNING []\n" in result.stderr, result.stderr
    assert "hi\n" in result.stdout and "again\n" in result.stdout


def test_sessions_stay_warm_across_commands_and_a_deny_closes_them_at_once(
    pair: tuple[Path, Path],
) -> None:
    alice, bob = pair
    assert cli(bob, "run", "--peer", "alice-pc", "--", "echo", "one").stdout == "one\n"
    warm = status(bob)["node"]["warm_sessions"]
    assert [w["peer"] for w in warm] == ["alice-pc"]
    uses = warm[0]["uses"]
    # The provider still sees bob connected, though no command of his runs.
    assert _connected(alice) == ["bob-laptop"]
    assert cli(bob, "run", "--peer", "alice-pc", "--", "echo", "two").stdout == "two\n"
    again = status(bob)["node"]["warm_sessions"]
    assert len(again) == 1 and again[0]["uses"] > uses  # the same session carried it
    assert _connected(alice) == ["bob-laptop"]  # and no second link was opened

    denied = cli(bob, "deny", "alice-pc")  # in its own process: the store says it
    assert denied.returncode == 0, denied.stderr
    deadline = time.monotonic() + CEILING
    while status(bob)["node"]["warm_sessions"] or _connected(alice):
        assert time.monotonic() < deadline, "the denied peer's warm session stayed open"
        time.sleep(0.05)


def _connected(home: Path) -> list[str]:
    from tests.integration.conftest import gpumesh

    data = json.loads(gpumesh(home, "status", "--json", "--offline").stdout)
    return sorted(c["peer"] for c in data["connections"])


def test_a_sharing_node_process_sees_a_deny_made_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """alice's `gpumesh share` is her home's node process too: the agent and the
    control API share one database connection, so a deny made by another process
    reaches the agent's next check (two connections in one process lost it)."""
    from tests.integration.conftest import shared_pair

    with shared_pair(tmp_path) as (alice, bob):
        assert status(alice)["node"]["sharing"] is True
        ran = cli(bob, "run", "--peer", "alice-pc", "--", "echo", "hi")
        assert ran.returncode == 0 and ran.stdout == "hi\n", ran.stderr
        hosted = json.loads(cli(alice, "jobs", "--json", "--offline").stdout)
        assert [j["state"] for j in hosted] == ["succeeded"]
        assert cli(alice, "deny", "bob-laptop").returncode == 0
        refused = cli(bob, "run", "--peer", "alice-pc", "--", "true")
        assert refused.returncode == 3, (refused.stdout, refused.stderr)
        # A fresh dial is refused ("denied you"); a warm session that the deny
        # closes while the request is on it ends with the close reason ("revoked").
        assert re.fullmatch(
            r"error: alice-pc has (denied you|revoked your) access", refused.stderr.strip()
        ), refused.stderr


def test_run_on_a_group_through_the_node_process_says_where_and_why(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """The run is streamed by the node process: the placement notes come before the
    job's output, as in-process."""
    from tests.integration.test_cli import _free_udp_port, _init

    _alice, bob = pair
    carol = tmp_path / "c"  # paired with bob but not sharing: unreachable
    _init(carol, "carol", _free_udp_port())
    code = cli(carol, "pair-code").stdout.strip()
    assert cli(bob, "pair", code).returncode == 0
    assert cli(bob, "group", "create", "research").returncode == 0
    for member in ("alice-pc", "carol"):
        assert cli(bob, "group", "add", "research", member).returncode == 0
    result = cli(bob, "run", "--group", "research", "--explain", "--", "echo", "placed")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "placed\n"
    assert "gpumesh: placing on alice-pc: CPU only" in result.stderr
    assert "gpumesh:   carol: skipped: unreachable" in result.stderr
    assert status(bob)["node"]["pid"]  # it went through the node process
    refused = cli(bob, "run", "--group", "research", "--gpu-memory", "8GB", "--", "true")
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: ") and "with 8GB of GPU memory" in refused.stderr
