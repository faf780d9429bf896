"""Fixtures shared by every test folder."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from gpumesh.settings import ENV_TEST_JOB_NETWORK
from tests.jobnet_lab import SESSION_PREFIX, remove_job_networks

# The markers that come from fixtures, the fast tier and its guard: tests/tiers.py.
pytest_plugins = ["tests.tiers"]

# No verdict may depend on speed: CI runs on a loaded 2-core machine, where a
# property test's example can take far longer than hypothesis's 200 ms default
# deadline. Every property test runs without a deadline and without the health
# checks that time the data generation; timings belong in bench/.
settings.register_profile(
    "gpumesh",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("gpumesh")

# Ctrl-C must reach the processes tests start and interrupt. A suite started in
# the background of a shell has SIGINT ignored, and an ignored signal stays
# ignored through exec, so the SIGINT a test sends a child would do nothing: it
# is put back to the default action here, which every child then starts with.
# Not Python's KeyboardInterrupt handler: with that one installed, asyncio.run
# installs its own around every loop the tests run, and the suite's loops would
# end differently from the way they end in the run that ignored SIGINT.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Commands go through the node process, as users' do; a GPUMESH_NODE left in the
# environment would only make each command say that it is gone.
os.environ.pop("GPUMESH_NODE", None)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture
def docker_daemon() -> None:
    """Require a running Docker daemon: skipped on a laptop without one, never in CI."""
    require_docker()


def require_docker() -> None:
    """:func:`docker_daemon` for fixtures of a wider scope."""
    if _in_ci():
        return
    if os.environ.get("GPUMESH_TEST_NO_DOCKER") == "1":
        pytest.skip("Docker not available (GPUMESH_TEST_NO_DOCKER=1)")
    import docker
    from docker.errors import DockerException

    try:
        client = docker.from_env(timeout=3)
        client.ping()
        client.close()
    except DockerException:
        pytest.skip("no Docker daemon reachable")


@pytest.fixture
def network_lab() -> None:
    """Require what the labs of network namespaces need (root, iproute2, iptables,
    TUN devices): skipped on a laptop without them, never in CI."""
    missing = _network_lab_missing()
    if missing:
        if _in_ci():
            pytest.fail(f"CI runs the network lab tests: {missing}")
        pytest.skip(f"network lab unavailable: {missing}")


def _network_lab_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables, TUN devices)"
    for tool in ("ip", "iptables", "iptables-restore"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/dev/net/tun").exists():
        return "/dev/net/tun is missing"
    return None


DESKTOP_PROGRAMS = (
    "Xvfb",
    "x11vnc",
    "xdotool",
    "xev",
    "xmessage",
    "xfreerdp",
    "freerdp-shadow-cli",
)


@pytest.fixture
def desktop_programs() -> None:
    """Require the desktop tunnel's real servers and clients (scripts/ensure-desktop.sh):
    skipped on a machine without them, never in CI."""
    missing = [program for program in DESKTOP_PROGRAMS if shutil.which(program) is None]
    if os.environ.get("GPUMESH_TEST_NO_DESKTOP") == "1" or missing:
        if _in_ci():
            pytest.fail(f"desktop programs missing in CI: {missing} (scripts/ensure-desktop.sh)")
        pytest.skip(f"needs {', '.join(missing) or 'the desktop programs'} (ensure-desktop.sh)")


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The common umask 022, under which a file is world-readable unless made otherwise."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture(params=["openat2", "walk"])
def resolution(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both ways the sandbox opens beneath a folder: openat2, and the component walk
    that kernels before 5.6 (or a seccomp filter that refuses openat2) get."""
    from gpumesh.files import sandbox

    sandbox.use_openat2(request.param == "openat2")
    if request.param == "openat2" and not sandbox.openat2_available():
        sandbox.use_openat2(None)
        if _in_ci():
            raise AssertionError("CI's kernel must have openat2 (Linux 5.6+)")
        pytest.skip("this kernel has no openat2")
    try:
        yield str(request.param)
    finally:
        sandbox.use_openat2(None)


@pytest.fixture(autouse=True, scope="session")
def _own_job_networks() -> Iterator[None]:
    """Agents of this test run (in-process and CLI alike) make job networks of
    their own (:mod:`tests.jobnet_lab`), removed at the end."""
    os.environ[ENV_TEST_JOB_NETWORK] = SESSION_PREFIX
    try:
        yield
    finally:
        if os.geteuid() == 0:
            remove_job_networks(SESSION_PREFIX)


@pytest.fixture(autouse=True, scope="session")
def _no_node_process_started_here_left() -> Iterator[None]:
    """Node processes that commands run in this process started, in homes the tests
    below did not clean (a folder deeper than :func:`end_node_processes` looks), end
    with the run."""
    yield
    client = sys.modules.get("gpumesh.daemon.client")
    for child in [] if client is None else client._STARTED:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


@pytest.fixture(autouse=True)
def _no_node_process_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Whatever node process a test's homes got (a command started one in the
    background) is ended with the test."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")
    yield
    end_node_processes(tmp_path)


def end_node_processes(folder: Path) -> None:
    """Kill the node process of every home in ``folder`` (or one level below)."""
    from gpumesh.daemon.record import holder

    for lock in [*folder.glob("*/node.lock"), *folder.glob("*/*/node.lock")]:
        record = holder(lock.parent)
        # One still starting holds the lock before its record says who it is.
        deadline = time.monotonic() + 10
        while record is not None and not record.pid and time.monotonic() < deadline:
            time.sleep(0.05)
            record = holder(lock.parent)
        if record is not None and record.pid:
            with contextlib.suppress(OSError):
                os.kill(record.pid, signal.SIGKILL)
            _reap(record.pid)
            _remove_network_holders(lock.parent)


def _remove_network_holders(home: Path) -> None:
    """Remove the network holders (:mod:`gpumesh.runtime.holders`) made for the node
    of ``home``. A node process stopped removes its spares and the next start of
    that node those of an earlier run, but a test's node is killed and never
    starts again: a run of the suite would leave hundreds running."""
    from gpumesh.errors import GPUMeshError
    from gpumesh.identity import Identity
    from gpumesh.runtime.holders import LABEL_HOLDER_OF

    try:
        node_id = Identity.load(home / "identity.key").node_id
    except GPUMeshError:  # no identity (yet): no node made holders
        return
    import docker
    import requests.exceptions

    with contextlib.suppress(docker.errors.DockerException, requests.exceptions.RequestException):
        client = docker.from_env(timeout=10)
        with contextlib.closing(client):
            label = f"{LABEL_HOLDER_OF}={node_id}"
            for found in client.api.containers(all=True, filters={"label": label}):
                with contextlib.suppress(docker.errors.APIError):
                    client.api.remove_container(found["Id"], force=True)


def _reap(pid: int) -> None:
    """Wait for ``pid`` where a command run in this process started it (its handle
    is kept, so that it leaves no zombie and no warning)."""
    client = sys.modules.get("gpumesh.daemon.client")
    if client is None:
        return
    for child in list(client._STARTED):
        if child.pid == pid:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=10)
    client._reap()


OTHER_USER = "gpumesh-other"
"""The second local account that tests acting as another user of this machine run as."""


@dataclasses.dataclass(frozen=True)
class OtherUser:
    """Another local account: runs commands as it, with no supplementary groups."""

    name: str
    uid: int
    gid: int
    home: Path

    def argv(self, *command: str) -> list[str]:
        """The argv that runs `command` as this user (setpriv, a clean group list)."""
        return [
            "setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--",
            *command,
        ]

    def run(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run `command` as this user and capture its output (never raises on exit codes)."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home)}
        return subprocess.run(
            self.argv(*command),
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )


@pytest.fixture(scope="session")
def other_user() -> OtherUser:
    """A second local account (created once, as root). Skipped without root, never in CI."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("useradd") is None:
        if _in_ci():
            raise AssertionError("CI runs as root with setpriv and useradd: tests need them")
        pytest.skip("needs root, setpriv and useradd to act as another local user")
    try:
        entry = pwd.getpwnam(OTHER_USER)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--create-home", "--user-group", "--shell", "/bin/sh", OTHER_USER],
            check=False,
            capture_output=True,
            text=True,
        )
        # 9: the name is taken, by another test process that made it meanwhile (-n).
        assert made.returncode in (0, 9), made.stderr
        entry = pwd.getpwnam(OTHER_USER)
    return OtherUser(entry.pw_name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))
