"""Fixtures for integration tests: real nodes with separate homes on 127.0.0.1.

Everything here is real: QUIC over UDP loopback sockets, SQLite files, the
CLI as a subprocess. Agents run in the test's event loop unless a test needs
a separate process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpumesh.agent.server import Agent
from gpumesh.client.node import Node
from tests.cli import run_cli
from tests.integration.node import node_env

T = TypeVar("T")


def until(check: Callable[[], T], what: str, *, within: float = 60.0, every: float = 0.05) -> T:
    """Poll ``check`` until it returns something true, and return that; fail
    saying ``what`` was awaited after ``within`` seconds. The tests' one polling
    loop: its ceiling bounds a hang and is never a verdict on speed."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} (waited {within:g} s)")
        time.sleep(every)


async def until_async(
    check: Callable[[], T], what: str, *, within: float = 60.0, every: float = 0.02
) -> T:
    """:func:`until` inside an event loop: the loop runs while it waits."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} (waited {within:g} s)")
        await asyncio.sleep(every)


async def until_hosted(node: Node, job_id: str, *states: str, within: float = 60.0) -> None:
    """Wait until ``node`` hosts job ``job_id`` in one of ``states``."""

    def reached() -> bool:
        job = node.home.store.job("hosted", job_id)
        return job is not None and job.state in states

    await until_async(reached, f"job {job_id} to be {' or '.join(states)}", within=within)


def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Run one async scenario with a timeout so a hang fails instead of stalling CI."""

    async def bounded() -> T:
        async with asyncio.timeout(60):
            return await coro

    return asyncio.run(bounded())


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[[str], Node]]:
    """Create initialized nodes that listen on 127.0.0.1 only."""
    nodes: list[Node] = []

    def factory(name: str) -> Node:
        node = Node(tmp_path / name)
        node.init(name)
        node.home.config.set("listen_host", "127.0.0.1")
        node.home.config.set("connect_timeout", "3")
        node.home.config.save()
        nodes.append(node)
        return node

    yield factory
    for node in nodes:
        node.close()


@contextlib.asynccontextmanager
async def sharing(node: Node) -> AsyncIterator[Agent]:
    """Run ``node``'s provider agent on an ephemeral loopback port."""
    agent = Agent(node.home, host="127.0.0.1", port=0)
    await agent.start()
    try:
        yield agent
    finally:
        agent.stop()


def pair_both(a: Node, b: Node) -> None:
    """Mutual pairing (call after the agents that should be reachable started)."""
    b.pair(a.pairing_code())
    a.pair(b.pairing_code())


RELAY_CEILING = 30.0
"""Seconds an agent gets to register with the relay (generous: CI is a loaded 2-core box)."""


@pytest.fixture
def relayed_alice(tmp_path: Path) -> Iterator[tuple[Node, Node, str]]:
    """alice listening on loopback with a real `gpumesh-relay` (``--open``) as her
    relay, and bob; the relay's address. Share with :func:`sharing_relayed`."""
    from tests.integration.test_relay_node import _start_relay, _stop

    proc, relay = _start_relay(tmp_path, "--open")
    alice, bob = Node(tmp_path / "a"), Node(tmp_path / "b")
    alice.init("alice")
    bob.init("bob")
    alice.home.config.set("listen_host", "127.0.0.1")
    alice.home.config.set("relay", relay)
    try:
        yield alice, bob, relay
    finally:
        _stop(proc)
        alice.close()
        bob.close()


@contextlib.asynccontextmanager
async def sharing_relayed(alice: Node, bob: Node) -> AsyncIterator[Agent]:
    """``alice`` sharing (see :func:`sharing`), paired with ``bob``, once her agent is
    registered with her relay."""
    async with sharing(alice) as agent:
        pair_both(alice, bob)
        assert agent.relay is not None
        await agent.relay.wait_registered(RELAY_CEILING)
        yield agent


@pytest.fixture
def engine() -> Iterator[Any]:
    """A Docker client for tests that look at containers themselves."""
    import docker
    import docker.errors

    client = docker.from_env()
    yield client
    client.close()


@contextlib.contextmanager
def job_nodes(make_node: Callable[[str], Node], job_memory: str) -> Iterator[Callable[[str], Node]]:
    """A factory of nodes that run the offline test image in containers of
    ``job_memory``; every container they made is removed afterwards."""
    image = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
    made: list[Node] = []

    def factory(name: str) -> Node:
        node = make_node(name)
        node.home.config.set("image", image)
        node.home.config.set("job_memory", job_memory)
        node.home.config.save()
        made.append(node)
        return node

    try:
        yield factory
    finally:
        for node in made:
            remove_containers(str(node.info().node_id))


def remove_containers(node_id: str) -> None:
    """Remove every container a node's agent made (agents keep job containers on
    stop), and the network holders made for it."""
    import docker
    import docker.errors

    from gpumesh.runtime.base import LABEL_NODE
    from gpumesh.runtime.holders import LABEL_HOLDER_OF

    client = docker.from_env()
    try:
        found = [
            summary
            for label in (LABEL_NODE, LABEL_HOLDER_OF)
            for summary in client.api.containers(all=True, filters={"label": f"{label}={node_id}"})
        ]
        for summary in found:
            try:
                client.api.remove_container(summary["Id"], force=True)
            except docker.errors.APIError as exc:
                # The agent's own removal of a finished job's container may be under
                # way (it runs after the job's end is told) or done by now.
                if exc.status_code not in (404, 409):
                    raise
    finally:
        client.close()


def gpumesh(home: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """The real CLI for ``home``, run in this process (:func:`tests.cli.run_cli`)."""
    return run_cli(list(args), node_env(home), timeout=timeout)


@contextlib.contextmanager
def shared_pair(tmp_path: Path, **alice_config: str) -> Iterator[tuple[Path, Path]]:
    """alice shares (as a real `gpumesh share` process, with ``alice_config`` set
    first), bob is paired with her both ways.

    Both use the offline test image by default (the submitter's default image is
    the one a job gets); alice's job containers are removed afterwards.
    """
    import json
    import signal

    from tests.integration.test_cli import _free_udp_port, _init, _start_share

    image = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
    alice, bob = tmp_path / "a", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop")
    for home in (alice, bob):
        assert gpumesh(home, "config", "set", "image", image).returncode == 0
    for key, value in alice_config.items():
        assert gpumesh(alice, "config", "set", key, value).returncode == 0
    share = _start_share(alice)
    try:
        assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
        assert gpumesh(alice, "pair", gpumesh(bob, "pair-code").stdout.strip()).returncode == 0
        yield alice, bob
    finally:
        if share.poll() is None:
            share.send_signal(signal.SIGINT)
            share.wait(timeout=15)
        for pipe in (share.stdout, share.stderr):
            if pipe is not None:
                pipe.close()
        remove_containers(json.loads(gpumesh(alice, "status", "--json").stdout)["node_id"])


@pytest.fixture
def pair(tmp_path: Path, gpumesh_processes: None) -> Iterator[tuple[Path, Path]]:
    """:func:`shared_pair` with alice's defaults."""
    with shared_pair(tmp_path) as homes:
        yield homes


def ok(home: Path, *args: str, timeout: float = 30) -> str:
    """The real CLI for ``home``, which must succeed without a traceback: its output."""
    result = gpumesh(home, *args, timeout=timeout)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stdout + result.stderr


@pytest.fixture
def trio(tmp_path: Path, gpumesh_processes: None) -> Iterator[tuple[Path, Path, Path]]:
    """alice-pc and carol share (no GPUs, simulated or real); bob is paired with both
    and has them in his group `research`."""
    with sharing_trio(tmp_path) as homes:
        yield homes


@contextlib.contextmanager
def sharing_trio(
    tmp_path: Path, *, carol_inside: Sequence[str] = (), **carol_config: str
) -> Iterator[tuple[Path, Path, Path]]:
    """:func:`trio`'s three homes, sharing while the block runs. ``carol_config`` is
    set in carol's config first; with ``carol_inside`` (a command prefix such as
    ``ip netns exec NS``) her node process is started through it, so that it and
    the processes it starts run there."""
    import json
    import signal

    from tests.integration.test_cli import _free_udp_port, _init, _start_share

    image = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
    alice, carol, bob = tmp_path / "a", tmp_path / "c", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(carol, "carol", _free_udp_port())
    _init(bob, "bob-laptop")
    for home in (alice, carol, bob):
        ok(home, "config", "set", "image", image)
    for key, value in carol_config.items():
        ok(carol, "config", "set", key, value)
    if carol_inside:
        # The commands above ran through a node process started here: the share
        # must start hers where she runs.
        ok(carol, "daemon", "stop")
    shares: list[subprocess.Popen[str]] = []
    try:
        for provider, inside in ((alice, ()), (carol, carol_inside)):
            shares.append(_start_share(provider, inside=inside))
            ok(bob, "pair", ok(provider, "pair-code").strip(), "--offline")
            ok(provider, "pair", ok(bob, "pair-code").strip(), "--offline")
        ok(bob, "group", "create", "research")
        ok(bob, "group", "add", "research", "alice-pc")
        ok(bob, "group", "add", "research", "carol")
        yield alice, carol, bob
    finally:
        for share in shares:
            if share.poll() is None:
                share.send_signal(signal.SIGINT)
                share.wait(timeout=15)
            for pipe in (share.stdout, share.stderr):
                if pipe is not None:
                    pipe.close()
        for provider in (alice, carol):
            with contextlib.suppress(AssertionError):
                remove_containers(json.loads(ok(provider, "status", "--json"))["node_id"])
