"""A warm session whose provider was killed and started again: bob's node process
still holds the old connection (nothing closed it), and alice's new process drops
its packets without a word. The next command must not be lent that session: one
silent for ``PROBE_AFTER`` seconds is pinged first, and dialled again when the
ping goes unanswered. Real `gpumesh share` processes, bob's real node process,
Docker running the offline busybox image."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from gpumesh.client.pool import PROBE_AFTER
from tests.integration.conftest import shared_pair
from tests.integration.node import CEILING, alive, cli, status, wait_shares
from tests.integration.test_cli import _start_share

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")


def test_a_command_after_the_provider_was_killed_and_restarted_dials_again(
    tmp_path: Path,
) -> None:
    with shared_pair(tmp_path) as (alice, bob):
        try:
            first = cli(bob, "run", "--peer", "alice-pc", "--", "echo", "one")
            assert (first.returncode, first.stdout) == (0, "one\n"), first.stderr
            done = time.monotonic()
            (warm,) = status(bob)["node"]["warm_sessions"]
            old_uses = warm["uses"]
            pid = wait_shares(alice)["agent"]["pid"]
            os.kill(pid, signal.SIGKILL)  # no close reaches bob
            deadline = time.monotonic() + CEILING
            while alive(pid):
                assert time.monotonic() < deadline, "the killed agent stayed"
                time.sleep(0.05)
            share = _start_share(alice)  # on the same port: it gets bob's packets
            try:
                # Past the point where a warm session is checked before it is lent
                # (waiting longer only lets the keep-alive find it dead instead).
                time.sleep(max(0.0, PROBE_AFTER + 0.5 - (time.monotonic() - done)))
                second = cli(bob, "run", "--peer", "alice-pc", "--", "echo", "two")
                assert (second.returncode, second.stdout) == (0, "two\n"), second.stderr
                (warm,) = status(bob)["node"]["warm_sessions"]
                assert warm["uses"] <= old_uses  # a new session carried it
            finally:
                share.send_signal(signal.SIGINT)
                share.wait(timeout=15)
                for pipe in (share.stdout, share.stderr):
                    if pipe is not None:
                        pipe.close()
        finally:
            cli(bob, "daemon", "stop")
