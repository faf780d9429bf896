"""``AppPrepare``: the provider walks its copy of an app while the consumer scans its
own. Real agents in-process over real QUIC; no Docker (no job runs)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpumesh.agent import apps as agent_apps
from gpumesh.agent.apps import AppService
from gpumesh.agent.deps import RequestContext
from gpumesh.agent.sandboxfs import Usage
from gpumesh.client.apps import sync_app
from gpumesh.client.node import Node
from gpumesh.errors import ProtocolError
from gpumesh.files.sandbox import Tree, WalkStopped
from gpumesh.protocol.messages import AppPrepare
from gpumesh.store.peers import Peer
from tests.integration.conftest import arun, pair_both, sharing


def _project(root: Path) -> Path:
    project = root / "proj"
    for index in range(40):
        folder = project / f"d{index // 10}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{index}.txt").write_text(f"file {index}\n")
    return project


def _watch_takes(service: AppService) -> list[bool]:
    """Whether each sync took a walk its AppPrepare began."""
    taken: list[bool] = []
    take = service._take_prepared

    def recording(key: tuple[str, str], dry_run: bool) -> agent_apps._Walk | None:
        walk = take(key, dry_run)
        taken.append(walk is not None)
        return walk

    service._take_prepared = recording  # type: ignore[method-assign]
    return taken


async def _idle(service: AppService) -> None:
    """Until no sync holds an app's lock (the provider writes its index after its
    reply, under the lock; a prepare meanwhile leaves the walk to the sync)."""
    for _ in range(600):  # a generous ceiling
        if not any(lock.locked() for lock in service._locks.values()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("a sync kept its app's lock")


def test_a_resync_takes_the_walk_its_prepare_began_and_sees_what_jobs_wrote(
    make_node: Callable[[str], Node], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    project = _project(tmp_path)
    checks: list[int] = []
    check = agent_apps._current_index

    def counting(*args: Any) -> agent_apps.Index:
        checks.append(1)
        return check(*args)

    monkeypatch.setattr(agent_apps, "_current_index", counting)

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            taken = _watch_takes(agent.apps)
            peer = bob.peer("alice").node_id
            async with bob.session(peer) as session:
                first = await sync_app(bob, "alice", project, reuse=session)
                assert len(first.sent) == 40
                app = alice.home.path / "files" / str(bob.info().node_id) / "apps" / "proj"
                # A job rewrote a file there before this sync began: the walk
                # the prepare began sees it, and the file is sent again.
                await _idle(agent.apps)
                (app / "d1" / "f12.txt").write_text("a job wrote this\n")
                (project / "d3" / "f31.txt").write_text("changed here\n")
                second = await sync_app(bob, "alice", project, reuse=session)
                assert sorted(second.sent) == ["d1/f12.txt", "d3/f31.txt"]
                assert (app / "d1" / "f12.txt").read_text() == "file 12\n"
                assert (app / "d3" / "f31.txt").read_text() == "changed here\n"
                await _idle(agent.apps)
                dry = await sync_app(bob, "alice", project, dry_run=True, reuse=session)
                assert dry.sent == [] and dry.unchanged == 40
            # Each sync took the walk its prepare began (the first one found no
            # folder there yet, and the sync made it and walked it itself).
            assert taken == [True, True, True]
            # One index check a sync: a prepared walk's own served its sync.
            assert len(checks) == 3
            assert agent.apps._prepared == {}

    arun(scenario())


def test_a_provider_without_app_prepare_still_syncs_on_the_same_link(
    make_node: Callable[[str], Node], tmp_path: Path
) -> None:
    """A provider from before AppPrepare refuses that stream (as it does an
    unknown message): the sync goes on, and the link stays up."""
    alice, bob = make_node("alice"), make_node("bob")
    project = _project(tmp_path)

    async def scenario() -> None:
        async with sharing(alice) as older:
            pair_both(alice, bob)

            async def unknown(ctx: RequestContext, message: AppPrepare) -> None:
                raise ProtocolError("AppPrepare is not a request this node serves")

            older.handlers[AppPrepare] = unknown
            peer = bob.peer("alice").node_id
            async with bob.session(peer) as session:
                await sync_app(bob, "alice", project, reuse=session)
                for index in (5, 25):
                    (project / f"d{index // 10}" / f"f{index}.txt").write_text("again\n")
                    result = await sync_app(bob, "alice", project, reuse=session)
                    assert result.sent == [f"d{index // 10}/f{index}.txt"]
                    assert result.manifest == "delta"
                assert not session.link.is_closed

    arun(scenario())


def test_a_prepared_walk_no_sync_took_goes(
    make_node: Callable[[str], Node], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A walk waits for its sync only so long; then it goes, its folder closed, and
    a sync after it walks afresh."""
    alice, bob = make_node("alice"), make_node("bob")
    project = _project(tmp_path)
    monkeypatch.setattr(agent_apps, "PREPARED_FOR", 0.05)

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            begun: list[str] = []
            open_and_walk = agent.apps._open_and_walk

            async def counting(peer: Peer, name: str, walk: agent_apps._Walk) -> Usage | None:
                begun.append(name)
                return await open_and_walk(peer, name, walk)

            agent.apps._open_and_walk = counting  # type: ignore[method-assign]
            peer = bob.peer("alice").node_id
            async with bob.session(peer) as session:
                await sync_app(bob, "alice", project, reuse=session)
                assert begun == ["proj"]  # the first sync's prepare
                await _idle(agent.apps)
                stream = session.open_stream()
                stream.send_message(AppPrepare(name="proj"), end=True)
                session.link.forget_stream(stream.stream_id)
                for _ in range(400):  # generous ceilings: it goes after 0.05 s
                    if len(begun) == 2:
                        break
                    await asyncio.sleep(0.05)
                assert len(begun) == 2
                for _ in range(400):
                    if not agent.apps._prepared and not agent.apps._dropping:
                        break
                    await asyncio.sleep(0.05)
                assert agent.apps._prepared == {} and not agent.apps._dropping
                (project / "d0" / "f0.txt").write_text("later\n")
                later = await sync_app(bob, "alice", project, reuse=session)
                assert later.sent == ["d0/f0.txt"]

    arun(scenario())


def test_a_flood_of_prepares_keeps_its_walks_under_the_cap_and_the_sync_right(
    make_node: Callable[[str], Node], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer sending ``AppPrepare`` for one large app over and over: each one stops
    the walk it replaces, no more than :data:`PREPARED_WALKS` run at once (counted
    where the walks run, in their threads), and the sync after it is still right.

    The walks wait at their start until the whole flood was handled, so that every
    walk a prepare began is running when the next prepare comes."""
    alice, bob = make_node("alice"), make_node("bob")
    project = tmp_path / "big"
    for index in range(2000):
        folder = project / f"d{index // 100}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{index}.txt").write_text(f"file {index}\n")
    gate = threading.Event()
    running = peak = stopped = 0
    counting = threading.Lock()
    tally = Tree.tally

    def held(tree: Tree, *args: Any) -> int:
        nonlocal running, peak, stopped
        with counting:
            running += 1
            peak = max(peak, running)
        try:
            assert gate.wait(60)
            return tally(tree, *args)
        except WalkStopped:
            with counting:
                stopped += 1
            raise
        finally:
            with counting:
                running -= 1

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            peer = bob.peer("alice").node_id
            handled: list[str] = []
            handle = agent.handlers[AppPrepare]

            async def counted(ctx: RequestContext, message: AppPrepare) -> None:
                await handle(ctx, message)
                handled.append(message.name)

            agent.handlers[AppPrepare] = counted
            async with bob.session(peer) as session:
                first = await sync_app(bob, "alice", project, reuse=session)
                assert len(first.sent) == 2000
                await _idle(agent.apps)
                bob_id = str(bob.info().node_id)
                app = alice.home.path / "files" / bob_id / "apps" / "big"
                (app / "d3" / "f300.txt").write_text("a job wrote this\n")
                (project / "d7" / "f777.txt").write_text("changed here\n")
                monkeypatch.setattr(Tree, "tally", held)
                handled.clear()
                for _ in range(50):
                    stream = session.open_stream()
                    stream.send_message(AppPrepare(name="big"), end=True)
                    session.link.forget_stream(stream.stream_id)
                for _ in range(600):  # a generous ceiling
                    if len(handled) == 50:
                        break
                    await asyncio.sleep(0.05)
                assert len(handled) == 50
                assert agent.apps.prepared_walks(bob_id) == agent_apps.PREPARED_WALKS
                gate.set()
                for _ in range(600):
                    if agent.apps.prepared_walks(bob_id) == 0:
                        break
                    await asyncio.sleep(0.05)
                monkeypatch.setattr(Tree, "tally", tally)
                assert agent.apps.prepared_walks(bob_id) == 0 and running == 0
                assert peak == agent_apps.PREPARED_WALKS
                assert stopped == agent_apps.PREPARED_WALKS  # replaced: stopped at once
                after = await sync_app(bob, "alice", project, reuse=session)
                assert sorted(after.sent) == ["d3/f300.txt", "d7/f777.txt"]
                assert after.unchanged == 1998
                assert (app / "d3" / "f300.txt").read_text() == "file 300\n"
                assert (app / "d7" / "f777.txt").read_text() == "changed here\n"
                await _idle(agent.apps)
                assert agent.apps.prepared_walks(bob_id) == 0

    arun(scenario())
