"""``gpumesh doctor``: check everything a node needs and say how to fix it."""

from __future__ import annotations

import datetime
import os
import socket
import stat
from dataclasses import dataclass

from gpumesh.errors import GPUMeshError
from gpumesh.store.home import Home

__all__ = ["Check", "run_checks"]

OK = "ok"
WARN = "warn"
FAIL = "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    """``ok``, ``warn`` or ``fail``."""
    detail: str
    fix: str = ""


def run_checks(home: Home) -> list[Check]:
    checks = [_identity(home)]
    if home.initialized:
        checks += [_config(home), _database(home)]
    checks += [_docker(), _udp_port(home), _clock()]
    return checks


def _identity(home: Home) -> Check:
    if not home.initialized:
        return Check(
            "identity", FAIL, f"no identity in {home.path}", "run `gpumesh init --name NAME`"
        )
    mode = stat.S_IMODE(os.stat(home.key_path).st_mode)
    if mode & 0o077:
        return Check(
            "identity",
            FAIL,
            f"{home.key_path} is readable by others (mode {mode:04o})",
            f"chmod 600 {home.key_path}",
        )
    try:
        node_id = home.identity.node_id
    except GPUMeshError as exc:
        return Check("identity", FAIL, exc.message, "restore the key or run `gpumesh init --force`")
    return Check("identity", OK, f"Ed25519 key, node id {node_id}")


def _config(home: Home) -> Check:
    try:
        config = home.config
    except GPUMeshError as exc:
        return Check("config", FAIL, exc.message, f"fix or delete {home.config_path}")
    if not config.node_name:
        return Check("config", FAIL, "no node_name set", "gpumesh config set node_name NAME")
    return Check("config", OK, f"{home.config_path} (node {config.node_name})")


def _database(home: Home) -> Check:
    try:
        store = home.store
        peers = store.peers()
    except Exception as exc:
        return Check(
            "database", FAIL, f"{home.db_path}: {exc}", "move the file away and pair again"
        )
    return Check("database", OK, f"schema v{store.schema_version}, {len(peers)} peer(s)")


def _docker() -> Check:
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        return Check("docker", FAIL, "the docker Python package is missing", "pip install docker")
    try:
        client = docker.from_env(timeout=3)
        version = client.version()
        client.close()
    except DockerException as exc:
        reason = str(exc).split("(")[0].strip() or type(exc).__name__
        return Check(
            "docker",
            FAIL,
            f"Docker daemon not reachable ({reason[:120]})",
            "install Docker and start it (`sudo systemctl start docker`), or add your user to "
            "the docker group",
        )
    return Check(
        "docker", OK, f"Docker {version.get('Version', '?')} (API {version.get('ApiVersion', '?')})"
    )


def _udp_port(home: Home) -> Check:
    agent = home.read_agent_info() if home.initialized else None
    config = home.config
    if agent is not None:
        return Check(
            "udp port", OK, f"{agent.host}:{agent.port} served by `gpumesh share` (pid {agent.pid})"
        )
    host, port = config.listen_host, config.listen_port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return Check(
                "udp port",
                FAIL,
                f"cannot bind UDP {host}:{port}: {exc.strerror or exc}",
                "stop the program using it or `gpumesh config set listen_port PORT`",
            )
    return Check("udp port", OK, f"UDP {host}:{port} is free for `gpumesh share`")


def _clock() -> Check:
    now = datetime.datetime.now(datetime.UTC)
    if not 2025 <= now.year < 2100:
        return Check(
            "clock",
            FAIL,
            f"system clock reads {now:%Y-%m-%d}",
            "set the clock (enable NTP): pairing codes expire after an hour",
        )
    synced = _ntp_synchronized()
    if synced is False:
        return Check(
            "clock",
            WARN,
            f"{now:%Y-%m-%d %H:%M} UTC, not synchronized",
            "enable NTP (`timedatectl set-ntp true`): pairing codes expire after an hour",
        )
    return Check("clock", OK, f"{now:%Y-%m-%d %H:%M:%S} UTC")


def _ntp_synchronized() -> bool | None:
    import shutil
    import subprocess

    if shutil.which("timedatectl") is None:
        return None
    try:
        out = subprocess.run(
            ["timedatectl", "show", "-p", "NTPSynchronized", "--value"],
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    value = out.stdout.strip()
    return {"yes": True, "no": False}.get(value)
