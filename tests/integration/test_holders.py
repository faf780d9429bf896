"""Network holders (gpumesh.runtime.holders) on a real Docker engine: what a
holder is, that a container joins one made ready for it and takes it along when
removed, that no two containers share one, that the image is made from nothing,
and that a node's start removes the holders an earlier run left.

The filtering of a container in a holder (the gateway, link-local and private
addresses, other containers, DNS, IPv6) is attacked in test_job_network.py,
whose probes run both on the network and in a holder."""

from __future__ import annotations

import contextlib
import secrets
import uuid
from collections.abc import Iterator

import docker
import docker.errors
import pytest

from gpumesh.runtime.base import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_PEER,
    ContainerSpec,
)
from gpumesh.runtime.docker import DockerRuntime
from gpumesh.runtime.holders import HOLDER_IMAGE, LABEL_HOLDER_OF
from gpumesh.runtime.jobnet import JobNetwork
from tests.integration.conftest import remove_containers
from tests.jobnet_lab import container_address, remove_job_networks

IMAGE = "gpumesh-test/busybox:1"
MiB = 1024 * 1024
WAIT = 60.0


class Lab:
    """One node's containers on a job network of this test's own."""

    def __init__(self) -> None:
        self.node = f"holders-{uuid.uuid4().hex[:8]}"
        self.prefix = f"gpumesh-jobs-t{secrets.token_hex(4)}"
        self.client = docker.from_env()
        self.api = self.client.api
        self.runtime = DockerRuntime(self.client)
        self.network = JobNetwork("internet", prefix=self.prefix, resolvers=())
        self.network.ensure(self.runtime)

    def ready(self) -> bool:
        return self.runtime.prepare(self.network.docker_network, (), self.node, wait=WAIT)

    def started(self, *command: str) -> str:
        job = uuid.uuid4().hex[:10]
        spec = ContainerSpec(
            image=IMAGE,
            command=list(command),
            env={},
            labels={LABEL_JOB: job, LABEL_PEER: "peer", LABEL_NODE: self.node, LABEL_ATTEMPT: "1"},
            name=f"gpumesh-test-{job}",
            memory=64 * MiB,
            pids_limit=64,
            network=self.network.docker_network,
        )
        container_id = self.runtime.create(spec)
        self.runtime.start(container_id)
        return container_id

    def holder_of(self, container_id: str) -> str:
        mode = str(self.api.inspect_container(container_id)["HostConfig"]["NetworkMode"])
        assert mode.startswith("container:"), mode
        return mode.removeprefix("container:")

    def holders(self) -> set[str]:
        found = self.api.containers(all=True, filters={"label": f"{LABEL_HOLDER_OF}={self.node}"})
        return {str(c["Id"]) for c in found}

    def exists(self, container_id: str) -> bool:
        try:
            self.api.inspect_container(container_id)
        except docker.errors.NotFound:
            return False
        return True

    def close(self) -> None:
        remove_containers(self.node)
        self.runtime.close()
        self.client.close()
        remove_job_networks(self.prefix)


@pytest.fixture
def lab(docker_daemon: None) -> Iterator[Lab]:
    made = Lab()
    try:
        yield made
    finally:
        made.close()


def test_a_holder_is_locked_down_and_runs_only_a_program_that_waits(lab: Lab) -> None:
    assert lab.ready()
    holder, _ = lab.runtime._holders.spares()
    attrs = lab.api.inspect_container(holder)
    host, config = attrs["HostConfig"], attrs["Config"]
    assert attrs["State"]["Running"] is True
    assert config["User"] == "65534:65534"
    assert config["Cmd"] == ["/pause"]
    assert config["StopSignal"] == "SIGKILL"
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["ReadonlyRootfs"] is True
    assert host["PidsLimit"] == 4
    assert host["Memory"] == host["MemorySwap"] == 16 * MiB
    assert host["Privileged"] is False
    assert host["NetworkMode"] == lab.network.docker_network
    assert host["Sysctls"] == {"net.ipv6.conf.all.disable_ipv6": "1"}
    # No label a node takes for one of its jobs (it would remove it as an orphan).
    assert LABEL_NODE not in config["Labels"]
    top = lab.api.top(holder)
    assert [row[-1] for row in top["Processes"]] == ["/pause"]


def test_a_container_joins_the_ready_holder_and_takes_it_along_when_removed(lab: Lab) -> None:
    assert lab.ready()
    spare, second = lab.runtime._holders.spares()
    container = lab.started("sleep", "30")
    assert lab.holder_of(container) == spare  # the oldest first
    assert container_address(lab.api, container)  # it has the holder's address
    out = lab.api.exec_create(container, ["sh", "-c", "ip -4 -o addr show eth0"])
    shown = lab.api.exec_start(out["Id"]).decode()
    assert container_address(lab.api, container) in shown, shown
    assert lab.ready()  # a new spare, made after the take
    spares = lab.runtime._holders.spares()
    assert len(spares) == 2 and spares[0] == second and spare not in spares
    lab.runtime.remove(container)
    assert not lab.exists(spare)
    assert lab.holders() == set(spares)


def test_no_two_containers_share_a_holder(lab: Lab) -> None:
    holders, addresses = set(), set()
    for _ in range(3):  # the second joins the second spare, the third a new one
        assert lab.ready()
        container = lab.started("sleep", "30")
        holders.add(lab.holder_of(container))
        addresses.add(container_address(lab.api, container))
    assert len(holders) == 3
    assert len(addresses) == 3


def test_a_container_without_a_ready_holder_joins_the_network_itself(lab: Lab) -> None:
    container = lab.started("sleep", "30")  # nothing was made ready first
    mode = lab.api.inspect_container(container)["HostConfig"]["NetworkMode"]
    assert mode == lab.network.docker_network
    assert lab.ready()  # its creation asked for a spare for the next one


def test_the_holder_image_is_made_here_when_missing(lab: Lab) -> None:
    for holder in lab.api.containers(all=True, filters={"ancestor": HOLDER_IMAGE}):
        if holder["Labels"].get(LABEL_HOLDER_OF) == lab.node:
            lab.api.remove_container(holder["Id"], force=True)
    with contextlib.suppress(docker.errors.NotFound):
        # force: other runs' holders may use it; they keep running, untagged.
        lab.api.remove_image(HOLDER_IMAGE, force=True)
    assert lab.ready()
    image = lab.api.inspect_image(HOLDER_IMAGE)
    assert image["Config"]["Cmd"] == ["/pause"]
    assert image["Size"] < 4096  # one program of 129 bytes


def test_a_nodes_start_removes_the_holders_an_earlier_run_left_but_not_one_in_use(
    lab: Lab,
) -> None:
    assert lab.ready()
    container = lab.started("sleep", "30")
    in_use = lab.holder_of(container)
    assert lab.ready()
    left_spares = lab.runtime._holders.spares()
    # The node's process dies without closing its runtime; a new one starts.
    again = DockerRuntime(lab.client)
    try:
        (found,) = again.list_jobs(lab.node)
        assert found.container_id == container
        again.prepare(lab.network.docker_network, (), lab.node)  # its own, on the way
        again.sweep_holders(lab.node)
        assert not any(lab.exists(spare) for spare in left_spares)
        assert lab.exists(in_use)
        # The new run's own spare, made or being made while it swept, stays.
        assert again.prepare(lab.network.docker_network, (), lab.node, wait=WAIT)
        own = again._holders.spares()
        assert len(own) == 2 and all(lab.exists(spare) for spare in own)
        again.remove(container)  # the holder it joined goes with it
        assert not lab.exists(in_use)
    finally:
        again.close()
    assert not any(lab.exists(spare) for spare in own)  # a closing runtime removes its spares
    assert lab.holders() == set()
