"""What a peer's job reaches over the network, attacked from inside real containers.

A network namespace made per test stands for everything outside this machine:
a veth pair routes a public-looking address (198.18.x.2, "the internet"), a
link-local one (169.254.x.2, where clouds serve instance credentials) and a
private one (10.213.x.2) from this machine into it, where a listener answers
on each; this machine's end of the pair (198.18.x.1) is one more of its own
addresses. Jobs are busybox containers made by the agent's own code
(``gpumesh run`` through a real ``gpumesh share``, or the runtime with the
agent's job network); each tries every address with ``wget`` and the test
reads what answered. Nothing is sent beyond this machine.

Needs root, iptables and ip (as CI has); skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest

from gpumesh.errors import ExitCode
from gpumesh.runtime.base import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_PEER,
    ContainerSpec,
    LogCursor,
)
from gpumesh.runtime.docker import DockerRuntime
from gpumesh.runtime.jobnet import JobNetwork, Mode, rule_set
from tests.integration.conftest import gpumesh, remove_containers, shared_pair
from tests.integration.node import shares
from tests.integration.test_cli import _free_udp_port, _init, _one_line_error, _start_share
from tests.jobnet_lab import container_address, remove_job_networks

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
MiB = 1024 * 1024
ANSWER = "192.0.2.77"
"""What the namespace's name server answers for every name."""

LISTENER = r"""
import socket, sys
name = sys.argv[1]
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", 0))
server.listen(16)
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        conn.settimeout(5)
        try:
            conn.recv(4096)
            head = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(name)
            conn.sendall(head + name.encode())
        except OSError:
            pass
"""

NAME_SERVER = r"""
import socket, sys
answer = bytes(int(part) for part in sys.argv[1].split("."))
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind((sys.argv[2], 53))  # a wildcard socket would answer from another address
print("ready", flush=True)
while True:
    query, peer = sock.recvfrom(512)
    if len(query) < 12:
        continue
    end = query.index(b"\0", 12) + 5
    qtype = query[end - 4:end - 2]
    answers = b"\0\1" if qtype == b"\0\1" else b"\0\0"
    header = query[:2] + b"\x81\x80" + query[4:6] + answers + b"\0\0\0\0"
    record = b"\xc0\x0c\0\1\0\1\0\0\0\x3c\0\4" + answer if qtype == b"\0\1" else b""
    sock.sendto(header + query[12:end] + record, peer)
"""


@pytest.fixture(autouse=True)
def _require_lab(docker_daemon: None, network_lab: None) -> None:
    """The job network tests need Docker and the network lab's tools."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Outside:
    """The namespace standing for the world, and the addresses into it."""

    ns: str
    this_machine: str
    """This machine's end of the veth pair: one of its own (public-looking) addresses."""
    internet: str
    link_local: str
    private: str
    port: int
    """Where the namespace's listener answers (on each of its addresses)."""


def _listen(argv: list[str], procs: list[subprocess.Popen[str]]) -> str:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()
    assert first, f"listener {argv} did not start"
    return first


@pytest.fixture
def outside() -> Iterator[Outside]:
    tag = secrets.token_hex(3)
    ns, here, there = f"gmjn{tag}", f"gmjn{tag}h", f"gmjn{tag}n"
    net = random.randrange(1, 255)
    lab = Outside(
        ns=ns,
        this_machine=f"198.18.{net}.1",
        internet=f"198.18.{net}.2",
        link_local=f"169.254.{net}.2",
        private=f"10.213.{net}.2",
        port=0,
    )
    procs: list[subprocess.Popen[str]] = []
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{lab.this_machine}/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        for address in (f"{lab.internet}/24", f"{lab.link_local}/32", f"{lab.private}/32"):
            _ip("-n", ns, "addr", "add", address, "dev", there)
        _ip("-n", ns, "link", "set", there, "up")
        _ip("-n", ns, "route", "add", "default", "via", lab.this_machine)
        for address in (lab.link_local, lab.private):
            _ip("route", "add", f"{address}/32", "via", lab.internet, "dev", here)
        argv = ["ip", "netns", "exec", ns, sys.executable, "-c"]
        port = int(_listen([*argv, LISTENER, "outside"], procs))
        _listen([*argv, NAME_SERVER, ANSWER, lab.private], procs)
        yield Outside(**{**lab.__dict__, "port": port})
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", here)  # its routes go with it
        _ip("netns", "del", ns)


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A service of this machine listening on every address (as x11vnc and xrdp do)."""
    procs: list[subprocess.Popen[str]] = []
    try:
        yield int(_listen([sys.executable, "-c", LISTENER, "this-machine"], procs))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def _own_addresses() -> list[str]:
    """This machine's IPv4 addresses, loopback aside."""
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    return [line.split()[3].split("/")[0] for line in shown.splitlines() if line.split()[1] != "lo"]


def _probe_script(targets: dict[str, str]) -> str:
    """A job that tries each ``name: host:port`` and prints ``name reached|closed``."""
    lines = [
        # busybox's own nc (its wget needs a resolver library this image lacks)
        "probe() { if printf 'GET / HTTP/1.0\\r\\n\\r\\n' | busybox nc -w 8 $2 $3 2>/dev/null "
        '| grep -q \'200 OK\'; then echo "$1 reached"; else echo "$1 closed"; fi; }',
        "gateway=$(busybox ip route | busybox awk '/^default/ {print $3}')",
    ]
    lines += [f"probe {name} {target.replace(':', ' ')}" for name, target in targets.items()]
    return "\n".join(lines)


def _verdicts(output: str) -> dict[str, str]:
    return dict(
        line.split(" ", 1) for line in output.splitlines() if line.endswith(("reached", "closed"))
    )


def _listener_container(client: Any, network: str, node_label: str) -> str:
    """A container answering on 8080 (another job, or anything else on the engine);
    returns its address on ``network``."""
    container = client.containers.run(
        IMAGE,
        [
            "sh",
            "-c",
            "mkdir -p /tmp/www && echo other > /tmp/www/index.html && "
            "exec busybox httpd -f -p 8080 -h /tmp/www",
        ],
        detach=True,
        network=network,
        labels={LABEL_NODE: node_label},
        name=f"gpumesh-test-jn-{secrets.token_hex(4)}",
    )
    container.reload()
    return str(container.attrs["NetworkSettings"]["Networks"][network]["IPAddress"])


# --- through a real share ------------------------------------------------------------


def test_a_job_reaches_the_internet_but_not_this_machine_other_containers_or_private_ranges(
    tmp_path: Path, outside: Outside, host_listener: int
) -> None:
    """The reported attack: a job-only peer's job reached a VNC server listening on
    0.0.0.0 through the Docker gateway; the same path reached other jobs'
    containers and the cloud's 169.254.169.254. Defaults, a real `gpumesh share`."""
    client = docker.from_env()
    label = f"jobnet-{uuid.uuid4().hex[:8]}"
    try:
        with shared_pair(tmp_path) as (_alice, bob):
            # Another peer's job, left running on alice: a job of this same network.
            other = gpumesh(
                bob,
                "run",
                "--peer",
                "alice-pc",
                "--detach",
                "--",
                "sh",
                "-c",
                "mkdir -p /tmp/www && echo other > /tmp/www/index.html && "
                "exec busybox httpd -f -p 8080 -h /tmp/www",
            )
            assert other.returncode == 0, other.stderr
            other_job = _job_address(client, other.stdout.strip())
            plain = _listener_container(client, "bridge", label)
            targets = {
                "gateway": f"$gateway:{host_listener}",
                "this-machine": f"{outside.this_machine}:{host_listener}",
                **{
                    f"interface-{i}": f"{address}:{host_listener}"
                    for i, address in enumerate(_own_addresses())
                },
                "other-job": f"{other_job}:8080",
                "other-container": f"{plain}:8080",
                "link-local": f"{outside.link_local}:{outside.port}",
                "private": f"{outside.private}:{outside.port}",
                "internet": f"{outside.internet}:{outside.port}",
            }
            probe = gpumesh(
                bob,
                "run",
                "--peer",
                "alice-pc",
                "--",
                "sh",
                "-c",
                _probe_script(targets),
                timeout=180,
            )
            assert probe.returncode == 0, (probe.stdout, probe.stderr)
            verdicts = _verdicts(probe.stdout)
            assert verdicts == {
                **{name: "closed" for name in targets},
                "internet": "reached",
            }, probe.stdout
    finally:
        remove_containers(label)
        client.close()


def _job_address(client: Any, job_id: str) -> str:
    """The address of a job's running container, once it has one."""
    for _ in range(300):
        found = client.containers.list(filters={"label": f"{LABEL_JOB}={job_id}"})
        if found:
            with contextlib.suppress(docker.errors.NotFound):
                address = container_address(client.api, found[0].id)
                if address:
                    return address
        subprocess.run(["sleep", "0.1"], check=False)
    raise AssertionError(f"job {job_id} never got a container with an address")


# --- the runtime on the agent's job network -----------------------------------------


class _Jobs:
    """Containers on a job network of this test's own (its own prefix). ``joined``
    True: each in the namespace of a network holder made ready for it (see
    gpumesh.runtime.holders); False: each made on the network itself (only the
    first of a node is sure to be); None: as the runtime finds it."""

    def __init__(
        self, mode: Mode, resolvers: tuple[str, ...], *, joined: bool | None = None
    ) -> None:
        self.joined = joined
        self.prefix = f"gpumesh-jobs-t{secrets.token_hex(4)}"
        self.node = f"jobnet-{uuid.uuid4().hex[:8]}"
        self.client = docker.from_env()
        self.runtime = DockerRuntime(self.client)
        self.network = JobNetwork(mode, prefix=self.prefix, resolvers=resolvers)
        self.network.ensure(self.runtime)

    def run(self, script: str) -> str:
        self.network.ensure(self.runtime)  # as the agent does before every container
        job = uuid.uuid4().hex[:10]
        spec = ContainerSpec(
            image=IMAGE,
            command=["sh", "-c", script],
            env={},
            labels={LABEL_JOB: job, LABEL_PEER: "peer", LABEL_NODE: self.node, LABEL_ATTEMPT: "1"},
            name=f"gpumesh-test-{job}",
            memory=64 * MiB,
            pids_limit=64,
            network=self.network.docker_network,
            dns=self.network.dns,
        )
        if self.joined:
            assert self.runtime.prepare(spec.network, spec.dns, self.node, wait=60)
        container_id = self.runtime.create(spec)
        if self.joined is not None:
            mode = self.client.api.inspect_container(container_id)["HostConfig"]["NetworkMode"]
            assert mode.startswith("container:") == self.joined, mode
        self.runtime.start(container_id)
        self.runtime.wait(container_id)
        return b"".join(
            line.data
            for line in self.runtime.job_logs(container_id, {"stdout": LogCursor()}, False)
        ).decode()

    def close(self) -> None:
        remove_containers(self.node)
        self.runtime.close()
        self.client.close()
        remove_job_networks(self.prefix)


JOINED = pytest.mark.parametrize("joined", [False, True], ids=["on-the-network", "in-a-holder"])


@contextlib.contextmanager
def _jobs(mode: Mode, resolvers: tuple[str, ...], *, joined: bool | None = None) -> Iterator[_Jobs]:
    jobs = _Jobs(mode, resolvers, joined=joined)
    try:
        yield jobs
    finally:
        jobs.close()


@JOINED
def test_dns_reaches_port_53_of_the_given_resolver_and_nothing_else_of_it(
    outside: Outside, joined: bool
) -> None:
    """The resolver sits on a private address (as a cloud's or a home router's does):
    names resolve through it, yet its other ports stay closed."""
    with _jobs("internet", (outside.private,), joined=joined) as jobs:
        output = jobs.run(
            "busybox nslookup probe.gpumesh.test; "
            + _probe_script({"resolver-web": f"{outside.private}:{outside.port}"})
        )
    assert ANSWER in output, output
    assert _verdicts(output) == {"resolver-web": "closed"}, output


@JOINED
def test_lan_reaches_private_ranges_but_not_link_local_this_machine_or_containers(
    outside: Outside, host_listener: int, joined: bool
) -> None:
    with _jobs("lan", (outside.private,), joined=joined) as jobs:
        plain = _listener_container(jobs.client, "bridge", jobs.node)
        output = jobs.run(
            _probe_script(
                {
                    "private": f"{outside.private}:{outside.port}",
                    "internet": f"{outside.internet}:{outside.port}",
                    "link-local": f"{outside.link_local}:{outside.port}",
                    "gateway": f"$gateway:{host_listener}",
                    "this-machine": f"{outside.this_machine}:{host_listener}",
                    "other-container": f"{plain}:8080",
                }
            )
        )
    assert _verdicts(output) == {
        "private": "reached",
        "internet": "reached",
        "link-local": "closed",
        "gateway": "closed",
        "this-machine": "closed",
        "other-container": "closed",
    }, output


@JOINED
def test_jobs_on_the_job_network_cannot_reach_each_other_nor_use_ipv6(joined: bool) -> None:
    with _jobs("internet", (), joined=joined) as jobs:
        neighbour = _listener_container(jobs.client, jobs.network.docker_network, jobs.node)
        output = jobs.run(
            _probe_script({"neighbour": f"{neighbour}:8080"})
            + "\necho ipv6 $(cat /proc/sys/net/ipv6/conf/all/disable_ipv6)"
            + "\nbusybox ip -6 addr | grep -c inet6 || true"
        )
    assert _verdicts(output) == {"neighbour": "closed"}, output
    assert "ipv6 1" in output
    assert output.strip().endswith("0"), output


def test_installing_twice_leaves_one_jump_and_the_same_rules() -> None:
    """Each share start installs again: nothing piles up."""
    with _jobs("internet", ("10.0.0.2",)) as jobs:
        names = jobs.network.names
        assert names is not None
        before = _rules(names.forward_chain, names.input_chain)
        JobNetwork("internet", prefix=jobs.prefix, resolvers=("10.0.0.2",)).ensure(jobs.runtime)
        assert _rules(names.forward_chain, names.input_chain) == before
        jumps = [line for line in before if line.endswith(f"-j {names.forward_chain}")]
        assert len(jumps) == 1 and jumps[0].startswith("-A DOCKER-USER")


def test_rules_flushed_while_sharing_are_back_before_the_next_job(host_listener: int) -> None:
    """A firewall manager's reload flushes DOCKER-USER and INPUT (and may empty our
    chains): the next job must not run unfiltered."""
    with _jobs("internet", ()) as jobs:
        names = jobs.network.names
        assert names is not None
        target = {"gateway": f"$gateway:{host_listener}"}
        assert _verdicts(jobs.run(_probe_script(target))) == {"gateway": "closed"}
        for chain, rule in rule_set("internet", names, ()).jumps:
            subprocess.run(["iptables", "-D", chain, *rule], check=True)
        subprocess.run(["iptables", "-F", names.input_chain], check=True)
        output = jobs.run(_probe_script(target))
        assert _verdicts(output) == {"gateway": "closed"}, output
        jumps = [line for line in _rules(names.forward_chain) if line.startswith("-A DOCKER")]
        assert len(jumps) == 1, jumps


def _rules(*chains: str) -> list[str]:
    shown = subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=True)
    return [line for line in shown.stdout.splitlines() if any(c in line for c in chains)]


# --- what the owner sees ---------------------------------------------------------------


def _bare_path(tmp_path: Path) -> str:
    """A PATH without iptables: how a machine without it looks to the agent."""
    bare = tmp_path / "bin"
    bare.mkdir(exist_ok=True)
    return str(bare)


@pytest.mark.parametrize("mode", ["internet", "lan"])
def test_share_and_doctor_refuse_a_filtered_network_that_cannot_be_installed(
    tmp_path: Path, mode: str
) -> None:
    home = tmp_path / "a"
    _init(home, "alice-pc", _free_udp_port())
    assert gpumesh(home, "config", "set", "job_network", mode).returncode == 0
    env = dict(os.environ, GPUMESH_HOME=str(home), PATH=_bare_path(tmp_path))
    env.pop("GPUMESH_LOG", None)
    shared = subprocess.run(
        [sys.executable, "-m", "gpumesh", "share"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    _one_line_error(shared, ExitCode.USAGE, f"job_network {mode} needs firewall rules")
    for words in (
        "iptables and iptables-restore are not installed",
        "`gpumesh config set job_network none` (jobs get no network)",
        "`gpumesh config set job_network bridge` (jobs can reach this machine's services",
    ):
        assert words in shared.stderr
    assert not shares(home)

    doctor = subprocess.run(
        [sys.executable, "-m", "gpumesh", "doctor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert doctor.returncode == ExitCode.FAILED, doctor.stdout
    (line,) = [line for line in doctor.stdout.splitlines() if "job network" in line]
    assert line.startswith("✗")
    assert shared.stderr.strip().removeprefix("error: ") in line


def test_share_shows_the_job_network_in_its_limits_line(tmp_path: Path) -> None:
    home = tmp_path / "a"
    _init(home, "alice-pc", _free_udp_port())
    for mode, words, flags in (
        ("internet", "job network internet (DNS and the internet only)", ()),
        # --max-vram's cap is a limit too (it was missing from the line).
        (
            "bridge",
            "GPU memory at most 8GB a job; job network bridge (Docker's bridge:",
            ("--max-vram", "8GB"),
        ),
    ):
        assert gpumesh(home, "config", "set", "job_network", mode).returncode == 0
        share = _start_share(home, *flags)
        try:
            assert share.stdout is not None
            limits = ""
            while not limits:
                line = share.stdout.readline()
                assert line, "share ended before its limits line"
                limits = line if "limits:" in line else ""
            assert words in limits, limits
        finally:
            share.send_signal(signal.SIGINT)
            share.communicate(timeout=30)


def test_an_unknown_job_network_is_refused_naming_the_valid_ones(tmp_path: Path) -> None:
    home = tmp_path / "a"
    _init(home, "alice-pc")
    _one_line_error(
        gpumesh(home, "config", "set", "job_network", "host"),
        ExitCode.USAGE,
        "invalid value 'host': use one of internet, lan, bridge, none",
    )
