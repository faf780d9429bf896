"""A provider's image pull, as the consumer sees it: real dockerd pulling from a real
registry on loopback (tests/integration/registry.py), real agents, the real CLI.

The served image is the offline test image plus one new layer of random bytes, so
the engine really fetches something (layers it has already are only mentioned)."""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

from gpumesh.client.jobs import JobCallbacks, run_job
from gpumesh.protocol.messages import ImagePull, JobAccepted, JobSubmit
from tests.integration.conftest import arun, gpumesh, pair_both, remove_containers, sharing
from tests.integration.registry import Registry, local_registry
from tests.integration.test_jobs import spec

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
NEW_LAYER = 3 << 20


@pytest.fixture
def registry(engine: docker.DockerClient) -> Iterator[Registry]:
    with local_registry(delay=0.005) as served:
        yield served


def _serve(registry: Registry, engine: docker.DockerClient) -> tuple[str, list[int]]:
    """A fresh tag of a new image on ``registry``: (its name, its layer blob sizes)."""
    tag = uuid.uuid4().hex[:8]
    sizes = registry.add(engine, IMAGE, "gpumesh-test/pulled", tag, new_layer=NEW_LAYER)
    return f"{registry.address}/gpumesh-test/pulled:{tag}", sizes


@contextlib.contextmanager
def _removed_after(engine: docker.DockerClient, image: str) -> Iterator[None]:
    try:
        yield
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound, docker.errors.APIError):
            engine.images.remove(image, force=True)


def test_a_consumer_hears_the_pull_of_its_jobs_image(
    make_node, engine: docker.DockerClient, registry: Registry
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    image, sizes = _serve(registry, engine)
    heard: list[ImagePull] = []

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            result = await run_job(
                bob, spec("alice", "true", image=image), callbacks=JobCallbacks(pull=heard.append)
            )
            assert result.state == "succeeded"

    with _removed_after(engine, image):
        try:
            arun(scenario())
        finally:
            remove_containers(str(alice.info().node_id))
    assert heard, "the consumer heard nothing of the pull"
    last = heard[-1]
    assert last.image == image and last.done
    assert (last.layers, last.layers_done) == (len(sizes), len(sizes))
    assert last.downloaded == last.total == sizes[-1]  # only the new layer is fetched
    assert [p.done for p in heard].count(True) == 1
    assert registry.blob_requests >= 1


def test_the_cli_says_what_is_pulled_and_exec_does_too(
    pair: tuple[Path, Path], engine: docker.DockerClient, registry: Registry
) -> None:
    _alice, bob = pair
    image, _sizes = _serve(registry, engine)
    with _removed_after(engine, image):
        run = gpumesh(
            bob, "run", "--peer", "alice-pc", "--image", image, "--", "echo", "ok", timeout=120
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout == "ok\n"
        assert f"gpumesh: the provider is pulling {image}\n" in run.stderr
        done = re.search(
            rf"gpumesh: pulled {re.escape(image)}: (\d+)/(\d+) layers, (\S+) fetched", run.stderr
        )
        assert done is not None, run.stderr
        assert done.group(1) == done.group(2) and done.group(3) == "3.1MB"
        # Here now: the next job pulls nothing, and says nothing of it.
        again = gpumesh(
            bob, "run", "--peer", "alice-pc", "--image", image, "--", "true", timeout=120
        )
        assert again.returncode == 0, again.stderr
        assert "pulling" not in again.stderr

    image, _sizes = _serve(registry, engine)
    with _removed_after(engine, image):
        shell = gpumesh(bob, "exec", "--image", image, "alice-pc", "echo", "shell-ok", timeout=120)
        assert shell.returncode == 0, shell.stderr
        assert "shell-ok" in shell.stdout
        assert f"gpumesh: the provider is pulling {image}\n" in shell.stderr


def test_a_consumer_that_did_not_ask_hears_no_pull(
    make_node, engine: docker.DockerClient, registry: Registry
) -> None:
    """Consumers from before ImagePull never ask for it, and must never get it: their
    first answer is JobAccepted, as always."""
    alice, bob = make_node("alice"), make_node("bob")
    image, _sizes = _serve(registry, engine)

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            async with bob.session(bob.peer("alice").node_id) as session:
                stream = session.open_stream()
                stream.send_message(
                    JobSubmit(
                        job_id=uuid.uuid4().hex[:12],
                        image=image,
                        command=["true"],
                        env={},
                        workdir_bytes=0,
                        gpu_memory=0,
                        retries=0,
                        timeout=0,
                        attach=False,
                    )
                )
                first = await stream.read_message()
                assert isinstance(first, JobAccepted), first

    with _removed_after(engine, image):
        try:
            arun(scenario())
        finally:
            remove_containers(str(alice.info().node_id))
