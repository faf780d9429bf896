"""Every environment variable GPUMesh reads, in one place.

==========================  =================================================
``GPUMESH_HOME``            the node's state folder (default ``~/.gpumesh``)
``GPUMESH_NODE_NAME``       default name for ``gpumesh init``
``GPUMESH_PEER``            default ``--peer`` for commands that take one
``GPUMESH_IMAGE``           default job image (over the config's ``image``)
``GPUMESH_RELAY``           relay ``host[:port]`` (over the config's ``relay``)
``GPUMESH_RELAY_TOKEN``     shared token of a private relay (over ``relay_token``)
``GPUMESH_REGION``          region for public listings (over ``region``)
``GPUMESH_API_TOKEN``       bearer token for the control API
``GPUMESH_API_ADDR``        control API bind address (default 127.0.0.1:8080)
``GPUMESH_API_HOSTS``       names besides loopback that the control API accepts
                            in ``Host`` (comma-separated), e.g. ``gpu-box.lan``
``GPUMESH_NODE``            gone: ``off`` once kept commands in-process; now it
                            only makes a command say so (every command goes
                            through the home's node process)
``GPUMESH_NODE_IDLE``       seconds a background node process stays without a
                            request (default 600)
``GPUMESH_HTTP_DEADLINE``   seconds an HTTP client has to send a whole request
                            once its connection waits for one (default 10)
``GPUMESH_HTTP_CONNECTIONS``  connections an HTTP server holds in all (default 1024)
``GPUMESH_HTTP_PER_CLIENT``  connections one client address holds (default 64)
``GPUMESH_API_BACKOFF``     seconds the control API refuses an address after 5
                            wrong tokens (default 1, doubling to 60)
``GPUMESH_FEC``             parity under QUIC on lossy links: ``off`` (the
                            default: neither sent nor offered), ``auto`` (on
                            long links, else from a link's first loss on) or
                            ``on`` (from the start)
``GPUMESH_LOG``             log level or filter, e.g. ``debug`` or
                            ``gpumesh.transport=debug,info``
``GPUMESH_TEST_PLATFORM``   tests only: ``macos`` or ``windows`` switches off
                            what that OS lacks (:mod:`gpumesh.platform`)
``GPUMESH_TEST_WITHOUT``    tests only: facilities to switch off, e.g.
                            ``gso,gro,unix,termios`` (:mod:`gpumesh.platform`)
``GPUMESH_TEST_PLATFORM_REPORT``  tests only: a file where the fallbacks
                            taken (and Linux-only calls made) are appended
``GPUMESH_TEST_NODE_VERSION``  tests only: the version a node process claims
``GPUMESH_TEST_JOB_NETWORK``  tests only: the name prefix of the job networks
                            made (default ``gpumesh-jobs``), so tests own theirs
``GPUMESH_TEST_SIMULATED_GPU_PROCESSES``  tests only: a file listing processes on
                            the simulated GPUs (``GPUMESH_TEST_SIMULATED_GPUS``,
                            declared in :mod:`gpumesh.gpu.inventory`), one a line:
                            ``INDEX PID NAME [compute|graphics]``; re-read on
                            each look, so a test adds and removes the owner's
                            processes while an agent runs
==========================  =================================================
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "API_ADDR_DEFAULT",
    "ENV_API_ADDR",
    "ENV_API_BACKOFF",
    "ENV_API_HOSTS",
    "ENV_API_TOKEN",
    "ENV_HOME",
    "ENV_HTTP_CONNECTIONS",
    "ENV_HTTP_DEADLINE",
    "ENV_HTTP_PER_CLIENT",
    "ENV_IMAGE",
    "ENV_LOG",
    "ENV_NODE",
    "ENV_NODE_IDLE",
    "ENV_NODE_NAME",
    "ENV_PEER",
    "ENV_REGION",
    "ENV_RELAY",
    "ENV_RELAY_TCP",
    "ENV_RELAY_TOKEN",
    "ENV_TEST_JOB_NETWORK",
    "ENV_TEST_NODE_VERSION",
    "ENV_TEST_PLATFORM",
    "ENV_TEST_PLATFORM_REPORT",
    "ENV_TEST_SIMULATED_GPU_PROCESSES",
    "ENV_TEST_WITHOUT",
    "env",
    "home_dir",
]

ENV_HOME = "GPUMESH_HOME"
ENV_NODE_NAME = "GPUMESH_NODE_NAME"
ENV_PEER = "GPUMESH_PEER"
ENV_IMAGE = "GPUMESH_IMAGE"
ENV_RELAY = "GPUMESH_RELAY"
ENV_RELAY_TOKEN = "GPUMESH_RELAY_TOKEN"
ENV_RELAY_TCP = "GPUMESH_RELAY_TCP"
ENV_REGION = "GPUMESH_REGION"
ENV_API_TOKEN = "GPUMESH_API_TOKEN"
ENV_API_ADDR = "GPUMESH_API_ADDR"
ENV_API_HOSTS = "GPUMESH_API_HOSTS"
ENV_API_BACKOFF = "GPUMESH_API_BACKOFF"
ENV_HTTP_DEADLINE = "GPUMESH_HTTP_DEADLINE"
ENV_HTTP_CONNECTIONS = "GPUMESH_HTTP_CONNECTIONS"
ENV_HTTP_PER_CLIENT = "GPUMESH_HTTP_PER_CLIENT"
ENV_LOG = "GPUMESH_LOG"
ENV_FEC = "GPUMESH_FEC"
ENV_TEST_PLATFORM = "GPUMESH_TEST_PLATFORM"
ENV_NODE = "GPUMESH_NODE"
ENV_NODE_IDLE = "GPUMESH_NODE_IDLE"
ENV_TEST_NODE_VERSION = "GPUMESH_TEST_NODE_VERSION"
ENV_TEST_JOB_NETWORK = "GPUMESH_TEST_JOB_NETWORK"
ENV_TEST_WITHOUT = "GPUMESH_TEST_WITHOUT"
ENV_TEST_PLATFORM_REPORT = "GPUMESH_TEST_PLATFORM_REPORT"
ENV_TEST_SIMULATED_GPU_PROCESSES = "GPUMESH_TEST_SIMULATED_GPU_PROCESSES"

API_ADDR_DEFAULT = "127.0.0.1:8080"


def env(name: str) -> str | None:
    """An environment variable, with empty treated as unset."""
    return os.environ.get(name, "").strip() or None


def home_dir(explicit: str | Path | None = None) -> Path:
    """The node's home: an explicit path, else ``$GPUMESH_HOME``, else ``~/.gpumesh``;
    always absolute (a relative one is taken from the working folder now), so that
    whatever names a folder in it (a job's mounts, given to Docker) is absolute too."""
    if explicit is not None:
        return Path(explicit).expanduser().absolute()
    value = env(ENV_HOME)
    return Path(value).expanduser().absolute() if value else Path.home() / ".gpumesh"
