"""The job networks tests make, named apart from a real share's and removed after.

Every test process's agents make their job networks under their own prefix
(``GPUMESH_TEST_JOB_NETWORK``), so tests never touch the machine's real
``gpumesh-jobs-*`` networks and rules, nor each other's; :func:`remove_job_networks`
takes out the networks, chains and jumps a prefix made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from typing import Any

import docker
import docker.errors
import requests.exceptions

from gpumesh.runtime.base import LABEL_KIND
from gpumesh.runtime.holders import KIND_HOLDER
from gpumesh.runtime.jobnet import FILTERED_MODES, names_for

SESSION_PREFIX = f"gpumesh-jobs-t{os.getpid()}"


def network_host_config(api: Any, container_id: str) -> dict[str, Any]:
    """The HostConfig of the container whose network namespace ``container_id``
    lives in: its own, or that of the holder it joined (see
    :mod:`gpumesh.runtime.holders`), which has the network, the name servers
    and the IPv6 switch."""
    host = dict(api.inspect_container(container_id)["HostConfig"])
    mode = str(host.get("NetworkMode") or "")
    if mode.startswith("container:"):
        holder = api.inspect_container(mode.removeprefix("container:"))
        assert holder["Config"]["Labels"].get(LABEL_KIND) == KIND_HOLDER, holder["Name"]
        return dict(holder["HostConfig"])
    return host


def container_address(api: Any, container_id: str) -> str:
    """A running container's address on its network ("" before it has one)."""
    attrs = api.inspect_container(container_id)
    mode = str(attrs["HostConfig"].get("NetworkMode") or "")
    if mode.startswith("container:"):
        attrs = api.inspect_container(mode.removeprefix("container:"))
    for settings in (attrs["NetworkSettings"].get("Networks") or {}).values():
        if settings.get("IPAddress"):
            return str(settings["IPAddress"])
    return ""


def _engine_answers() -> bool:
    """Whether a Docker engine listens on its socket. Asked first because a
    ``docker.from_env()`` that finds none leaves the socket it opened unclosed."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return True  # a TCP engine: let the client find out
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(host.removeprefix("unix://"))
        except OSError:
            return False
    return True


def remove_job_networks(prefix: str) -> None:
    """Remove what :class:`gpumesh.runtime.jobnet.JobNetwork` made under ``prefix``."""

    def iptables(*args: str) -> int:
        if shutil.which("iptables") is None:
            return 1  # nothing was installed without it
        return subprocess.run(["iptables", *args], capture_output=True, check=False).returncode

    engine = _engine_answers()
    for mode in FILTERED_MODES:
        names = names_for(mode, prefix)
        for chain, target in (("DOCKER-USER", names.forward_chain), ("INPUT", names.input_chain)):
            while iptables("-D", chain, "-i", names.bridge, "-j", target) == 0:
                pass
            iptables("-F", target)
            iptables("-X", target)
        if not engine:
            continue  # no engine here: it made no network either
        try:
            client = docker.from_env()
        except docker.errors.DockerException:
            continue  # no engine here: it made no network either
        with (
            contextlib.closing(client),
            contextlib.suppress(
                docker.errors.DockerException, requests.exceptions.RequestException
            ),
        ):
            for network in client.networks.list(names=[names.network]):
                if network.name != names.network:
                    continue
                network.reload()
                for container in network.attrs.get("Containers") or {}:
                    with contextlib.suppress(docker.errors.APIError):
                        attrs = client.api.inspect_container(container)
                        if attrs["Config"]["Labels"].get(LABEL_KIND) == KIND_HOLDER:
                            client.api.remove_container(container, force=True)
                        else:
                            network.disconnect(container, force=True)
                with contextlib.suppress(docker.errors.APIError):
                    network.remove()
