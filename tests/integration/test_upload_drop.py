"""A workdir upload whose link drops part-way ends with one clear error, never a hang.

The tar is packed on a thread that feeds a bounded queue; when the link goes
while the thread is far ahead of the sender, the thread must be released (its
queue drained or its writes refused) so the client can report the drop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpumesh.client.jobs import JobCallbacks, run_job
from gpumesh.client.node import Node
from gpumesh.errors import GPUMeshError
from tests.integration.conftest import job_nodes, pair_both
from tests.integration.test_jobs import providing, spec

_CEILING = 120.0
"""Generous: the scenario needs a few seconds; a hang would take forever."""


@pytest.fixture
def cluster(make_node, engine) -> Iterator[Callable[[str], Node]]:
    with job_nodes(make_node, "256MB") as factory:
        yield factory


def _big_workdir(root: Path) -> Path:
    folder = root / "workdir"
    folder.mkdir()
    for index in range(24):
        (folder / f"part-{index:02d}.bin").write_bytes(os.urandom(2 << 20))
    return folder


@pytest.mark.usefixtures("docker_daemon")
def test_a_link_dropped_mid_upload_ends_the_run_with_an_error(cluster, tmp_path: Path) -> None:
    alice, bob = cluster("alice"), cluster("bob")
    bob.home.config.set("data_channel", "off")  # the workdir goes over QUIC, packed on a thread
    bob.home.config.save()
    workdir = _big_workdir(tmp_path)
    uploads: list[tuple[int, int]] = []

    async def scenario() -> BaseException | None:
        async with providing(alice) as agent:
            pair_both(alice, bob)

            def upload(sent: int, total: int) -> None:
                uploads.append((sent, total))
                if len(uploads) == 1:  # the packer is ahead by now: drop the link under it
                    for link in list(agent._links):
                        link.close()

            job = spec("alice", "true", workdir=workdir)
            try:
                async with asyncio.timeout(_CEILING):
                    await run_job(bob, job, callbacks=JobCallbacks(upload=upload))
            except TimeoutError as exc:
                return exc
            except GPUMeshError as exc:
                return exc
            return None

    outcome = asyncio.run(scenario())
    assert not isinstance(outcome, TimeoutError), "the client hung after the link dropped"
    assert isinstance(outcome, GPUMeshError), f"the run did not fail: {outcome!r}"
    assert "\n" not in outcome.message and outcome.message
    assert uploads and uploads[-1][0] < uploads[-1][1]  # it really broke off part-way
