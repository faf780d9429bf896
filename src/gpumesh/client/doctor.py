"""``gpumesh doctor``: check everything a node needs and say how to fix it."""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import stat
import subprocess
from collections.abc import Callable

from gpumesh import platform
from gpumesh.blocking import run_async
from gpumesh.client.checks import FAIL, OK, WARN, Check
from gpumesh.client.netcheck import describe_inbound, describe_nat, probe_udp
from gpumesh.client.owner import worker_user
from gpumesh.errors import ConfigError, GPUMeshError
from gpumesh.gpu.inventory import detect_inventory
from gpumesh.protocol.addresses import Address
from gpumesh.runtime.base import NO_GPU_RUNTIME, EngineIsolation
from gpumesh.runtime.docker import DockerRuntime
from gpumesh.runtime.jobnet import (
    cannot_filter,
    describe_mode,
    install_problem,
    iptables_installed,
)
from gpumesh.runtime.users import job_identity
from gpumesh.settings import env
from gpumesh.store.config import KEYS
from gpumesh.store.home import Home
from gpumesh.store.limits import ShareLimits, machine_size
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.relayclient import RelayClient
from gpumesh.transport.relaytcp import tcp_route
from gpumesh.transport.session import resolve_relay
from gpumesh.transport.udp import UdpSocket, open_udp_socket
from gpumesh.units import format_size, parse_size

__all__ = ["Check", "run_checks"]


def run_checks(home: Home) -> list[Check]:
    """Every check, each on its own: one that cannot run (a bad setting in the
    environment, say) is a failed check, and the rest still run."""
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("identity", lambda: _identity(home))
    ]
    if home.initialized:
        steps += [
            ("config", lambda: _config(home)),
            ("database", lambda: _database(home)),
            ("home", lambda: _home_modes(home)),
        ]
    if platform.system() == "linux":
        steps += [
            ("docker", lambda: _docker(home)),
            ("gpu", _gpus),
            ("udp port", lambda: _udp_port(home)),
            ("job isolation", lambda: _job_isolation(home)),
            ("job storage", lambda: _job_storage(home)),
            ("job network", lambda: _job_network(home)),
            ("agent user", lambda: _agent_user(home)),
            ("cuda worker", lambda: _cuda_worker(home)),
        ]
    else:
        steps.append(("share", _not_a_provider))
    if home.initialized:
        steps.append(("relay", lambda: _relay(home)))
    steps.append(("clock", _clock))
    checks: list[Check] = []
    for name, step in steps:
        try:
            found = step()
        except GPUMeshError as exc:
            found = Check(name, FAIL, f"could not check: {exc.message}", _fix_for(exc))
        checks += found if isinstance(found, list) else [found]
    return checks


def _fix_for(exc: GPUMeshError) -> str:
    if isinstance(exc, ConfigError):
        return "fix the setting (`gpumesh config show` lists them) and run doctor again"
    return ""


def _identity(home: Home) -> Check:
    if not home.initialized:
        return Check(
            "identity", FAIL, f"no identity in {home.path}", "run `gpumesh init --name NAME`"
        )
    mode = stat.S_IMODE(os.stat(home.key_path).st_mode)
    if mode & 0o077 and platform.has("modes"):  # Windows: the profile's ACL guards it
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
    for key in KEYS.values():
        if key.env and env(key.env):
            try:
                config.get(key.name)
            except ConfigError as exc:
                return Check(
                    "config",
                    FAIL,
                    f"{key.env} in the environment: {exc.message}",
                    f"fix {key.env} or unset it (it overrides the config's {key.name})",
                )
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


def _home_modes(home: Home) -> Check:
    """The home 0700, its state files 0600: fixed here as at every start, then looked at."""
    home.secure()
    if not platform.has("modes"):
        return Check(
            "home", OK, f"{home.path} (mode bits are not checked here: its folder's ACL guards it)"
        )
    wider: list[str] = []
    for path, allowed in home.private_paths():
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            continue
        if mode & ~allowed:
            wider.append(f"chmod {allowed:o} {path}")
    if wider:
        return Check(
            "home",
            FAIL,
            f"{len(wider)} path(s) in {home.path} are open to other users and could not be "
            "narrowed (owned by another user?)",
            "; ".join(wider),
        )
    return Check("home", OK, f"{home.path} is 0700; config, database and logs 0600")


def _docker(home: Home) -> list[Check]:
    runtime = DockerRuntime()
    try:
        try:
            version = runtime.version()
        except GPUMeshError as exc:
            return [Check("docker", FAIL, exc.message.split(": start it")[0], _DOCKER_FIX)]
        return [Check("docker", OK, version), _gpu_runtime(runtime), _default_image(home, runtime)]
    finally:
        runtime.close()


_DOCKER_FIX = (
    "install Docker and start it (`sudo systemctl start docker`), or add your user to the "
    "docker group"
)


def _gpu_runtime(runtime: DockerRuntime) -> Check:
    inventory = detect_inventory()
    gpus = inventory.gpus()
    if runtime.gpu_runtime_available():
        return Check("nvidia runtime", OK, "NVIDIA container runtime registered with Docker")
    if gpus and inventory.source != "simulated":
        return Check(
            "nvidia runtime",
            WARN,
            f"{len(gpus)} GPU(s) here, but {NO_GPU_RUNTIME}: jobs run without them, and "
            "those that ask for GPU memory fail",
            "install the NVIDIA Container Toolkit and run `sudo nvidia-ctk runtime configure "
            "--runtime=docker`, then restart Docker",
        )
    return Check("nvidia runtime", WARN, "not installed (only CPU jobs can run here)")


def _default_image(home: Home, runtime: DockerRuntime) -> Check:
    image = str(home.config.get("image")) if home.initialized else ""
    if not image:
        return Check("image", WARN, "no default image configured", "gpumesh config set image IMG")
    try:
        present = runtime.image_present(image)
    except GPUMeshError as exc:
        return Check("image", FAIL, exc.message)
    if present:
        return Check("image", OK, f"default image {image} is present")
    return Check(
        "image",
        WARN,
        f"default image {image} is not on this machine; the first job will try to pull it",
        f"`docker pull {image}` now, or `gpumesh config set image IMG` to one you have",
    )


def _isolation() -> EngineIsolation | str:
    """The engine's isolation, or why it cannot be told."""

    runtime = DockerRuntime()
    try:
        return runtime.isolation()
    except GPUMeshError as exc:
        return exc.message
    finally:
        runtime.close()


def _storage_size(image: str) -> bool | None:
    """Whether Docker can size-limit container filesystems; None when it cannot
    be told (Docker down, or ``image`` not here to probe with)."""

    runtime = DockerRuntime()
    try:
        if not image or not runtime.image_present(image):
            return None
        return runtime.isolation(image).storage_size
    except GPUMeshError:
        return None
    finally:
        runtime.close()


def _job_isolation(home: Home) -> Check:
    isolation = _isolation()
    if isinstance(isolation, str):
        return Check("job isolation", WARN, f"cannot tell: {isolation}")
    try:
        job_user = str(home.config.get("job_user"))
        job_root = home.config.get("job_root") == "on"
    except GPUMeshError as exc:
        return Check("job isolation", FAIL, exc.message)
    uid, gid = _agent_ids(home)
    return _describe_isolation(isolation, job_user, job_root, uid, gid)


def _describe_isolation(
    isolation: EngineIsolation, job_user: str, job_root: bool, agent_uid: int, agent_gid: int
) -> Check:
    """Who jobs run as, inside and on the host, and how loudly to say it."""
    name = "job isolation"
    try:
        inside, host = job_identity(job_user, job_root, isolation, agent_uid, agent_gid)
    except ConfigError as exc:
        return Check(name, FAIL, exc.message)
    if isolation.userns_remap:
        engine = f"Docker remaps users (userns-remap): root inside a job is uid {host[0]} here"
    elif isolation.rootless:
        engine = f"rootless Docker: root inside a job is uid {host[0]} (the agent's user) here"
    else:
        engine = ""
    if job_root:
        fix = "gpumesh config set job_root off"
        if engine:
            return Check(
                name,
                WARN,
                f"job_root is on: jobs run as root with a writable root filesystem; {engine}",
                fix,
            )
        return Check(
            name,
            WARN,
            "job_root is on: jobs run as ROOT inside containers that share this machine's "
            "kernel, with a writable root filesystem; a kernel or Docker flaw is then one step "
            "from root on this machine",
            f"{fix}, or use rootless Docker or userns-remap so root in a container is not root "
            "here",
        )
    if engine:
        user = "root inside" if inside == "0:0" else f"uid {inside.split(':')[0]} inside"
        return Check(name, OK, f"{engine}; jobs run as {user}")
    return Check(
        name,
        OK,
        f"jobs run as uid {inside.split(':')[0]} inside containers, not root (no userns-remap "
        "or rootless Docker: root in a container would be root here)",
    )


def _job_storage(home: Home) -> Check:
    try:
        config = home.config
        job_root = config.get("job_root") == "on"

        memory = ShareLimits.from_config(config, machine_size()).job_memory
        tmp = parse_size(str(config.get("job_tmp")))
        shm = parse_size(str(config.get("job_shm")))
    except GPUMeshError as exc:
        return Check("job storage", FAIL, exc.message)
    storage_size = _storage_size(str(config.get("image"))) if job_root else None
    return _describe_storage(job_root, storage_size, tmp, shm, memory)


def _describe_storage(
    job_root: bool, storage_size: bool | None, tmp: int, shm: int, memory: int
) -> Check:
    """Where a job can write, and what bounds it. ``storage_size``: whether the
    engine can limit a container's writable layer (None: not known)."""
    name = "job storage"
    tmpfs = (
        f"/tmp and HOME {format_size(tmp)} tmpfs each, /dev/shm {format_size(min(shm, memory))}, "
        f"within job_memory {format_size(memory)}"
    )
    if not job_root:
        return Check(
            name,
            OK,
            f"read-only root filesystem; {tmpfs}; image VOLUMEs are tmpfs too; only the "
            "workdir reaches the disk",
        )
    if storage_size:
        return Check(
            name,
            OK,
            f"writable root filesystem (job_root), which Docker can size-limit here; {tmpfs}",
        )
    if storage_size is None:
        return Check(
            name,
            WARN,
            "writable root filesystem (job_root); whether Docker can size-limit it is not "
            "known without the default image to check with: a job may fill Docker's disk",
            "gpumesh config set job_root off, or pull the default image and run doctor again",
        )
    return Check(
        name,
        WARN,
        "writable root filesystem (job_root) that Docker cannot size-limit here: a job can "
        "fill Docker's disk",
        "gpumesh config set job_root off, or put Docker's data root on xfs mounted with pquota",
    )


def _not_a_provider() -> Check:
    return Check(
        "share",
        WARN,
        f"this is {platform.system_name()}: it works as a consumer (pair, run, cp, exec, app), "
        "but sharing GPUs with `gpumesh share` needs Linux",
        "share from a Linux machine with an NVIDIA GPU",
    )


def _job_network(home: Home) -> Check:
    """What jobs reach, and whether the rules of ``internet`` and ``lan`` can be
    installed by the agent (running, else one this user would start)."""
    name = "job network"
    mode = str(home.config.get("job_network"))
    if mode == "none":
        return Check(name, OK, f"none: {describe_mode(mode)}")
    if mode == "bridge":
        return Check(
            name,
            WARN,
            f"bridge: {describe_mode(mode)}",
            "`gpumesh config set job_network internet` (share as root, with iptables)",
        )
    isolation = _isolation()
    rootless = not isinstance(isolation, str) and isolation.rootless
    uid, _gid = _agent_ids(home)
    why = install_problem(euid=uid, rootless=rootless, iptables=iptables_installed())
    if why is not None:
        return Check(name, FAIL, cannot_filter(mode, why))
    return Check(name, OK, f"{mode}: {describe_mode(mode)}")


def _agent_user(home: Home) -> Check:
    agent = home.agent_info() if home.initialized else None
    agent_uid = None
    if agent is not None:
        ids = _process_ids(agent.pid)
        agent_uid = ids[0] if ids is not None else None
    return _describe_agent_user(os.geteuid(), agent.pid if agent is not None else None, agent_uid)


_AGENT_USER_FIX = "run `gpumesh share` as a user in the docker group, or use rootless Docker"


def _describe_agent_user(own_uid: int, agent_pid: int | None, agent_uid: int | None) -> Check:
    """Whether the agent (running, else the one this user would start) is root."""
    name = "agent user"
    if agent_pid is not None and agent_uid is not None:
        who = f"`gpumesh share` (pid {agent_pid})"
        if agent_uid == 0:
            return Check(
                name,
                WARN,
                f"{who} runs as root: whatever a peer's message could do to it, it could do "
                "as root",
                _AGENT_USER_FIX,
            )
        return Check(name, OK, f"{who} runs as uid {agent_uid}, not root")
    if own_uid == 0:
        return Check(
            name, WARN, "gpumesh runs as root here; `gpumesh share` would too", _AGENT_USER_FIX
        )
    return Check(name, OK, f"gpumesh runs as uid {own_uid}, not root")


def _cuda_worker(home: Home) -> list[Check]:
    """Who CUDA workers run as, when this node shares CUDA."""
    if not home.initialized or not home.store.cuda_share():
        return []
    note = worker_user(home)
    return [Check("cuda worker", OK, note or "runs as job_user, without privileges or groups")]


def _agent_ids(home: Home) -> tuple[int, int]:
    """The running agent's uid and gid, else this process's."""
    agent = home.agent_info() if home.initialized else None
    ids = _process_ids(agent.pid) if agent is not None else None
    return ids if ids is not None else (os.geteuid(), os.getegid())


def _process_ids(pid: int) -> tuple[int, int] | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            return _status_ids(status.read())
    except OSError:
        return None


def _status_ids(text: str) -> tuple[int, int] | None:
    """Effective uid and gid from the text of ``/proc/PID/status``."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, values = line.partition(":")
        fields = values.split()
        if key in ("Uid", "Gid") and len(fields) >= 2 and fields[1].isdigit():
            found[key] = int(fields[1])  # real, effective, saved, filesystem
    if "Uid" not in found or "Gid" not in found:
        return None
    return found["Uid"], found["Gid"]


def _gpus() -> Check:
    inventory = detect_inventory()
    gpus = inventory.gpus()
    if inventory.source == "simulated":
        names = ", ".join(g.name for g in gpus)
        return Check("gpu", WARN, f"SIMULATED GPUs (test mode, not real): {names}")
    if not gpus:
        return Check(
            "gpu",
            WARN,
            "no NVIDIA GPU found (NVML and nvidia-smi unavailable)",
            "install the NVIDIA driver to share a GPU; CPU-only jobs still run",
        )
    names = ", ".join(f"{g.index}: {g.name}" for g in gpus)
    return Check("gpu", OK, f"{len(gpus)} GPU(s) via {inventory.source}: {names}")


def _udp_port(home: Home) -> Check:
    agent = home.agent_info() if home.initialized else None
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


RELAY_TIMEOUT = 3.0


def _relay(home: Home) -> list[Check]:
    """Relay configured, reachable, registration accepted; what the NAT does."""

    config = home.config
    try:
        relay = config.relay
    except ConfigError:
        return []  # a bad setting: the config check reported it
    if not relay:
        return [
            Check(
                "relay",
                WARN,
                "no relay configured: peers outside this network reach this node only if its "
                "UDP port is reachable (forwarded)",
                "gpumesh config set relay HOST:PORT (a `gpumesh-relay` you or a friend run)",
            )
        ]
    return run_async(_relay_checks(home))


async def _relay_checks(home: Home) -> list[Check]:
    config = home.config
    text = config.relay
    try:
        address = await resolve_relay(text)
    except GPUMeshError as exc:
        return [Check("relay", FAIL, exc.message, "check `gpumesh config get relay`")]
    endpoint = QuicEndpoint(UdpSocket(open_udp_socket("0.0.0.0", 0)))
    tcp = tcp_route(text, config.relay_tcp, udp_retry=config.relay_udp_retry)
    client = RelayClient(
        endpoint, address, text, home.identity, token=config.relay_token, serving=False, tcp=tcp
    )
    endpoint.relay = client
    client.start()
    try:
        try:
            await client.wait_registered(RELAY_TIMEOUT)
        except GPUMeshError as exc:
            fix = (
                f"ask the relay's operator to allow node id {home.identity.node_id}, or set "
                "its shared token: gpumesh config set relay_token TOKEN"
                if "not-allowed" in exc.message
                else f"check that gpumesh-relay runs at {text} and UDP (or TCP, relay_tcp) to "
                "it is not blocked; `gpumesh netcheck` says which path fails"
            )
            return [Check("relay", FAIL, exc.message, fix)]
        over_tcp = client.over_tcp
    finally:
        endpoint.close()
    if over_tcp:
        assert tcp is not None
        return [
            Check(
                "relay",
                WARN,
                f"{text} accepted this node's registration over TCP ({tcp.label}): UDP to it "
                "gets no answer, so peers reach this node only through the relay",
                "if UDP should work here, `gpumesh netcheck` says what it finds",
            )
        ]
    return [Check("relay", OK, f"{text} accepted this node's registration"), await _nat(address)]


async def _nat(relay: Address) -> Check:
    """What the NAT does, as ``gpumesh netcheck`` finds it: this node's public address,
    whether the NAT maps by destination, whether unsolicited packets get in."""
    try:
        udp = await probe_udp(relay, timeout=RELAY_TIMEOUT)
    except GPUMeshError as exc:
        return Check("nat", WARN, f"could not check: {exc.message}")
    status, nat, fix = describe_nat(udp)
    return Check("nat", status, f"{nat}; {describe_inbound(udp)}", fix)


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
    return {"yes": True, "no": False}.get(out.stdout.strip())
