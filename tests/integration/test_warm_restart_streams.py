"""The provider killed and started again between two commands, for the commands
through the node process that are more than one request: `logs -f`, `cp` (a file
up, a folder down) and `app sync`. bob's node process still holds the old session
(nothing closed it) and alice's new process drops its packets without a word.
Each command must succeed with its work done once: no copy retried, no line of
the follow lost or repeated, no file of the sync sent again. Real `gpumesh share`
processes, bob's real node process, Docker running the offline busybox image.

Whether the next command comes within the seconds a warm session is lent without
a ping depends on how fast alice restarts on this machine; the in-process tests
of ``test_warm_retry_streams.py`` pin that case down."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import shared_pair
from tests.integration.node import CEILING, cli, wait_gone, wait_shares
from tests.integration.test_cli import _start_share

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")


class Alice:
    """alice's `gpumesh share`, killed and started again on demand."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.share: subprocess.Popen[str] | None = None

    def restart(self) -> None:
        pid = wait_shares(self.home)["agent"]["pid"]
        os.kill(pid, signal.SIGKILL)  # no close reaches bob
        assert wait_gone(pid), "the killed agent stayed"
        self.stop()
        self.share = _start_share(self.home)  # on the same port: it gets bob's packets

    def stop(self) -> None:
        if self.share is None:
            return
        if self.share.poll() is None:
            self.share.send_signal(signal.SIGINT)
            self.share.wait(timeout=15)
        for pipe in (self.share.stdout, self.share.stderr):
            if pipe is not None:
                pipe.close()
        self.share = None


@pytest.fixture
def homes(tmp_path: Path) -> Iterator[tuple[Alice, Path]]:
    with shared_pair(tmp_path) as (alice, bob):
        restarts = Alice(alice)
        try:
            yield restarts, bob
        finally:
            cli(bob, "daemon", "stop")
            restarts.stop()


def _ok(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = cli(home, *args, timeout=CEILING * 2)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    assert "retrying" not in result.stderr and "reconnect" not in result.stderr.lower(), (
        args,
        result.stderr,
    )
    return result


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_logs_cp_and_app_sync_after_the_provider_restarted_do_their_work_once(
    homes: tuple[Alice, Path], tmp_path: Path
) -> None:
    alice, bob = homes
    lines = "".join(f"line {n}\n" for n in range(1, 21))
    script = "for n in $(seq 1 20); do echo line $n; sleep 0.05; done"
    run = _ok(bob, "run", "--peer", "alice-pc", "--", "sh", "-c", script)
    assert run.stdout == lines
    (job,) = json.loads(_ok(bob, "jobs", "--json").stdout)

    alice.restart()
    follow = _ok(bob, "logs", "-f", job["job_id"])
    assert follow.stdout == lines  # every line, once

    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(2 * 1024 * 1024 + 5))
    alice.restart()
    up = json.loads(_ok(bob, "cp", "--json", str(source), "alice-pc:/data.bin").stdout)
    assert (up["attempts"], up["resumed_from"]) == (1, 0)
    bob_id = json.loads(cli(bob, "status", "--json").stdout)["node_id"]
    sandbox = alice.home / "files" / bob_id
    assert _digest(sandbox / "data.bin") == _digest(source)

    (sandbox / "tree" / "sub").mkdir(parents=True)
    (sandbox / "tree" / "a.txt").write_text("a\n")
    (sandbox / "tree" / "sub" / "b.txt").write_text("b\n")
    back = tmp_path / "back"
    back.mkdir()
    alice.restart()
    down = json.loads(_ok(bob, "cp", "--json", "alice-pc:/tree", str(back)).stdout)
    assert down["attempts"] == 1
    assert (back / "tree" / "a.txt").read_text() == "a\n"
    assert (back / "tree" / "sub" / "b.txt").read_text() == "b\n"

    app = tmp_path / "app"
    app.mkdir()
    for n in range(4):
        (app / f"f{n}.py").write_text(f"print({n})\n")
    first = json.loads(
        _ok(bob, "app", "sync", "--peer", "alice-pc", "--dir", str(app), "--json").stdout
    )
    assert first["files_sent"] == 4
    (app / "f1.py").write_text("print('one')\n")
    alice.restart()
    again = json.loads(
        _ok(bob, "app", "sync", "--peer", "alice-pc", "--dir", str(app), "--json").stdout
    )
    assert (again["sent"], again["files_unchanged"]) == (["f1.py"], 3)
    assert (sandbox / "apps" / "app" / "f1.py").read_text() == "print('one')\n"
