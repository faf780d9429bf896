"""A job listing waits on a provider that went quiet only once: later listings
show its jobs' last confirmed state with the reason at once, and ask it again
in the background until it answers.

The providers are stood in for by ``_refresh_peer`` (what asks one provider
about its jobs): one that never answers is a question that never returns, so a
listing that waited on it would not return within the generous ceiling."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.client import jobrefresh
from gpumesh.client.jobrefresh import Unconfirmed, refresh_jobs
from gpumesh.client.node import Node
from gpumesh.errors import ConnectionLostError
from gpumesh.protocol.states import JobRole, JobState
from gpumesh.store.jobs import JobRecord
from tests.unit.test_db import _job as job_record

CEILING = 30.0


def _job(job_id: str, peer_id: str, peer_name: str) -> JobRecord:
    """A job this node submitted to ``peer_name`` that runs, as far as it knows."""
    record = job_record(JobRole.SUBMITTED, job_id, JobState.RUNNING, created_at=1.0)
    return dataclasses.replace(record, peer_id=peer_id, peer_name=peer_name)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path / "home")
    made.init("bob-laptop")
    made.home.store.add_job(_job("aaaa0001", "alice-id", "alice-pc"))
    made.home.store.add_job(_job("cccc0001", "carol-id", "carol-box"))
    yield made
    made.close()


class Providers:
    """What each provider does when asked: answers, stays silent (the question
    returns "no answer" at once, as a timed-out one would), or hangs forever."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.behaviour = {"alice-pc": "answer", "carol-box": "answer"}
        self.asked: list[str] = []
        self.hanging = asyncio.Event()
        monkeypatch.setattr(jobrefresh, "_refresh_peer", self._refresh_peer)

    async def _refresh_peer(
        self, node: Node, records: list[JobRecord], timeout: float
    ) -> Unconfirmed | None:
        name = records[0].peer_name
        self.asked.append(name)
        ids = frozenset(job.job_id for job in records)
        behaviour = self.behaviour[name]
        if behaviour == "silent":
            return Unconfirmed(name, f"no answer within {timeout:g}s", ids)
        if behaviour == "hang":
            await self.hanging.wait()  # never set: a provider that never answers
        return None


def _listing(node: Node) -> dict[str, str]:
    async def run() -> dict[str, str]:
        found = await asyncio.wait_for(refresh_jobs(node), CEILING)
        return {answer.peer: answer.reason for answer in found}

    return asyncio.run(run())


def test_a_quiet_provider_is_waited_on_once_then_asked_in_the_background(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    providers = Providers(monkeypatch)
    assert _listing(node) == {}

    providers.behaviour["carol-box"] = "silent"
    assert _listing(node) == {"carol-box": "no answer within 3s"}

    # From now on carol never answers: were the listing to wait on her, it would
    # not return. It says what was last heard, and alice is still asked.
    providers.behaviour["carol-box"] = "hang"
    providers.asked.clear()

    async def twice() -> tuple[dict[str, str], dict[str, str]]:
        first = await asyncio.wait_for(refresh_jobs(node), CEILING)
        second = await asyncio.wait_for(refresh_jobs(node), CEILING)
        return (
            {answer.peer: answer.reason for answer in first},
            {answer.peer: answer.reason for answer in second},
        )

    first, second = asyncio.run(twice())
    assert first == second == {"carol-box": "no answer within 3s"}
    # Alice asked by each listing; carol once in the background, not again while
    # that question is out.
    assert sorted(providers.asked) == ["alice-pc", "alice-pc", "carol-box"]


def test_a_provider_that_answers_again_is_asked_again(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    providers = Providers(monkeypatch)
    providers.behaviour["carol-box"] = "silent"
    assert _listing(node) == {"carol-box": "no answer within 3s"}

    providers.behaviour["carol-box"] = "answer"

    async def until_heard() -> dict[str, str]:
        # The listing asks her in the background; her answer takes her off the list.
        first = await asyncio.wait_for(refresh_jobs(node), CEILING)
        assert {answer.peer for answer in first} == {"carol-box"}
        asking = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        await asyncio.wait_for(asyncio.gather(*asking), CEILING)
        assert node.silent_providers.reason("carol-id") is None
        second = await asyncio.wait_for(refresh_jobs(node), CEILING)
        return {answer.peer: answer.reason for answer in second}

    assert asyncio.run(until_heard()) == {}


class _QuietSession:
    """A warm session whose peer went away without a word: requests get no answer."""

    punched_address = None
    link = type("Link", (), {"is_closed": False})()

    async def request(self, message: object, timeout: float) -> object:
        raise ConnectionLostError(f"no answer within {timeout:g}s")

    def close(self) -> None:
        pass


def test_a_warm_session_whose_keep_alive_goes_unanswered_marks_its_peer_silent(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpumesh.client.pool import SessionPool, Warm

    providers = Providers(monkeypatch)
    providers.behaviour["carol-box"] = "hang"  # were she asked and waited on: no return
    pool = SessionPool(keepalive=2.0)
    pool.on_silent = node.silent_providers.went_silent
    warm = Warm("carol-id", "carol-box", b"k", _QuietSession(), 0.0, 0.0)  # type: ignore[arg-type]
    pool._warm["carol-id"] = warm
    asyncio.run(pool._ping(warm))
    assert pool.warm("carol-id", warm.session) is None  # dropped
    why = node.silent_providers.reason("carol-id")
    assert why == "its keep-alive got no answer (no answer within 2s)"
    # So the first listing since does not wait on carol either.
    assert _listing(node) == {"carol-box": why}
