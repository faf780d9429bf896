"""A warm session that died while it waited for the next command, under the
commands that are more than one request: a ``logs -f`` follow, a copy (a file or
a folder, either way) and an app sync. The provider went and came back on the
same port within the seconds a warm session is lent without a ping (made long
here, so the lend never pings): its new agent drops the old connection's packets
without a word. Each command must find that out before it starts, dial again
and do its work once: no copy counted as retried, no line of a follow lost,
repeated or preceded by a reconnect, no sync sending what it sent before.

Real agents in-process over real QUIC, a real pool of warm sessions, Docker
running the offline busybox image for the follow."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpumesh.agent.server import Agent
from gpumesh.client import jobs, pool
from gpumesh.client.apps import sync_app
from gpumesh.client.files import CopyCallbacks, copy
from gpumesh.client.jobs import logs, run_job
from gpumesh.client.node import Node
from gpumesh.client.pool import SessionPool, Warm
from tests.integration.conftest import arun, job_nodes, pair_both
from tests.integration.test_jobs import providing, spec
from tests.integration.test_warm_retry import _vanish

pytestmark = pytest.mark.usefixtures("docker_daemon")

T = TypeVar("T")

CEILING = 120.0
"""Seconds any one command may take here (generous: a loaded 2-core machine). A
command that waits for a dead session to be noticed by other means takes the
whole of it."""


@pytest.fixture
def cluster(make_node: Callable[[str], Node], engine: Any) -> Iterator[Callable[[str], Node]]:
    with job_nodes(make_node, "256MB") as factory:
        yield factory


class Restarts:
    """alice's agent, stopped as a killed process would be and started again on its
    port whenever :meth:`restart` is called; bob keeps warm sessions to her."""

    def __init__(self, alice: Node, bob: Node, stack: contextlib.AsyncExitStack) -> None:
        self.alice, self.bob, self.stack = alice, bob, stack
        self.agent: Agent | None = None
        self.port = 0

    async def start(self) -> None:
        self.agent = await self.stack.enter_async_context(providing(self.alice, port=self.port))
        assert self.agent.endpoint is not None
        self.port = self.agent.endpoint.local_address[1]

    async def restart(self) -> Warm:
        """Restart alice; the warm session bob holds (now dead)."""
        assert self.agent is not None
        (old,) = self.bob.pool.sessions() if self.bob.pool is not None else []
        _vanish(self.agent)
        await self.start()
        return old

    def dialled_again(self, old: Warm) -> None:
        assert self.bob.pool is not None
        (new,) = self.bob.pool.sessions()
        assert new.session is not old.session and old.session.link.is_closed


@contextlib.asynccontextmanager
async def _restarts(alice: Node, bob: Node) -> AsyncIterator[Restarts]:
    bob.pool = SessionPool()
    try:
        async with contextlib.AsyncExitStack() as stack:
            restarts = Restarts(alice, bob, stack)
            await restarts.start()
            pair_both(alice, bob)  # alice's code names the port she listens on
            yield restarts
    finally:
        bob.pool.close()


async def _within(step: Awaitable[T]) -> T:
    async with asyncio.timeout(CEILING):
        return await step


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_copies_lent_a_dead_warm_session_dial_again_and_copy_once(
    cluster: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(pool, "PROBE_AFTER", 3600.0)
    alice, bob = cluster("alice"), cluster("bob")
    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    folder = tmp_path / "tree"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("a\n")
    (folder / "sub" / "b.sh").write_text("echo b\n")
    (folder / "sub" / "b.sh").chmod(0o750)
    back = tmp_path / "back"
    back.mkdir()
    retried: list[tuple[str, int]] = []
    callbacks = CopyCallbacks(retrying=lambda error, attempt: retried.append((str(error), attempt)))

    async def scenario() -> None:
        async with _restarts(alice, bob) as provider:
            await _within(copy(bob, str(source), "alice:/warm.bin"))  # a warm session
            for source_text, dest in [
                (str(source), "alice:/one.bin"),  # a file up
                (str(folder), "alice:/"),  # a folder up
                ("alice:/one.bin", str(back / "one.bin")),  # a file down
                ("alice:/tree", str(back)),  # a folder down
            ]:
                old = await provider.restart()
                result = await _within(copy(bob, source_text, dest, callbacks=callbacks))
                assert (result.attempts, retried) == (1, []), (source_text, dest)
                provider.dialled_again(old)

    arun(scenario())
    sandbox = alice.home.path / "files" / str(bob.info().node_id)
    assert _digest(sandbox / "one.bin") == _digest(source) == _digest(back / "one.bin")
    for name in ("a.txt", "sub/b.sh"):
        assert (back / "tree" / name).read_bytes() == (folder / name).read_bytes()
    assert (back / "tree" / "sub" / "b.sh").stat().st_mode & 0o777 == 0o750


def test_a_follow_lent_a_dead_warm_session_dials_again_and_loses_or_repeats_nothing(
    cluster: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool, "PROBE_AFTER", 3600.0)
    alice, bob = cluster("alice"), cluster("bob")
    lines = "".join(f"line {n}\n" for n in range(1, 21)).encode()

    async def follow(job_id: str, after: int) -> list[tuple[int, bytes]]:
        """The job's output events read after ``after``: (sequence number, bytes)."""
        followed = logs(bob, job_id, follow=True, after_seq=after)
        got: list[tuple[int, bytes]] = []
        async for event in followed:
            assert not isinstance(event, jobs.Reconnecting), event.error
            if isinstance(event, jobs.Output):
                got.append((followed.seq, event.data))
        assert followed.result.exit_code == 0
        return got

    async def scenario() -> None:
        async with _restarts(alice, bob) as provider:
            # Output in several events (a pause between lines), to resume in between.
            script = "for n in $(seq 1 20); do echo line $n; sleep 0.05; done"
            done = await _within(run_job(bob, spec("alice", "sh", "-c", script)))
            assert done.exit_code == 0
            old = await provider.restart()
            whole = await _within(follow(done.job_id, 0))
            assert b"".join(data for _, data in whole) == lines
            provider.dialled_again(old)
            assert len(whole) > 1
            old = await provider.restart()
            rest = await _within(follow(done.job_id, whole[0][0]))
            assert rest == whole[1:]  # after the first: the others, once
            provider.dialled_again(old)

    arun(scenario())


def test_an_app_sync_lent_a_dead_warm_session_dials_again_and_sends_only_the_change(
    cluster: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(pool, "PROBE_AFTER", 3600.0)
    alice, bob = cluster("alice"), cluster("bob")
    app = tmp_path / "app"
    app.mkdir()
    for n in range(5):
        (app / f"f{n}.py").write_text(f"print({n})\n")

    async def scenario() -> None:
        async with _restarts(alice, bob) as provider:
            first = await _within(sync_app(bob, "alice", app))
            assert sorted(first.sent) == [f"f{n}.py" for n in range(5)]
            (app / "f2.py").write_text("print('two')\n")
            old = await provider.restart()
            second = await _within(sync_app(bob, "alice", app))
            assert second.sent == ["f2.py"]
            assert second.unchanged == 4
            provider.dialled_again(old)

    arun(scenario())
    synced = alice.home.path / "files" / str(bob.info().node_id) / "apps" / "app"
    assert (synced / "f2.py").read_text() == "print('two')\n"


def test_a_connect_lent_a_dead_warm_session_dials_again_and_says_so(
    cluster: Callable[[str], Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool, "PROBE_AFTER", 3600.0)
    alice, bob = cluster("alice"), cluster("bob")

    async def scenario() -> None:
        async with _restarts(alice, bob) as provider:
            assert (await _within(bob.connect("alice", pings=1))).warm is False
            assert (await _within(bob.connect("alice", pings=1))).warm is True
            old = await provider.restart()
            again = await _within(bob.connect("alice", pings=1))
            assert again.warm is False  # measured on a session dialled now
            assert again.remote.name == "alice"
            provider.dialled_again(old)

    arun(scenario())
