"""The provider decides which images peers run, how long a pull may take, and how
much disk images pulled for peers may take. Real agents and the real dockerd;
no registry is reachable here, so a "registry" that never answers stands in
for a slow one, and small images imported offline stand in for pulled ones."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import tarfile
import threading
import uuid
from collections.abc import Iterator

import docker
import docker.errors
import pytest

from gpumesh.agent.images import ImageKeeper
from gpumesh.client.jobs import run_job
from gpumesh.errors import AccessDeniedError, ImageMissingError, LimitError
from gpumesh.runtime.docker import DockerRuntime
from gpumesh.store.db import Store
from tests.integration.conftest import arun, pair_both, remove_containers, sharing
from tests.integration.test_jobs import spec

pytestmark = pytest.mark.usefixtures("docker_daemon")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")


@pytest.fixture
def small_images(engine: docker.DockerClient) -> Iterator[list[str]]:
    """Three distinct images of different sizes (as if pulled for peers), removed after."""
    made = []
    for number, size in enumerate((30_000, 20_000, 10_000)):
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w") as tar:
            info = tarfile.TarInfo(f"payload-{number}")
            info.size = size
            tar.addfile(info, io.BytesIO(os.urandom(size)))
        name = f"gpumesh-test/pulled-{uuid.uuid4().hex[:8]}:{number}"
        engine.api.import_image_from_data(
            data.getvalue(), repository=name.split(":", maxsplit=1)[0], tag=str(number)
        )
        made.append(name)
    yield made
    for name in made:
        with contextlib.suppress(docker.errors.ImageNotFound):
            engine.images.remove(name, force=True)


def test_images_pulled_for_peers_stay_within_image_disk(
    engine: docker.DockerClient, small_images: list[str], tmp_path
) -> None:
    runtime = DockerRuntime(engine)
    store = Store(tmp_path / "gpumesh.db")
    clock = iter(range(1, 100))
    keeper = ImageKeeper(store, lambda: runtime, provider="alice-pc", clock=lambda: next(clock))
    oldest, middle, newest = small_images
    sizes = {name: runtime.image_size(name) or 0 for name in small_images}
    # A container uses the oldest: it must survive any pruning.
    in_use = engine.api.create_container(oldest, command=["/nothing"])["Id"]
    try:
        keeper.used(oldest, pulled=True, budget=10**9)
        keeper.used(middle, pulled=True, budget=10**9)
        # The newest makes it too much: the least recently used that no container
        # uses (middle) goes; oldest stays because a container uses it.
        budget = sizes[oldest] + sizes[newest] + 1
        keeper.used(newest, pulled=True, budget=budget)
        assert runtime.image_size(middle) is None
        assert runtime.image_size(oldest) is not None
        assert runtime.image_size(newest) is not None
        assert [row[0] for row in store.pulled_images()] == [oldest, newest]
        # Images that were here before any peer asked are the owner's: never counted.
        keeper.used(IMAGE, pulled=False, budget=1)
        assert runtime.image_size(IMAGE) is not None
    finally:
        engine.api.remove_container(in_use, force=True)
        store.close()


def test_an_image_larger_than_image_disk_is_refused_and_removed(
    engine: docker.DockerClient, small_images: list[str], tmp_path
) -> None:
    runtime = DockerRuntime(engine)
    store = Store(tmp_path / "gpumesh.db")
    keeper = ImageKeeper(store, lambda: runtime, provider="alice-pc")
    try:
        with pytest.raises(LimitError, match=r"alice-pc refused image .* \(image_disk\)"):
            keeper.used(small_images[0], pulled=True, budget=1000)
        assert runtime.image_size(small_images[0]) is None
        assert store.pulled_images() == []
    finally:
        store.close()


def test_only_allowed_images_run(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    alice.home.config.set("allowed_images", "nvidia/cuda:* gpumesh-test/busybox:*")
    alice.home.config.set("job_memory", "256MB")
    alice.home.config.save()

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            ok = await run_job(bob, spec("alice", "true"))  # the test image: allowed
            assert ok.state == "succeeded"
            with pytest.raises(AccessDeniedError) as caught:
                await run_job(bob, spec("alice", "true", image="evil/miner:latest"))
            assert caught.value.message == (
                "alice refused image 'evil/miner:latest': it runs only images matching "
                "nvidia/cuda:*, gpumesh-test/busybox:* (its allowed_images); pick one of "
                "those, or ask its owner"
            )

    try:
        arun(scenario())
    finally:
        remove_containers(str(alice.info().node_id))


@pytest.fixture
def silent_registry() -> Iterator[str]:
    """A "registry" on loopback that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def test_a_pull_that_takes_too_long_is_refused_with_the_limit(make_node, silent_registry) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    alice.home.config.set("pull_timeout", "1")
    alice.home.config.save()
    image = f"{silent_registry}/slow/image:1"

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            with pytest.raises(ImageMissingError) as caught:
                await run_job(bob, spec("alice", "true", image=image))
            message = caught.value.message
            assert message.startswith(f"image {image!r} is not on alice and cannot be pulled")
            assert "(the pull did not finish within 1 s (pull_timeout))" in message

    try:
        arun(scenario())
    finally:
        remove_containers(str(alice.info().node_id))
