"""The agent needs no more than Docker does, and says so when it has more.

`gpumesh share` runs here as an ordinary user in the docker group, serves a
real job and copies, and its jobs run as that user; `share` and `doctor` say
who jobs run as, loudly when it is root.

Running a process as another user needs root (to make the user and switch to
it); CI runs as root, so nothing here is skipped there. The interpreter, the
virtualenv and the source may live in folders that user cannot enter (a
root-only home): a private mount namespace binds them where it can, so the
agent reads its code as that user too, with nothing but the docker group.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import gpumesh
from gpumesh.errors import ExitCode
from tests.integration.conftest import gpumesh as run_cli
from tests.integration.conftest import remove_containers
from tests.integration.node import wait_shares
from tests.integration.test_cli import _free_udp_port, _init

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
USER = "gpumesh-agent-test"

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@dataclass
class Unprivileged:
    """Runs ``python -m gpumesh`` as an ordinary user in the docker group."""

    uid: int
    gid: int
    docker_gid: int
    mounts: Path

    def command(self, *args: str) -> list[str]:
        base = Path(sys.base_prefix)
        executable = Path(os.path.realpath(sys.executable)).relative_to(base)
        site = Path(sysconfig.get_paths()["purelib"])
        source = Path(gpumesh.__file__).resolve().parents[1]
        binds = " && ".join(
            f"mount --bind {original} {self.mounts / name}"
            for original, name in ((base, "py"), (site, "site"), (source, "src"))
        )
        script = (
            f"set -e; {binds}; exec setpriv --reuid={self.uid} --regid={self.gid} "
            f'--groups={self.docker_gid} --inh-caps=-all -- "$@"'
        )
        python = self.mounts / "py" / executable
        return ["unshare", "--mount", "sh", "-c", script, "sh", str(python), "-m", "gpumesh", *args]

    def env(self, home: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update(
            GPUMESH_HOME=str(home),
            PYTHONPATH=f"{self.mounts / 'src'}:{self.mounts / 'site'}",
            LD_LIBRARY_PATH=str(
                self.mounts / "py" / "lib"
            ),  # a Python built with a shared libpython
            HOME=str(home.parent),
            PYTHONDONTWRITEBYTECODE="1",
        )
        env.pop("GPUMESH_LOG", None)
        return env

    def run(self, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*args),
            env=self.env(home),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


@pytest.fixture
def unprivileged() -> Iterator[Unprivileged]:
    if os.geteuid() != 0:
        if _in_ci():
            raise AssertionError("CI must run the tests as root")
        pytest.skip("switching to another user needs root")
    import grp

    try:
        docker_gid = grp.getgrnam("docker").gr_gid
    except KeyError:
        raise AssertionError("no docker group: is Debian's docker.io installed?") from None
    made = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", USER], check=True
        )
        made = True
    entry = pwd.getpwnam(USER)
    # Not under pytest's own temporary folder, which only root may enter.
    root = Path(tempfile.mkdtemp(prefix="gpumesh-unprivileged-"))
    root.chmod(0o755)
    for name in ("py", "site", "src"):
        (root / name).mkdir()
    (root / "homes").mkdir()
    os.chown(root / "homes", entry.pw_uid, entry.pw_gid)
    try:
        yield Unprivileged(entry.pw_uid, entry.pw_gid, docker_gid, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the binds lived in the children's namespaces
        if made:
            subprocess.run(["userdel", USER], check=False)


def _status_ids(pid: int) -> tuple[int, int, list[int]]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    uid = int(fields["Uid"].split()[1])  # effective
    gid = int(fields["Gid"].split()[1])
    groups = [int(g) for g in fields["Groups"].split()]
    return uid, gid, groups


def _wait_for_agent(home: Path, proc: subprocess.Popen[str]) -> dict[str, object]:
    try:
        info: dict[str, object] = wait_shares(home, proc)["agent"]
    except AssertionError:
        proc.kill()
        raise
    return info


def _read_until(proc: subprocess.Popen[str], needle: str) -> str:
    """stdout until a line with ``needle`` (share prints its banner, then serves)."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} never printed: {''.join(seen)}")


@contextlib.contextmanager
def _sharing(command: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        _remove_containers(env["GPUMESH_HOME"])


def _remove_containers(home: str) -> None:
    from gpumesh.identity.keys import Identity

    key = Path(home) / "identity.key"
    if key.exists():
        remove_containers(str(Identity.load(key).node_id))


def test_share_runs_as_an_ordinary_user_in_the_docker_group(
    unprivileged: Unprivileged, tmp_path: Path
) -> None:
    alice = unprivileged.mounts / "homes" / "alice"
    user = unprivileged
    for args in (
        ("init", "--name", "alice-pc"),
        ("config", "set", "listen_host", "127.0.0.1"),
        ("config", "set", "listen_port", str(_free_udp_port())),
        ("config", "set", "image", IMAGE),
        ("config", "set", "job_memory", "256MB"),
    ):
        result = user.run(alice, *args)
        assert result.returncode == 0, result.stderr
    assert alice.stat().st_uid == user.uid
    assert (alice / "identity.key").stat().st_uid == user.uid
    # Keeping jobs off this machine's services takes firewall rules, which only root
    # installs: the default job network is refused, in one line naming the ways out.
    refused = user.run(alice, "share")
    assert refused.returncode == ExitCode.USAGE, (refused.stdout, refused.stderr)
    (line,) = refused.stderr.strip().splitlines()
    assert "job_network internet needs firewall rules" in line
    assert "the agent does not run as root" in line
    assert "job_network none` (jobs get no network)" in line
    assert "job_network bridge` (jobs can reach this machine's services" in line
    doctor = user.run(alice, "doctor")
    (network,) = [row for row in doctor.stdout.splitlines() if "job network" in row]
    assert "the agent does not run as root" in network and "job_network bridge" in network
    assert user.run(alice, "config", "set", "job_network", "bridge").returncode == 0
    bob = tmp_path / "bob"
    _init(bob, "bob-laptop")
    assert run_cli(bob, "config", "set", "image", IMAGE).returncode == 0

    with _sharing(user.command("share"), user.env(alice)) as share:
        info = _wait_for_agent(alice, share)
        banner = _read_until(share, "Pairing code")
        # The agent itself: the ordinary user, the docker group, no root.
        uid, gid, groups = _status_ids(int(str(info["pid"])))
        assert (uid, gid) == (user.uid, user.gid)
        assert groups == [user.docker_gid]
        # Jobs run as the agent's own user (auto), never root.
        assert f"jobs run as {user.uid}:{user.gid} (host uid {user.uid})" in banner
        assert "job network bridge (Docker's bridge" in banner

        alice_code = user.run(alice, "pair-code").stdout.strip()
        assert run_cli(bob, "pair", alice_code).returncode == 0
        paired = user.run(alice, "pair", run_cli(bob, "pair-code").stdout.strip())
        assert paired.returncode == 0, paired.stderr

        work = tmp_path / "work"
        work.mkdir()
        (work / "input.txt").write_text("from bob\n")
        script = (
            "echo uid=$(id -u); stat -c 'owner=%u mode=%a' input.txt; "
            "echo written > out.txt && cat out.txt; touch $HOME/.cache-ok && echo home-ok"
        )
        ran = run_cli(
            bob,
            "run",
            "--peer",
            "alice-pc",
            "--workdir",
            str(work),
            "--",
            "sh",
            "-c",
            script,
            timeout=120,
        )
        assert ran.returncode == 0, (ran.stdout, ran.stderr)
        assert f"uid={user.uid}" in ran.stdout
        assert f"owner={user.uid} mode=644" in ran.stdout  # not world-writable
        assert "written" in ran.stdout and "home-ok" in ran.stdout

        data = tmp_path / "data.bin"
        data.write_bytes(os.urandom(300_000))
        up = run_cli(bob, "cp", str(data), "alice-pc:/data.bin")
        assert up.returncode == 0, up.stderr
        back = tmp_path / "back.bin"
        down = run_cli(bob, "cp", "alice-pc:/data.bin", str(back))
        assert down.returncode == 0, down.stderr
        assert back.read_bytes() == data.read_bytes()
        sandbox = (
            alice / "files" / str(json.loads(run_cli(bob, "status", "--json").stdout)["node_id"])
        )
        assert (sandbox / "data.bin").stat().st_uid == user.uid

        # doctor, asked about this home by its user, sees an agent that is not root;
        # root itself uses no home another user owns (whose links it would follow).
        refused = run_cli(alice, "doctor", "--json")
        assert refused.returncode == 2 and "belongs to another user" in refused.stderr
        doctor = json.loads(user.run(alice, "doctor", "--json").stdout)
        checks = {check["name"]: check for check in doctor}
        agent_check = checks["agent user"]
        assert agent_check["status"] == "ok", agent_check
        assert str(user.uid) in agent_check["detail"]


def test_share_says_who_jobs_run_as_and_warns_loudly_about_job_root(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the root agent's wording is what is checked here")
    home = tmp_path / "alice"
    _init(home, "alice-pc", _free_udp_port())
    assert run_cli(home, "config", "set", "image", IMAGE).returncode == 0
    env = dict(os.environ, GPUMESH_HOME=str(home))
    env.pop("GPUMESH_LOG", None)
    command = [sys.executable, "-m", "gpumesh", "share"]

    with _sharing(command, env) as share:
        _wait_for_agent(home, share)
        banner = _read_until(share, "Pairing code")
    assert "jobs run as 47000:47000 (host uid 47000), root filesystem read-only" in banner

    assert run_cli(home, "config", "set", "job_root", "on").returncode == 0
    with _sharing(command, env) as share:
        _wait_for_agent(home, share)
        _read_until(share, "Pairing code")
        share.send_signal(signal.SIGINT)
        _out, err = share.communicate(timeout=20)
    assert "WARNING: job_root is on: peers' jobs run as ROOT" in err
    doctor = json.loads(run_cli(home, "doctor", "--json").stdout)
    checks = {check["name"]: check for check in doctor}
    assert checks["job isolation"]["status"] == "warn"
    assert checks["agent user"]["status"] == "warn"  # doctor itself runs as root here
