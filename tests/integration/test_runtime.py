"""DockerRuntime against the real Docker engine.

Every test labels its containers with its own ``io.gpumesh.node`` value; the
``jobs`` fixture removes every container with that label afterwards and fails
if one survives. The image comes from ``GPUMESH_TEST_DOCKER_IMAGE`` (a
busybox with sh, printf, head, tr, sleep, env, id and friends); nothing is
pulled, so the tests run offline. The one test that needs Python and pip uses
``GPUMESH_TEST_PYTHON_IMAGE``, built from this machine's own interpreter by
``scripts/build-python-image.sh`` the first time it is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from gpumesh.errors import (
    AgentError,
    ConfigError,
    ImageMissingError,
    NotFoundError,
    RuntimeUnavailableError,
)
from gpumesh.runtime.base import (
    LABEL_ATTEMPT,
    LABEL_IMAGE,
    LABEL_JOB,
    LABEL_KIND,
    LABEL_NODE,
    LABEL_PEER,
    ContainerSpec,
    ContainerState,
    EngineIsolation,
    LogCursor,
    LogLine,
    Stream,
)
from gpumesh.runtime.docker import DockerRuntime, _engine_isolation
from gpumesh.runtime.holders import LABEL_HOLDER_OF
from gpumesh.runtime.logs import _EntryReader, _timestamp_key
from tests.jobnet_lab import network_host_config

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
MiB = 1024 * 1024


class Jobs:
    """Containers of one test: one node label, one runtime, helpers to run them."""

    def __init__(self, runtime: DockerRuntime, client: Any, node_id: str) -> None:
        self.runtime = runtime
        self.client = client
        self.node_id = node_id

    def spec(self, command: list[str], **fields: Any) -> ContainerSpec:
        job = uuid.uuid4().hex[:10]
        values: dict[str, Any] = {
            "image": IMAGE,
            "command": command,
            "env": {},
            "labels": {
                LABEL_JOB: job,
                LABEL_PEER: "peer-under-test",
                LABEL_NODE: self.node_id,
                LABEL_ATTEMPT: "1",
            },
            "name": f"gpumesh-test-{job}",
            "memory": 64 * MiB,
            "pids_limit": 64,
            "network": "none",
        }
        values.update(fields)
        return ContainerSpec(**values)

    def create(self, command: list[str], **fields: Any) -> str:
        return self.runtime.create(self.spec(command, **fields))

    def started(self, command: list[str], **fields: Any) -> str:
        container_id = self.create(command, **fields)
        self.runtime.start(container_id)
        return container_id

    def run(self, command: list[str], **fields: Any) -> tuple[str, ContainerState]:
        container_id = self.started(command, **fields)
        return container_id, self.runtime.wait(container_id)

    def lines(
        self, container_id: str, stream: Stream, cursor: LogCursor | None = None
    ) -> list[LogLine]:
        return list(self.runtime.job_logs(container_id, {stream: cursor or LogCursor()}, False))

    def output(self, container_id: str, stream: Stream) -> bytes:
        return b"".join(line.data for line in self.lines(container_id, stream))

    def config_env(self, container_id: str) -> list[str]:
        return list(self.client.api.inspect_container(container_id)["Config"]["Env"])

    def leftovers(self, node_id: str | None = None) -> list[dict[str, Any]]:
        label = f"{LABEL_NODE}={node_id or self.node_id}"
        return list(self.client.api.containers(all=True, filters={"label": label}))


def _remove_labelled(client: Any, node_id: str) -> list[str]:
    """Remove this test's containers and network holders; return the names of any
    that would not go."""
    labels = [f"{LABEL_NODE}={node_id}", f"{LABEL_HOLDER_OF}={node_id}"]
    for label in labels:
        for summary in client.api.containers(all=True, filters={"label": label}):
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_container(summary["Id"], force=True, v=True)
    return [
        str(c["Names"])
        for label in labels
        for c in client.api.containers(all=True, filters={"label": label})
    ]


@pytest.fixture
def runtime_engine(docker_daemon: None) -> Iterator[Any]:
    """The Docker engine these tests drive the job runtime against (its own client)."""
    client = docker.from_env()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def jobs(runtime_engine: Any) -> Iterator[Jobs]:
    node_id = f"test-{uuid.uuid4().hex[:12]}"
    runtime = DockerRuntime()
    try:
        yield Jobs(runtime, runtime_engine, node_id)
    finally:
        runtime.close()
        left = _remove_labelled(runtime_engine, node_id)
        assert not left, f"containers of {node_id} survived the test: {left}"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    # Root in the container has no CAP_DAC_OVERRIDE: it can write only where
    # the mode allows, and the tests may run as any user.
    folder.chmod(0o777)
    return folder


# --- engine and images ------------------------------------------------------------------


def test_version_and_gpu_runtime(jobs: Jobs) -> None:
    version = jobs.runtime.version()
    assert version.startswith("Docker ") and "(API 1." in version
    assert isinstance(jobs.runtime.gpu_runtime_available(), bool)


def test_ensure_image_present_is_quiet(jobs: Jobs) -> None:
    assert jobs.runtime.ensure_image(IMAGE) is False  # here already: nothing pulled
    size = jobs.runtime.image_size(IMAGE)
    assert size is not None and size > 0
    assert jobs.runtime.image_size("gpumesh-test/no-such-image:1") is None


def test_ensure_image_that_cannot_be_pulled(jobs: Jobs) -> None:
    image = f"gpumesh-test/no-such-image-{uuid.uuid4().hex[:8]}:1"
    runtime = DockerRuntime(jobs.client, pull_timeout=60)
    with pytest.raises(ImageMissingError) as caught:
        runtime.ensure_image(image)
    message = str(caught.value)
    assert message.startswith(f"image {image!r} is not on this machine and cannot be pulled (")
    assert f"run `docker pull {image}` or `docker load -i FILE`" in message
    assert "\n" not in message
    # No registry is reachable here: the engine's error names this machine's resolver
    # ("lookup ... on 10.x.x.x:53"); the peer only hears what kind of failure it was.
    assert "(the provider cannot reach the registry)" in message
    assert not re.search(r"\d+\.\d+\.\d+\.\d+", message), message
    assert "lookup" not in message and "dial tcp" not in message


def test_a_pull_from_a_registry_reports_its_layers_and_bytes(jobs: Jobs) -> None:
    """A real pull by the engine, from a registry on loopback (tests/integration/registry.py)."""
    from gpumesh.runtime.pull import PullProgress
    from tests.integration.registry import local_registry

    tag = uuid.uuid4().hex[:8]
    with local_registry(delay=0.02) as registry:
        sizes = registry.add(jobs.client, IMAGE, "gpumesh-test/pulled", tag, new_layer=1 << 20)
        image = f"{registry.address}/gpumesh-test/pulled:{tag}"
        heard: list[PullProgress] = []
        try:
            assert DockerRuntime(jobs.client).ensure_image(image, heard.append) is True
            assert jobs.runtime.image_present(image)
            assert jobs.runtime.ensure_image(image, heard.append) is False  # here now
        finally:
            with contextlib.suppress(docker.errors.APIError):
                jobs.client.images.remove(image)
    assert heard, "no progress was reported"
    last = heard[-1]
    assert last.image == image and last.done
    # The base layers are here already ("Already exists": done, no bytes); only the
    # new one is fetched, all of its compressed bytes.
    assert (last.layers, last.layers_done) == (len(sizes), len(sizes))
    assert last.total == sizes[-1] and last.downloaded == sizes[-1]
    # Figures only grow; some were heard before the end.
    assert [p.downloaded for p in heard] == sorted(p.downloaded for p in heard)
    assert any(not p.done for p in heard)


def test_create_with_a_missing_image(jobs: Jobs) -> None:
    image = f"gpumesh-test/no-such-image-{uuid.uuid4().hex[:8]}:1"
    with pytest.raises(ImageMissingError, match="docker pull"):
        jobs.create(["true"], image=image)
    assert jobs.leftovers() == []


def _quiet_gc() -> None:
    # The SDK leaves the socket of a failed connect for the garbage collector.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def test_unreachable_engine_from_a_given_client() -> None:
    # A fixed API version: otherwise the client itself asks the engine at once.
    client = docker.DockerClient(base_url="unix:///nonexistent.sock", version="1.41")
    try:
        runtime = DockerRuntime(client)
        with pytest.raises(RuntimeUnavailableError) as caught:
            runtime.version()
        message = str(caught.value)
        assert message.startswith("Docker is not reachable on this machine (")
        assert "unix:///nonexistent.sock" in message
        assert message.endswith("start it with `sudo systemctl start docker`")
        assert "\n" not in message
        with pytest.raises(RuntimeUnavailableError):
            runtime.list_jobs("anything")
    finally:
        client.close()
        _quiet_gc()


def test_unreachable_engine_from_docker_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent.sock")
    runtime = DockerRuntime()
    try:
        with pytest.raises(RuntimeUnavailableError, match=r"nonexistent\.sock.*systemctl start"):
            runtime.ensure_image(IMAGE)
    finally:
        runtime.close()
        _quiet_gc()


# --- what runs, and how -----------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 3])
def test_exit_code(jobs: Jobs, code: int) -> None:
    container_id, state = jobs.run(["sh", "-c", f"exit {code}"])
    assert state.status == "exited"
    assert state.exit_code == code
    assert not state.oom_killed
    assert state.container_id == container_id
    assert state.labels[LABEL_NODE] == jobs.node_id


def test_stdout_and_stderr_kept_apart_and_binary_safe(jobs: Jobs) -> None:
    script = r"printf 'out\000\377\376\n'; printf 'err \201\n' >&2; printf 'tail'"
    container_id, state = jobs.run(["sh", "-c", script])
    assert state.exit_code == 0
    assert jobs.output(container_id, "stdout") == b"out\x00\xff\xfe\ntail"
    assert jobs.output(container_id, "stderr") == b"err \x81\n"


def test_env_is_visible(jobs: Jobs) -> None:
    env = {"GREETING": "hello world", "EQUATION": "a=b=c"}
    container_id, _ = jobs.run(["sh", "-c", 'echo "$GREETING|$EQUATION"'], env=env)
    assert jobs.output(container_id, "stdout") == b"hello world|a=b=c\n"


def test_workdir_is_mounted_and_is_the_cwd(jobs: Jobs, workdir: Path) -> None:
    (workdir / "input.txt").write_text("from the host\n")
    script = "pwd; cat input.txt; echo from the job > result.txt"
    container_id, state = jobs.run(["sh", "-c", script], workdir=str(workdir))
    assert state.exit_code == 0, jobs.output(container_id, "stderr")
    assert jobs.output(container_id, "stdout") == b"/workspace\nfrom the host\n"
    assert (workdir / "result.txt").read_text() == "from the job\n"


@pytest.mark.parametrize(
    "bad",
    ["relative/path", "/nonexistent/gpumesh-workdir", "FILE"],
    ids=["relative", "missing", "file"],
)
def test_create_refuses_a_bad_workdir(jobs: Jobs, tmp_path: Path, bad: str) -> None:
    if bad == "FILE":
        file = tmp_path / "not-a-dir"
        file.write_text("")
        bad = str(file)
    with pytest.raises(ConfigError, match="not an existing absolute directory"):
        jobs.create(["true"], workdir=bad)
    assert jobs.leftovers() == []


def test_create_refuses_missing_labels_and_host_network(jobs: Jobs) -> None:
    spec = jobs.spec(["true"])
    with pytest.raises(ConfigError, match=LABEL_ATTEMPT):
        jobs.runtime.create(dataclasses.replace(spec, labels={LABEL_NODE: jobs.node_id}))
    for network in ("host", "container:gpumesh-other", "gpumesh-jobs-x:y", "my-net"):
        with pytest.raises(ConfigError, match="use bridge, none or a job network"):
            jobs.create(["true"], network=network)
    with pytest.raises(ConfigError, match="only to containers on a job network"):
        jobs.create(["true"], network="bridge", dns=("10.0.0.2",))
    assert jobs.leftovers() == []


def test_lockdown_is_visible_in_host_config(jobs: Jobs, workdir: Path) -> None:
    container_id = jobs.create(["true"], workdir=str(workdir), cpus=0.5, pids_limit=32)
    host = jobs.runtime.host_config(container_id)
    assert host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"]
    assert not host.get("CapAdd")
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert host["PidsLimit"] == 32
    assert host["Memory"] == 64 * MiB
    assert host["MemorySwap"] == 64 * MiB
    assert host["NanoCpus"] == 500_000_000
    assert host["NetworkMode"] == "none"
    assert host["Binds"] == [f"{workdir}:/workspace:rw"]
    assert not host.get("Mounts")
    assert not host.get("Devices")
    assert not host.get("DeviceRequests")
    assert host["Init"] is True
    assert host["LogConfig"]["Type"] == "local"
    assert host["ReadonlyRootfs"] is True
    tmpfs = f"rw,exec,nosuid,nodev,size={1024 * MiB}"
    assert host["Tmpfs"] == {"/tmp": f"{tmpfs},mode=1777", "/home/gpumesh": f"{tmpfs},mode=1777"}
    assert host["ShmSize"] == 64 * MiB  # the 2 GiB default, clamped to the memory limit
    assert not host.get("StorageOpt")
    assert jobs.client.api.inspect_container(container_id)["Config"]["WorkingDir"] == "/workspace"

    default = jobs.create(["true"])
    assert jobs.runtime.host_config(default)["NetworkMode"] == "none"
    bridged = jobs.create(["true"], network="bridge")
    assert network_host_config(jobs.client.api, bridged)["NetworkMode"] == "bridge"


def test_lockdown_is_felt_inside(jobs: Jobs) -> None:
    script = "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; ls /sys/class/net; cat /proc/1/comm"
    container_id, state = jobs.run(["sh", "-c", script])
    assert state.exit_code == 0
    out = jobs.output(container_id, "stdout").decode().splitlines()
    assert out == ["CapEff:\t0000000000000000", "NoNewPrivs:\t1", "lo", "docker-init"]


def test_gpu_ids_become_a_device_request(jobs: Jobs) -> None:
    # Create only: this engine may have no NVIDIA runtime to start it with.
    gpus = ["0", "GPU-6f1c2f7e-0000-0000-0000-000000000000"]
    container_id = jobs.create(["true"], gpu_ids=gpus, env={"NVIDIA_VISIBLE_DEVICES": "all"})
    requests = jobs.runtime.host_config(container_id)["DeviceRequests"]
    assert isinstance(requests, list) and len(requests) == 1
    assert requests[0]["Driver"] == "nvidia"
    assert requests[0]["DeviceIDs"] == gpus
    assert requests[0]["Capabilities"] == [["gpu"]]
    env = jobs.config_env(container_id)
    assert f"NVIDIA_VISIBLE_DEVICES={','.join(gpus)}" in env
    assert "NVIDIA_VISIBLE_DEVICES=all" not in env


def test_no_gpus_means_visible_devices_void(jobs: Jobs) -> None:
    # An image that asks for every GPU, as CUDA base images do.
    base = jobs.client.api.create_container(IMAGE, ["true"])
    image = f"gpumesh-test/wants-all-gpus:{uuid.uuid4().hex[:8]}"
    repository, tag = image.split(":")
    jobs.client.api.commit(
        base["Id"], repository=repository, tag=tag, changes=["ENV NVIDIA_VISIBLE_DEVICES=all"]
    )
    jobs.client.api.remove_container(base["Id"], force=True)
    try:
        container_id, state = jobs.run(["env"], image=image)
        assert state.exit_code == 0
        env = jobs.output(container_id, "stdout").decode().splitlines()
        assert "NVIDIA_VISIBLE_DEVICES=void" in env
        assert not [line for line in env if line.startswith("NVIDIA_VISIBLE_DEVICES=all")]
        assert not jobs.runtime.host_config(container_id).get("DeviceRequests")

        container_id, _ = jobs.run(["env"], env={"NVIDIA_VISIBLE_DEVICES": "all"})
        assert "NVIDIA_VISIBLE_DEVICES=void" in jobs.output(container_id, "stdout").decode()
        assert "NVIDIA_VISIBLE_DEVICES=void" in jobs.config_env(container_id)
    finally:
        assert _remove_labelled(jobs.client, jobs.node_id) == []
        jobs.client.api.remove_image(image)


# --- root filesystem, users, tmpfs ------------------------------------------------------

JOB_USER = "47000:47000"


def test_job_runs_as_its_user_on_a_read_only_root(jobs: Jobs) -> None:
    script = (
        'id -u; id -g; echo "$HOME"; ls -ld "$HOME" /tmp | cut -c1-10; '
        "touch /forbidden; echo root=$?; "
        'mkdir -p "$HOME/.cache/pip" "$HOME/.local/lib" && echo x > "$HOME/.local/lib/f" '
        "&& echo x > /tmp/f && echo writes=ok"
    )
    container_id, state = jobs.run(["sh", "-c", script], user=JOB_USER)
    assert state.exit_code == 0, jobs.output(container_id, "stderr")
    out = jobs.output(container_id, "stdout").decode().splitlines()
    assert out == [
        "47000", "47000", "/home/gpumesh", "drwx------", "drwxrwxrwt", "root=1", "writes=ok"
    ]  # fmt: skip
    assert b"touch: /forbidden: Read-only file system" in jobs.output(container_id, "stderr")
    host = jobs.runtime.host_config(container_id)
    assert host["ReadonlyRootfs"] is True
    assert jobs.client.api.inspect_container(container_id)["Config"]["User"] == JOB_USER


@pytest.fixture
def tmp_0755_image(jobs: Jobs) -> Iterator[str]:
    """The test image with its /tmp and a VOLUME path made ``0755 root``, as a
    minimal image built with ``docker import`` may have them."""
    base = jobs.client.api.create_container(IMAGE, ["true"])
    exported = io.BytesIO(b"".join(jobs.client.api.export(base["Id"])))
    jobs.client.api.remove_container(base["Id"], force=True)
    rewritten = io.BytesIO()
    with tarfile.open(fileobj=exported) as source, tarfile.open(fileobj=rewritten, mode="w") as out:
        for member in source:
            if member.name.rstrip("/") in ("tmp", "./tmp"):
                member.mode = 0o755
            out.addfile(member, source.extractfile(member) if member.isfile() else None)
        data = tarfile.TarInfo("data")
        data.type, data.mode = tarfile.DIRTYPE, 0o755
        out.addfile(data)
    image = f"gpumesh-test/tmp0755:{uuid.uuid4().hex[:8]}"
    repository, tag = image.split(":")
    jobs.client.api.import_image_from_data(
        rewritten.getvalue(), repository=repository, tag=tag, changes=["VOLUME /data"]
    )
    try:
        yield image
    finally:
        assert _remove_labelled(jobs.client, jobs.node_id) == []
        jobs.client.api.remove_image(image)


def test_a_job_writes_tmp_and_volumes_on_an_image_whose_tmp_is_0755_root(
    jobs: Jobs, tmp_0755_image: str
) -> None:
    """Docker gives a tmpfs the image's directory mode: before, the job's user got
    "Permission denied" writing /tmp on such an image."""
    script = "echo x > /tmp/f && echo tmp=ok; echo x > /data/f && echo data=ok"
    container_id, state = jobs.run(["sh", "-c", script], image=tmp_0755_image, user=JOB_USER)
    assert state.exit_code == 0, jobs.output(container_id, "stderr")
    assert jobs.output(container_id, "stdout").decode().split() == ["tmp=ok", "data=ok"]


def test_home_owned_by_the_user_and_set_unless_the_job_sets_it(jobs: Jobs) -> None:
    script = 'echo "$HOME"; ls -ldn /home/gpumesh'
    container_id, _ = jobs.run(["sh", "-c", script], user="1234:5678")
    out = jobs.output(container_id, "stdout").decode().split()
    assert out[0] == "/home/gpumesh"
    assert out[1] == "drwx------" and out[3:5] == ["1234", "5678"]
    container_id, _ = jobs.run(["sh", "-c", 'echo "$HOME"'], env={"HOME": "/tmp"}, home="/job")
    assert jobs.output(container_id, "stdout") == b"/tmp\n"
    # Without a user (the image's own), the home is world-writable: its owner is not known.
    container_id, _ = jobs.run(["sh", "-c", 'ls -ld "$HOME" | cut -c1-10'], home="/job")
    assert jobs.output(container_id, "stdout") == b"drwxrwxrwt\n"


def test_tmpfs_mounts_are_exec_nosuid_nodev(jobs: Jobs) -> None:
    container_id, state = jobs.run(
        ["sh", "-c", "grep -E ' (/tmp|/home/gpumesh) ' /proc/mounts"], user=JOB_USER
    )
    assert state.exit_code == 0
    for line in jobs.output(container_id, "stdout").decode().splitlines():
        options = line.split()[3].split(",")
        assert line.split()[2] == "tmpfs"
        assert {"rw", "nosuid", "nodev"} <= set(options)
        assert "noexec" not in options
        assert f"size={1024 * 1024}k" in options  # 1 GiB by default


def test_programs_run_from_tmp_and_home(jobs: Jobs) -> None:
    script = (
        "cp /bin/busybox /tmp/busybox && /tmp/busybox echo from-tmp && "
        'mkdir -p "$HOME/.cache/bin" && cp /bin/busybox "$HOME/.cache/bin/busybox" && '
        '"$HOME/.cache/bin/busybox" echo from-home'
    )
    container_id, state = jobs.run(["sh", "-c", script], user=JOB_USER, tmp_size=16 * MiB)
    assert state.exit_code == 0, jobs.output(container_id, "stderr")
    assert jobs.output(container_id, "stdout") == b"from-tmp\nfrom-home\n"


def test_tmp_and_home_are_bounded(jobs: Jobs) -> None:
    script = (
        "dd if=/dev/zero of=/tmp/fill bs=1M count=8 2>&1; echo tmp=$?; "
        'dd if=/dev/zero of="$HOME/fill" bs=1M count=8 2>&1; echo home=$?'
    )
    container_id, state = jobs.run(["sh", "-c", script], user=JOB_USER, tmp_size=4 * MiB)
    assert state.exit_code == 0
    out = jobs.output(container_id, "stdout").decode()
    assert out.count("No space left on device") == 2, out
    assert "tmp=1" in out and "home=1" in out
    assert not state.oom_killed


def test_shm_has_the_given_size_within_memory(jobs: Jobs) -> None:
    script = "grep ' /dev/shm ' /proc/mounts"
    container_id, _ = jobs.run(["sh", "-c", script], shm_size=32 * MiB, memory=64 * MiB)
    assert "size=32768k" in jobs.output(container_id, "stdout").decode()
    assert jobs.runtime.host_config(container_id)["ShmSize"] == 32 * MiB
    # More than the memory limit: clamped to it (tmpfs pages count against it anyway).
    container_id, _ = jobs.run(["sh", "-c", script], shm_size=4096 * MiB, memory=64 * MiB)
    assert "size=65536k" in jobs.output(container_id, "stdout").decode()


def test_writable_root_only_when_allowed(jobs: Jobs) -> None:
    storage = 512 * MiB
    container_id, state = jobs.run(
        ["sh", "-c", "touch /allowed && echo ok"], writable_root=True, storage_size=storage
    )
    assert state.exit_code == 0 and jobs.output(container_id, "stdout") == b"ok\n"
    host = jobs.runtime.host_config(container_id)
    assert host["ReadonlyRootfs"] is False
    if jobs.runtime.isolation(IMAGE).storage_size:
        assert host["StorageOpt"] == {"size": str(storage)}
    else:
        assert not host.get("StorageOpt")  # not supported here: created without it


def test_storage_size_reaches_the_engine(jobs: Jobs) -> None:
    runtime = DockerRuntime(jobs.client)
    supported = runtime.isolation(IMAGE).storage_size
    runtime._storage_size = True  # as if the probe had said yes
    spec = jobs.spec(["true"], writable_root=True, storage_size=512 * MiB)
    if supported:
        container_id = runtime.create(spec)
        assert runtime.host_config(container_id)["StorageOpt"] == {"size": str(512 * MiB)}
    else:
        # The engine refuses the option it was given (on ext4: overlay needs xfs with pquota).
        with pytest.raises(AgentError, match="storage-opt"):
            runtime.create(spec)
    # Without writable_root, no size is asked for: the root is read-only anyway.
    container_id = runtime.create(jobs.spec(["true"], storage_size=512 * MiB))
    assert not runtime.host_config(container_id).get("StorageOpt")


@pytest.mark.parametrize(
    "fields",
    [
        {"user": "root"},
        {"user": "1000"},
        {"home": "relative"},
        {"home": "/"},
        {"home": "/tmp"},
        {"home": "/workspace"},
        {"home": "/proc/x"},
        {"home": "/home/../etc"},
        {"tmp_size": 0},
        {"shm_size": -1},
        {"storage_size": -1},
    ],
    ids=str,
)
def test_create_refuses_a_bad_lockdown(jobs: Jobs, fields: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        jobs.create(["true"], **fields)
    assert jobs.leftovers() == []


# --- what an image may not bring ------------------------------------------------------------


@pytest.fixture
def forged_image(jobs: Jobs) -> Iterator[str]:
    """A busybox image that forges our labels, asks for every driver capability,
    declares a VOLUME and runs as its own user."""
    base = jobs.client.api.create_container(IMAGE, ["true"])
    data = b"".join(jobs.client.api.export(base["Id"]))
    jobs.client.api.remove_container(base["Id"], force=True)
    image = f"gpumesh-test/forged:{uuid.uuid4().hex[:8]}"
    repository, tag = image.split(":")
    changes = [
        "LABEL io.gpumesh.job=forged",
        "LABEL io.gpumesh.kind=exec",
        "LABEL other=x",
        "ENV NVIDIA_DRIVER_CAPABILITIES=all",
        "ENV NVIDIA_REQUIRE_CUDA=cuda>=99",
        "ENV HOME=/root",
        "ENV PATH=/bin",
        "VOLUME /data",
        "USER 65534:65534",
        'CMD ["/bin/sh"]',
    ]
    jobs.client.api.import_image_from_data(data, repository=repository, tag=tag, changes=changes)
    try:
        yield image
    finally:
        assert _remove_labelled(jobs.client, jobs.node_id) == []
        jobs.client.api.remove_image(image)


def _volumes(client: Any) -> set[str]:
    return {volume["Name"] for volume in client.api.volumes().get("Volumes") or []}


def test_image_labels_env_and_volumes_do_not_reach_a_job(jobs: Jobs, forged_image: str) -> None:
    config = jobs.client.api.inspect_image(forged_image)["Config"]
    assert config["Labels"]["io.gpumesh.job"] == "forged" and "/data" in config["Volumes"]
    volumes = _volumes(jobs.client)
    script = "id -u; env; grep ' /data ' /proc/mounts; echo x > /data/f && echo data=ok"
    container_id = jobs.create(["sh", "-c", script], image=forged_image, user=JOB_USER)
    attrs = jobs.client.api.inspect_container(container_id)
    labels = attrs["Config"]["Labels"]
    assert labels["io.gpumesh.job"] != "forged"
    assert labels["io.gpumesh.kind"] == ""
    assert labels["other"] == ""
    assert not [mount for mount in attrs["Mounts"] if mount["Type"] == "volume"]
    assert _volumes(jobs.client) == volumes  # no anonymous volume was made
    jobs.runtime.start(container_id)
    state = jobs.runtime.wait(container_id)
    assert state.exit_code == 0, jobs.output(container_id, "stderr")
    # An empty label is an overridden one: as good as absent.
    assert "other" not in state.labels and LABEL_KIND not in state.labels
    assert state.labels[LABEL_JOB] == labels[LABEL_JOB]
    out = jobs.output(container_id, "stdout").decode().splitlines()
    assert out[0] == "47000"
    assert "NVIDIA_DRIVER_CAPABILITIES=" in out
    assert "NVIDIA_REQUIRE_CUDA=" in out
    assert "NVIDIA_VISIBLE_DEVICES=void" in out
    assert "HOME=/home/gpumesh" in out
    assert not [line for line in out if line.endswith(("=all", "cuda>=99", "=/root"))]
    assert [line.split()[2] for line in out if " /data " in line] == ["tmpfs"]
    assert out[-1] == "data=ok"
    # The job's own NVIDIA_* (other than what the provider sets) stay as given.
    container_id = jobs.create(["true"], image=forged_image, env={"NVIDIA_MIG_CONFIG": "k"})
    assert "NVIDIA_MIG_CONFIG=k" in jobs.config_env(container_id)


def test_image_labels_do_not_reach_a_shell(jobs: Jobs, forged_image: str) -> None:
    spec = dataclasses.replace(
        jobs.spec([], image=forged_image),
        labels={LABEL_PEER: "peer-under-test", LABEL_NODE: jobs.node_id, LABEL_KIND: "exec"},
    )
    volumes = _volumes(jobs.client)
    container_id = jobs.runtime.create_interactive(spec, tty=False)
    attrs = jobs.client.api.inspect_container(container_id)
    assert attrs["Config"]["Labels"]["io.gpumesh.job"] == ""
    assert attrs["Config"]["Labels"]["other"] == ""
    assert attrs["HostConfig"]["ReadonlyRootfs"] is True
    assert "/data" in attrs["HostConfig"]["Tmpfs"]
    assert not [mount for mount in attrs["Mounts"] if mount["Type"] == "volume"]
    assert _volumes(jobs.client) == volumes
    env = attrs["Config"]["Env"]
    assert "NVIDIA_DRIVER_CAPABILITIES=" in env and "NVIDIA_REQUIRE_CUDA=" in env
    # A job service sweeping this node's containers sees a shell, not job "forged".
    (listed,) = jobs.runtime.list_jobs(jobs.node_id)
    assert LABEL_JOB not in listed.labels
    assert listed.labels[LABEL_KIND] == "exec"


def test_gpu_containers_get_compute_and_utility_only(jobs: Jobs, forged_image: str) -> None:
    # Create only: this engine may have no NVIDIA runtime to start it with.
    container_id = jobs.create(["true"], image=forged_image, gpu_ids=["0"])
    env = jobs.config_env(container_id)
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    assert "NVIDIA_VISIBLE_DEVICES=0" in env
    assert "NVIDIA_DRIVER_CAPABILITIES=all" not in env


def test_a_container_is_created_from_the_image_id_inspected(jobs: Jobs) -> None:
    # By id, not by name: what was overridden was read from exactly that image.
    # The name the job gave stays readable (a label), as the log messages use it.
    runtime = DockerRuntime(jobs.client)
    image_id = jobs.client.api.inspect_image(IMAGE)["Id"]
    container_id = runtime.create(jobs.spec(["true"]))
    attrs = jobs.client.api.inspect_container(container_id)
    assert attrs["Image"] == image_id and attrs["Config"]["Image"] == image_id
    assert attrs["Config"]["Labels"][LABEL_IMAGE] == IMAGE
    assert runtime.inspect(container_id).image == IMAGE


def test_a_tag_moved_after_the_image_check_runs_the_image_checked(
    jobs: Jobs, forged_image: str
) -> None:
    # The container is made right after ensure_image, from its inspection of the
    # image: a tag moved in between (here, for real, onto the forged image) must
    # not let the other image's labels, env and volumes through. The container is
    # made from the image checked (by its id), with that image's overrides.
    moving = f"gpumesh-test/moving:{uuid.uuid4().hex[:8]}"
    repository, tag = moving.split(":")
    jobs.client.api.tag(IMAGE, repository, tag)
    try:
        runtime = DockerRuntime(jobs.client)
        checked = jobs.client.api.inspect_image(moving)["Id"]
        assert runtime.ensure_image(moving) is False
        jobs.client.api.tag(forged_image, repository, tag, force=True)
        container_id = runtime.create(jobs.spec(["true"], image=moving))
        attrs = jobs.client.api.inspect_container(container_id)
        assert attrs["Image"] == checked
        labels = attrs["Config"]["Labels"]
        assert "other" not in labels and labels[LABEL_JOB] != "forged"
        # Checked again, the image is what the tag names now, with our overrides.
        assert runtime.ensure_image(moving) is False
        container_id = runtime.create(jobs.spec(["true"], image=moving))
        attrs = jobs.client.api.inspect_container(container_id)
        assert attrs["Image"] == jobs.client.api.inspect_image(forged_image)["Id"]
        labels = attrs["Config"]["Labels"]
        assert labels["other"] == "" and labels[LABEL_JOB] != "forged"
        assert labels[LABEL_IMAGE] == moving
    finally:
        jobs.client.api.remove_image(moving)


# --- pip install --user under the lockdown --------------------------------------------------

PYTHON_IMAGE = os.environ.get("GPUMESH_TEST_PYTHON_IMAGE", "gpumesh-test/python:1")
_BUILDER = Path(__file__).resolve().parents[2] / "scripts" / "build-python-image.sh"

# A PEP 517 backend in the package itself: pip builds it with no index and no setuptools.
_BACKEND = """
import base64, hashlib, os, zipfile

NAME, VERSION = "gpumesh_tiny", "1.0"


def _line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    dist = f"{NAME}-{VERSION}.dist-info"
    files = {
        f"{NAME}/__init__.py": b"MESSAGE = 'tiny works'\\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: 1.0\\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    }
    record = [_line(name, data) for name, data in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\\n".join(record) + "\\n").encode()
    wheel = f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel
"""
_PYPROJECT = """
[build-system]
requires = []
build-backend = "backend"
backend-path = ["."]
"""


@pytest.fixture
def python_image(runtime_engine: Any) -> str:
    """Python with pip, built offline from this machine's interpreter once per machine."""
    with contextlib.suppress(docker.errors.ImageNotFound):
        runtime_engine.api.inspect_image(PYTHON_IMAGE)
        return PYTHON_IMAGE
    built = subprocess.run(
        ["bash", str(_BUILDER), PYTHON_IMAGE],
        env=dict(os.environ, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    return PYTHON_IMAGE


def test_pip_install_user_on_a_read_only_root(jobs: Jobs, workdir: Path, python_image: str) -> None:
    package = workdir / "pkg"
    package.mkdir()
    (package / "pyproject.toml").write_text(_PYPROJECT)
    (package / "backend.py").write_text(_BACKEND)
    script = (
        "python3 -m pip install --user --no-index --disable-pip-version-check ./pkg "
        "&& cd / && python3 -c 'import gpumesh_tiny as t; print(t.MESSAGE, t.__file__)'"
    )
    container_id, state = jobs.run(
        ["sh", "-c", script],
        image=python_image,
        user=JOB_USER,
        workdir=str(workdir),
        memory=512 * MiB,
        tmp_size=256 * MiB,
    )
    out = jobs.output(container_id, "stdout").decode()
    assert state.exit_code == 0, (out, jobs.output(container_id, "stderr"))
    site = "/home/gpumesh/.local/lib/python3."
    assert out.splitlines()[-1].startswith(f"tiny works {site}"), out
    assert jobs.runtime.host_config(container_id)["ReadonlyRootfs"] is True


# --- the engine's isolation ---------------------------------------------------------------


def _probes(client: Any) -> list[dict[str, Any]]:
    return list(client.api.containers(all=True, filters={"name": "gpumesh-probe-"}))


def test_isolation_of_this_engine(jobs: Jobs) -> None:
    info = jobs.client.api.info()
    options = " ".join(info.get("SecurityOptions") or [])
    runtime = DockerRuntime(jobs.client)
    without_image = runtime.isolation()
    assert without_image.storage_size is False  # nothing to probe with
    assert without_image.userns_remap == ("name=userns" in options)
    assert without_image.rootless == ("name=rootless" in options)
    if not without_image.userns_remap:
        assert without_image.remapped_root is None
    probes = 0
    probe = runtime._probe_storage_size

    def counted(image: str) -> bool | None:
        nonlocal probes
        probes += 1
        return probe(image)

    runtime._probe_storage_size = counted  # type: ignore[method-assign]
    missing = f"gpumesh-test/no-such-image-{uuid.uuid4().hex[:8]}:1"
    assert runtime.isolation(missing).storage_size is False  # cannot tell: asked again later
    isolation = runtime.isolation(IMAGE)
    assert runtime.isolation(IMAGE) == isolation
    assert probes == 2  # the missing image, then once for good
    backing = dict(info.get("DriverStatus") or []).get("Backing Filesystem")
    if info.get("Driver") == "overlay2" and backing == "extfs":
        assert isolation.storage_size is False
    assert _probes(jobs.client) == []  # the probe left nothing behind


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        (
            {"SecurityOptions": ["name=seccomp,profile=default"], "DockerRootDir": "/d"},
            EngineIsolation(False, False, None, False),
        ),
        (
            {
                "SecurityOptions": ["name=seccomp,profile=default", "name=userns"],
                "DockerRootDir": "/var/lib/docker/100000.100000",
            },
            EngineIsolation(True, False, (100000, 100000), False),
        ),
        (
            {"SecurityOptions": ["name=userns"], "DockerRootDir": "/srv/docker/231072.231073/"},
            EngineIsolation(True, False, (231072, 231073), False),
        ),
        (
            {"SecurityOptions": ["name=userns"], "DockerRootDir": "/srv/100000.100000/docker"},
            EngineIsolation(True, False, None, False),
        ),
        (
            {
                "SecurityOptions": ["name=seccomp,profile=default", "name=rootless"],
                "DockerRootDir": "/home/u/.local/share/docker",
            },
            EngineIsolation(False, True, None, False),
        ),
        ({}, EngineIsolation(False, False, None, False)),
    ],
)
def test_engine_isolation_from_docker_info(info: dict[str, Any], expected: EngineIsolation) -> None:
    assert _engine_isolation(info) == expected


# --- start failures, limits, stop -------------------------------------------------------


@pytest.mark.parametrize("init", [True, False], ids=["init", "no-init"])
def test_missing_command_exits_127(jobs: Jobs, init: bool) -> None:
    runtime = DockerRuntime(jobs.client, init=init)
    container_id = runtime.create(jobs.spec(["nosuchcmd"]))
    runtime.start(container_id)  # like `docker run`: no error here
    state = runtime.wait(container_id)
    assert state.status == "exited"
    assert state.exit_code == 127
    if init:
        # tini's own line ("[FATAL tini (7)] exec nosuchcmd failed: ...") in our words.
        said = DockerRuntime(jobs.client, init=True).job_logs(
            container_id, {"stderr": LogCursor()}, False
        )
        assert b"".join(line.data for line in said) == (
            f"gpumesh: nosuchcmd: not found in image {IMAGE} (exit 127)\n".encode()
        )
    else:
        assert "executable file not found" in state.error
        assert runtime.inspect(container_id).exit_code == 127


@pytest.mark.parametrize("init", [True, False], ids=["init", "no-init"])
def test_non_executable_command_exits_126(jobs: Jobs, workdir: Path, init: bool) -> None:
    script = workdir / "job.sh"
    script.write_text("#!/bin/sh\necho never\n")
    script.chmod(0o644)
    runtime = DockerRuntime(jobs.client, init=init)
    container_id = runtime.create(jobs.spec(["/workspace/job.sh"], workdir=str(workdir)))
    runtime.start(container_id)
    state = runtime.wait(container_id)
    assert (state.status, state.exit_code) == ("exited", 126)
    if init:
        said = runtime.job_logs(container_id, {"stderr": LogCursor()}, False)
        assert b"".join(line.data for line in said) == (
            f"gpumesh: /workspace/job.sh: not executable in image {IMAGE} (exit 126)\n".encode()
        )
    else:
        assert "permission denied" in state.error


def test_memory_limit_kills_with_137_and_oom_flag(jobs: Jobs) -> None:
    # tail keeps a newline-free input in memory until it is killed.
    _, state = jobs.run(["sh", "-c", "head -c 300m /dev/zero | tail"], memory=32 * MiB)
    assert state.exit_code == 137
    assert state.oom_killed


def test_stop_is_prompt_and_idempotent(jobs: Jobs) -> None:
    container_id = jobs.started(["sleep", "100"])
    assert jobs.runtime.inspect(container_id).status == "running"
    began = time.monotonic()
    jobs.runtime.stop(container_id, timeout=60)
    # init passed SIGTERM on: far less than the 60 s wait for SIGKILL (generous for CI)
    assert time.monotonic() - began < 30
    state = jobs.runtime.wait(container_id)
    assert state.status == "exited"
    assert state.exit_code == 143  # 128 + SIGTERM
    jobs.runtime.stop(container_id)
    jobs.runtime.remove(container_id)
    jobs.runtime.remove(container_id)
    jobs.runtime.stop(container_id)
    with pytest.raises(NotFoundError):
        jobs.runtime.inspect(container_id)


def test_unknown_container_is_not_found(jobs: Jobs) -> None:
    unknown = "gpumesh-test-" + uuid.uuid4().hex
    for call in (
        jobs.runtime.inspect,
        jobs.runtime.wait,
        jobs.runtime.start,
        jobs.runtime.host_config,
    ):
        with pytest.raises(NotFoundError, match="no container"):
            call(unknown)
    with pytest.raises(NotFoundError):
        jobs.runtime.job_logs(unknown, {"stdout": LogCursor()}, True)


def test_list_jobs_filters_by_node(jobs: Jobs) -> None:
    other = Jobs(jobs.runtime, jobs.client, f"{jobs.node_id}-other")
    try:
        mine = {jobs.create(["true"]), jobs.started(["true"])}
        theirs = other.create(["true"])
        listed = jobs.runtime.list_jobs(jobs.node_id)
        assert {state.container_id for state in listed} == mine
        assert all(state.labels[LABEL_NODE] == jobs.node_id for state in listed)
        assert [state.container_id for state in jobs.runtime.list_jobs(other.node_id)] == [theirs]
        assert jobs.runtime.list_jobs(f"{jobs.node_id}-nobody") == []
    finally:
        assert _remove_labelled(jobs.client, other.node_id) == []


# --- logs -------------------------------------------------------------------------------


def _count_to(n: int, stream: str = "") -> str:
    redirect = " >&2" if stream == "stderr" else ""
    return f"i=1; while [ $i -le {n} ]; do echo line$i{redirect}; i=$((i+1)); done"


def test_log_resume_after_exit_returns_exactly_the_rest(jobs: Jobs) -> None:
    script = f"{_count_to(300)}; {_count_to(50, 'stderr')}"
    container_id, _ = jobs.run(["sh", "-c", script])
    lines = jobs.lines(container_id, "stdout")
    assert [line.data for line in lines] == [f"line{i}\n".encode() for i in range(1, 301)]
    for cut in (0, 1, 150, 298):
        rest = jobs.lines(container_id, "stdout", lines[cut].cursor)
        assert [line.data for line in rest] == [line.data for line in lines[cut + 1 :]]
        assert [line.cursor for line in rest] == [line.cursor for line in lines[cut + 1 :]]
    assert jobs.lines(container_id, "stdout", lines[-1].cursor) == []
    # Following an exited container from a cursor ends by itself too.
    followed = list(jobs.runtime.job_logs(container_id, {"stdout": lines[296].cursor}, True))
    assert [line.data for line in followed] == [b"line298\n", b"line299\n", b"line300\n"]
    errors = jobs.lines(container_id, "stderr")
    assert [line.data for line in errors] == [f"line{i}\n".encode() for i in range(1, 51)]
    assert {line.stream for line in errors} == {"stderr"}


def test_log_entries_of_one_instant_resume_by_count(jobs: Jobs) -> None:
    # Docker cuts a line longer than 16 KiB into pieces that share one timestamp.
    script = "head -c 40000 /dev/zero | tr '\\0' x; echo; echo after"
    container_id, _ = jobs.run(["sh", "-c", script])
    lines = jobs.lines(container_id, "stdout")
    assert b"".join(line.data for line in lines) == b"x" * 40000 + b"\n" + b"after\n"
    pieces = [line for line in lines if line.data.startswith(b"x")]
    assert len(pieces) >= 2
    assert len({line.cursor.timestamp for line in pieces}) == 1
    assert [line.cursor.count for line in pieces] == list(range(1, len(pieces) + 1))
    for cut in range(len(lines)):
        rest = jobs.lines(container_id, "stdout", lines[cut].cursor)
        assert rest == lines[cut + 1 :]


def test_log_cursor_counts_entries_of_one_timestamp() -> None:
    # Entries sharing a timestamp down to the nanosecond are rare on a real
    # engine, so the counting is also checked on frames made up here.
    stamps = ["2026-01-02T03:04:05.000000001Z"] * 2 + ["2026-01-02T03:04:05.100000000Z"] * 4
    stamps += ["2026-01-02T03:04:06.000000000Z"]
    frames = [f"{stamp} e{i}\n".encode() for i, stamp in enumerate(stamps)]

    def read(cursor: LogCursor) -> list[LogLine]:
        after = _timestamp_key(cursor.timestamp) if cursor.timestamp else None
        reader = _EntryReader("stdout", after, cursor.count)
        return [line for frame in frames if (line := reader.entry(frame)) is not None]

    everything = read(LogCursor())
    assert [line.data for line in everything] == [f"e{i}\n".encode() for i in range(7)]
    assert [line.cursor.count for line in everything] == [1, 2, 1, 2, 3, 4, 1]
    for cut, line in enumerate(everything):
        assert read(line.cursor) == everything[cut + 1 :]


def test_follow_delivers_a_line_while_the_job_runs(jobs: Jobs) -> None:
    container_id = jobs.started(["sh", "-c", "echo first; sleep 2; echo second"])
    seen: list[tuple[bytes, str]] = []
    for line in jobs.runtime.job_logs(container_id, {"stdout": LogCursor()}, True):
        seen.append((line.data, jobs.runtime.inspect(container_id).status))
    assert seen[0] == (b"first\n", "running")
    assert [data for data, _ in seen] == [b"first\n", b"second\n"]
    assert jobs.runtime.inspect(container_id).status == "exited"


def test_follow_delivers_a_long_unfinished_line_in_pieces(jobs: Jobs) -> None:
    # Docker holds a line back until its newline, 16 KiB, or the end; the
    # runtime passes each piece on as soon as Docker has it.
    script = "head -c 20000 /dev/zero | tr '\\0' y; sleep 2; echo"
    container_id = jobs.started(["sh", "-c", script])
    lines = iter(jobs.runtime.job_logs(container_id, {"stdout": LogCursor()}, True))
    first = next(lines)
    assert first.data == b"y" * 16384
    assert jobs.runtime.inspect(container_id).status == "running"
    rest = b"".join(line.data for line in lines)
    assert first.data + rest == b"y" * 20000 + b"\n"


def test_follow_keeps_the_last_output_without_newline(jobs: Jobs) -> None:
    # Docker's follow stream sometimes ends before such a last entry.
    containers = [jobs.started(["sh", "-c", "echo one; sleep 0.3; printf last"]) for _ in range(6)]
    for container_id in containers:
        followed = list(jobs.runtime.job_logs(container_id, {"stdout": LogCursor()}, True))
        assert [line.data for line in followed] == [b"one\n", b"last"]


def test_follow_woken_by_the_wait_still_reads_the_last_lines(jobs: Jobs) -> None:
    # A job that prints until the moment it exits: the wait that sees it stop
    # cuts the readers' pause short, and what it printed last must still come,
    # once, in order, on both streams.
    script = f"{_count_to(2000)}; {_count_to(2000, 'stderr')}; echo end; echo end >&2"
    for _ in range(3):
        container_id = jobs.started(["sh", "-c", script])
        out: list[bytes] = []
        err: list[bytes] = []
        readers = [
            threading.Thread(target=_collect, args=(jobs, container_id, "stdout", out)),
            threading.Thread(target=_collect, args=(jobs, container_id, "stderr", err)),
        ]
        for reader in readers:
            reader.start()
        assert jobs.runtime.wait(container_id).exit_code == 0
        for reader in readers:
            reader.join(60)
        expected = b"".join(f"line{i}\n".encode() for i in range(1, 2001)) + b"end\n"
        assert b"".join(out) == expected
        assert b"".join(err) == expected


def test_jobs_from_many_threads_at_once(jobs: Jobs) -> None:
    results: dict[int, tuple[int | None, bytes, bytes]] = {}
    failures: list[BaseException] = []

    def job(n: int) -> None:
        try:
            script = f"{_count_to(20)}; echo err{n} >&2; sleep 0.5; exit {n}"
            container_id = jobs.started(["sh", "-c", script])
            out: list[bytes] = []
            err: list[bytes] = []
            readers = [
                threading.Thread(target=_collect, args=(jobs, container_id, "stdout", out)),
                threading.Thread(target=_collect, args=(jobs, container_id, "stderr", err)),
            ]
            for reader in readers:
                reader.start()
            state = jobs.runtime.wait(container_id)
            for reader in readers:
                reader.join(30)
            results[n] = (state.exit_code, b"".join(out), b"".join(err))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=job, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    expected_out = b"".join(f"line{i}\n".encode() for i in range(1, 21))
    assert results == {n: (n, expected_out, f"err{n}\n".encode()) for n in range(8)}


def _collect(jobs: Jobs, container_id: str, stream: Stream, into: list[bytes]) -> None:
    into.extend(
        line.data for line in jobs.runtime.job_logs(container_id, {stream: LogCursor()}, True)
    )


def _interleaved(jobs: Jobs, container_id: str, cursors: dict[Stream, LogCursor]) -> list[LogLine]:
    return list(jobs.runtime.job_logs(container_id, dict(cursors), False))


def test_both_streams_read_together_resume_each_from_its_own_cursor(jobs: Jobs) -> None:
    # One read for both streams (the agent's reader): each stream keeps its own
    # order and cursors, and resuming from any pair of cursors, whichever stream
    # is ahead, or one stream with no cursor yet, gives exactly the rest of each.
    script = "i=1; while [ $i -le 40 ]; do echo out$i; echo err$i >&2; i=$((i+1)); done"
    container_id, _ = jobs.run(["sh", "-c", script])
    both = _interleaved(jobs, container_id, {"stdout": LogCursor(), "stderr": LogCursor()})
    out = [line for line in both if line.stream == "stdout"]
    err = [line for line in both if line.stream == "stderr"]
    assert [line.data for line in out] == [f"out{i}\n".encode() for i in range(1, 41)]
    assert [line.data for line in err] == [f"err{i}\n".encode() for i in range(1, 41)]
    assert out == jobs.lines(container_id, "stdout")
    assert err == jobs.lines(container_id, "stderr")
    assert not any(line.lost for line in both)
    cuts = [(0, 30), (30, 0), (12, 13), (39, 39)]
    for a, b in cuts:
        rest = _interleaved(jobs, container_id, {"stdout": out[a].cursor, "stderr": err[b].cursor})
        assert [line for line in rest if line.stream == "stdout"] == out[a + 1 :]
        assert [line for line in rest if line.stream == "stderr"] == err[b + 1 :]
        assert not any(line.lost for line in rest)
    for cut in (0, 25):
        rest = _interleaved(jobs, container_id, {"stdout": out[cut].cursor, "stderr": LogCursor()})
        assert [line for line in rest if line.stream == "stdout"] == out[cut + 1 :]
        assert [line for line in rest if line.stream == "stderr"] == err
        assert not any(line.lost for line in rest)


def test_both_streams_followed_together_until_the_end(jobs: Jobs) -> None:
    # Followed as the agent does, from a start where only stdout has a cursor
    # (the stderr entries its followed wait brings are taken by the next read).
    script = "echo first; sleep 1; echo late >&2; sleep 0.5; echo last"
    container_id = jobs.started(["sh", "-c", script])
    first = next(iter(jobs.runtime.job_logs(container_id, {"stdout": LogCursor()}, True)))
    assert first.data == b"first\n"
    lines = list(
        jobs.runtime.job_logs(container_id, {"stdout": first.cursor, "stderr": LogCursor()}, True)
    )
    # (Per stream: the order between the streams is not kept.)
    assert [line.data for line in lines if line.stream == "stdout"] == [b"last\n"]
    assert [line.data for line in lines if line.stream == "stderr"] == [b"late\n"]
    assert not any(line.lost for line in lines)


def test_both_streams_followed_from_the_start_each_line_once(jobs: Jobs) -> None:
    # The agent's reader from the start of a job: stdout gets a cursor first, then
    # stderr (reads of both from the log's start while it is small), then many
    # lines of both: every line comes once, in order on its stream.
    script = (
        "echo first; sleep 0.5; echo second >&2; sleep 0.5; "
        f"{_count_to(3000)} & {_count_to(3000, 'stderr')}; wait; echo end; echo end >&2"
    )
    for _ in range(2):
        container_id = jobs.started(["sh", "-c", script])
        cursors: dict[Stream, LogCursor] = {"stdout": LogCursor(), "stderr": LogCursor()}
        lines = list(jobs.runtime.job_logs(container_id, cursors, True))
        numbered = b"".join(f"line{i}\n".encode() for i in range(1, 3001))
        out = b"".join(line.data for line in lines if line.stream == "stdout")
        err = b"".join(line.data for line in lines if line.stream == "stderr")
        assert out == b"first\n" + numbered + b"end\n"
        assert err == b"second\n" + numbered + b"end\n"
        assert not any(line.lost for line in lines)
