"""`gpumesh exec` as a user types it: through a real pseudo-terminal, against a
real `gpumesh share` process and the real Docker engine.

The terminal tests start the CLI as the session leader of a new pty (its
controlling terminal), so resizing the pty sends it SIGWINCH and closing it
sends SIGHUP, exactly as a terminal window does.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import msgspec
import pytest

from gpumesh.agent.server import Agent
from gpumesh.client.node import Node
from gpumesh.errors import LimitError
from gpumesh.protocol.messages import ExecStart, ExecStarted
from gpumesh.runtime.base import KIND_EXEC, LABEL_KIND, LABEL_NODE, LABEL_PEER
from gpumesh.runtime.jobnet import names_for
from tests.integration.conftest import arun, gpumesh, pair_both, until
from tests.integration.node import status, wait_shares
from tests.integration.test_cli import _free_udp_port, _init, _one_line_error, _start_share
from tests.jobnet_lab import SESSION_PREFIX, network_host_config

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")

# Make the pty the CLI's controlling terminal, then become the CLI.
_WITH_TERMINAL = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-m', 'gpumesh', *sys.argv[1:]])"
)


class Nodes:
    def __init__(self, alice: Path, bob: Path, share: subprocess.Popen[str]) -> None:
        self.alice = alice
        self.bob = bob
        self.share = share
        self.alice_id = json.loads(gpumesh(alice, "status", "--json").stdout)["node_id"]
        self.bob_id = json.loads(gpumesh(bob, "status", "--json").stdout)["node_id"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    """alice-pc shares (a real process); bob-laptop is paired with her both ways.

    One pair for the module: every test leaves it as it found it."""
    root = tmp_path_factory.mktemp("exec")
    alice, bob = root / "a", root / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop")
    for home in (alice, bob):
        assert gpumesh(home, "config", "set", "image", IMAGE).returncode == 0
    assert gpumesh(alice, "config", "set", "job_memory", "256MB").returncode == 0
    share = _start_share(alice)
    assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
    assert gpumesh(alice, "pair", gpumesh(bob, "pair-code").stdout.strip()).returncode == 0
    made = Nodes(alice, bob, share)
    yield made
    if share.poll() is None:
        share.send_signal(signal.SIGINT)
        share.wait(timeout=15)
    for pipe in (share.stdout, share.stderr):
        if pipe is not None:
            pipe.close()
    with contextlib.suppress(docker.errors.DockerException):
        client = docker.from_env()
        for container in client.containers.list(
            all=True, filters={"label": f"{LABEL_NODE}={made.alice_id}"}
        ):
            container.remove(force=True)
        client.close()


def _shells(engine: docker.DockerClient, node_id: str) -> list[str]:
    """Ids of the node's containers (a plain listing: nothing inspected, so no race
    with a removal in progress)."""
    found = engine.api.containers(all=True, filters={"label": f"{LABEL_NODE}={node_id}"})
    return [str(summary["Id"]) for summary in found]


def _exec(home: Path, *args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    """`gpumesh exec ARGS` without a terminal, ``stdin`` piped in."""
    return subprocess.run(
        [sys.executable, "-m", "gpumesh", "exec", *args],
        env=dict(os.environ, GPUMESH_HOME=str(home), **env),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _gone(engine: docker.DockerClient, node_id: str, within: float = 60.0) -> bool:
    deadline = time.monotonic() + within
    while _shells(engine, node_id):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class Terminal:
    """The CLI running in a real pseudo-terminal, driven from its master side."""

    def __init__(self, home: Path, *args: str, rows: int = 24, cols: int = 80) -> None:
        self.master, slave = os.openpty()
        self.slave_name = os.ttyname(slave)
        self.resize(rows, cols)
        env = dict(os.environ, GPUMESH_HOME=str(home))
        env.pop("GPUMESH_LOG", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WITH_TERMINAL, *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
        )
        os.close(slave)
        self.seen = bytearray()
        self._mark = 0

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def _pump(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the CLI is gone
            data = b""
        self.seen += data
        return bool(data)

    def expect(self, needle: bytes, timeout: float = 15.0) -> None:
        """Wait for ``needle`` in the output after the previous match."""
        deadline = time.monotonic() + timeout
        while needle not in self.seen[self._mark :]:
            left = deadline - time.monotonic()
            if left <= 0 or not self._pump(left):
                raise AssertionError(f"{needle!r} not seen; the terminal shows {self.tail()!r}")
        self._mark = self.seen.index(needle, self._mark) + len(needle)

    def interrupt(self, prompt: bytes = b"$ ", tries: int = 30) -> None:
        """Ctrl-C until the shell's prompt is back. A Ctrl-C typed before the
        program has started (the shell still reads the line raw) is type-ahead,
        not a signal, so one press alone could wait out the program."""
        for attempt in range(tries):
            self.send("\x03")
            try:
                self.expect(prompt, timeout=1.0)
                return
            except AssertionError:
                if attempt == tries - 1:
                    raise

    def tail(self) -> bytes:
        return bytes(self.seen[-1500:])

    def wait(self, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, self.tail()
            self._pump(0.1)  # keep reading, or a full pty would block the CLI
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            os.close(self.master)


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    made: list[Terminal] = []
    yield made
    for terminal in made:
        terminal.close()


def test_interactive_shell_through_a_real_terminal(nodes: Nodes, engine, terminals) -> None:
    shell = Terminal(nodes.bob, "exec", "alice-pc", rows=30, cols=100)
    terminals.append(shell)
    shell.expect(b"$ ")  # the remote prompt: not root's
    shell.send("echo $((6 * 7))-answer\r")  # the echoed line does not contain the result
    shell.expect(b"42-answer")
    # Root inside a shell is not root on the host: the shell runs as the job user.
    expected = 47000 if os.geteuid() == 0 else os.geteuid()
    shell.send("echo uid=$(id -u)-home=$HOME\r")
    shell.expect(f"uid={expected}-home=/home/gpumesh".encode())

    # The window size at start, then after the local window changes (SIGWINCH).
    shell.send("busybox stty size\r")
    shell.expect(b"30 100")
    shell.resize(40, 120)
    for attempt in range(20):
        shell.send("busybox stty size\r")
        try:
            shell.expect(b"40 120", timeout=0.5)
            break
        except AssertionError:
            assert attempt < 19, "the remote terminal never got the new size"

    # The lockdown, from outside and from inside.
    (container_id,) = _shells(engine, nodes.alice_id)
    attrs = engine.api.inspect_container(container_id)
    host = attrs["HostConfig"]
    assert host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["PidsLimit"] == 1024
    assert host["Memory"] == host["MemorySwap"] == 256 * 1000**2
    assert not host.get("Binds")
    assert not attrs["Mounts"]
    network = network_host_config(engine.api, container_id)
    assert network["NetworkMode"] == names_for("internet", SESSION_PREFIX).network
    assert network["Sysctls"] == {"net.ipv6.conf.all.disable_ipv6": "1"}
    assert host["LogConfig"]["Type"] == "none"
    assert attrs["Config"]["Tty"] is True
    assert "NVIDIA_VISIBLE_DEVICES=void" in attrs["Config"]["Env"]
    labels = attrs["Config"]["Labels"]
    assert labels[LABEL_KIND] == KIND_EXEC
    assert labels[LABEL_PEER] == nodes.bob_id
    shell.send("grep CapEff /proc/self/status\r")
    shell.expect(b"CapEff:\t0000000000000000")

    # Ctrl-C interrupts the program in the shell, not the shell or gpumesh. It is
    # sent once the line runs (its first output seen): a ^C that reached the shell
    # while it still edited the line would only clear the line, not stop the sleep.
    shell.send("echo go; sleep 30\r")
    shell.expect(b"\ngo\r\n")
    interrupted = time.monotonic()
    shell.interrupt()
    shell.send("echo still-$((1 + 1))\r")
    shell.expect(b"still-2", timeout=10)
    assert time.monotonic() - interrupted < 25  # well before the 30 s sleep would have ended

    shell.send("exit 5\r")
    assert shell.wait() == 5
    assert _gone(engine, nodes.alice_id)
    # The local terminal is out of raw mode again.
    fd = os.open(shell.slave_name, os.O_RDWR | os.O_NOCTTY)
    try:
        lflag = termios.tcgetattr(fd)[3]
    finally:
        os.close(fd)
    assert lflag & termios.ICANON and lflag & termios.ECHO and lflag & termios.ISIG


def test_without_a_terminal_stdin_is_piped_through(nodes: Nodes, engine) -> None:
    result = _exec(nodes.bob, "alice-pc", "sh", stdin="echo hi; echo err >&2; exit 3\n")
    assert result.returncode == 3, result.stderr
    assert sorted(result.stdout.splitlines()) == ["err", "hi"]  # merged, without a terminal
    assert result.stderr == ""
    # More than one flow-control window each way (8 MiB): credit is returned.
    size = 12 * 1024 * 1024
    counted = subprocess.run(
        [sys.executable, "-m", "gpumesh", "exec", "alice-pc", "--", "wc", "-c"],
        env=dict(os.environ, GPUMESH_HOME=str(nodes.bob)),
        input=b"x" * size,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert counted.returncode == 0, counted.stderr
    assert counted.stdout.strip() == str(size).encode()
    produced = subprocess.run(
        [sys.executable, "-m", "gpumesh", "exec", "alice-pc", "head", "-c", str(size), "/dev/zero"],
        env=dict(os.environ, GPUMESH_HOME=str(nodes.bob)),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert produced.returncode == 0, produced.stderr
    assert produced.stdout == b"\0" * size
    assert _gone(engine, nodes.alice_id)


def test_a_command_missing_from_the_image_is_one_line_in_our_words(nodes: Nodes, engine) -> None:
    """`exec alice-pc bash`, a natural first try, printed tini's raw
    `[FATAL tini (6)] exec bash failed: ...` on images without bash."""
    result = _exec(nodes.bob, "alice-pc", "bash")
    assert result.returncode == 127, result.stderr
    said = f"gpumesh: bash: not found in image {IMAGE} (exit 127)"
    assert (result.stdout + result.stderr).splitlines() == [said]
    assert _gone(engine, nodes.alice_id)


def test_closing_the_terminal_removes_the_container(nodes: Nodes, engine, terminals) -> None:
    shell = Terminal(nodes.bob, "exec", "alice-pc")
    terminals.append(shell)
    shell.expect(b"$ ")
    assert len(_shells(engine, nodes.alice_id)) == 1
    os.close(shell.master)  # the window closes: SIGHUP
    assert shell.proc.wait(timeout=10) == 129
    assert _gone(engine, nodes.alice_id)


def test_revoking_access_ends_an_open_shell(nodes: Nodes, engine, terminals) -> None:
    shell = Terminal(nodes.bob, "exec", "alice-pc")
    terminals.append(shell)
    shell.expect(b"$ ")
    try:
        assert gpumesh(nodes.alice, "deny", "bob-laptop").returncode == 0
        assert shell.wait() == 3
        shell.expect(b"revoked your access")
        assert _gone(engine, nodes.alice_id)
    finally:
        assert gpumesh(nodes.alice, "allow", "bob-laptop").returncode == 0


def test_the_provider_removes_the_container_when_the_consumer_vanishes(make_node, engine) -> None:
    """A reset stream, a closed link, a stopping agent: the container goes each time."""
    alice, bob = make_node("alice"), make_node("bob")
    alice.home.config.set("job_memory", "256MB")
    alice.home.config.save()
    alice_id = alice.info().node_id
    start = ExecStart(image=IMAGE, command=["sh"], env={}, tty=True, rows=24, cols=80)

    async def scenario(node: Node) -> None:
        agent = Agent(alice.home, host="127.0.0.1", port=0)
        await agent.start()
        try:
            pair_both(alice, node)
            async with node.session("alice") as session:
                # The provider's own check, for consumers that skip the CLI's.
                gpu_env = msgspec.structs.replace(start, env={"NVIDIA_VISIBLE_DEVICES": "all"})
                with pytest.raises(LimitError, match="provider decides GPU access"):
                    await session.request(gpu_env)
                stream = session.open_stream()
                stream.send_message(start)
                await stream.expect(ExecStarted)
                assert len(_shells(engine, alice_id)) == 1
                stream.abort()
                await _await_gone(engine, alice_id)
                stream = session.open_stream()
                stream.send_message(start)
                await stream.expect(ExecStarted)
                assert len(_shells(engine, alice_id)) == 1
            await _await_gone(engine, alice_id)  # the session closed its link
            async with node.session("alice") as session:
                stream = session.open_stream()
                stream.send_message(start)
                await stream.expect(ExecStarted)
                agent.stop()  # `share` stopping: open shells go with it
                assert not _shells(engine, alice_id)
        finally:
            agent.stop()

    try:
        arun(scenario(bob))
    finally:
        for container_id in _shells(engine, alice_id):
            engine.api.remove_container(container_id, force=True)


async def _await_gone(engine: docker.DockerClient, node_id: str) -> None:
    import asyncio

    deadline = time.monotonic() + 10
    while _shells(engine, node_id):
        assert time.monotonic() < deadline, "the exec container was not removed"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--image", "no/such:image", "alice-pc"], 6, "not on alice-pc"),
        (["-e", "NVIDIA_VISIBLE_DEVICES=all", "alice-pc"], 2, "set by the provider"),
        (["-e", "NOEQUALS", "alice-pc"], 2, "NOEQUALS"),
        (["nobody"], 2, "nobody"),
    ],
    ids=["image", "nvidia-env", "env-syntax", "unknown-peer"],
)
def test_bad_exec_input_is_one_line_and_starts_nothing(
    nodes: Nodes, engine, args, code, message
) -> None:
    _one_line_error(_exec(nodes.bob, *args, "true"), code, message)
    assert not _shells(engine, nodes.alice_id)


def _warm(home: Path) -> list[object]:
    """The warm sessions of ``home``'s node process (none when none runs)."""
    node = status(home)["node"]
    return [] if node is None else list(node["warm_sessions"])


def test_denied_peer_gets_no_shell(nodes: Nodes, engine) -> None:
    assert gpumesh(nodes.alice, "deny", "bob-laptop").returncode == 0
    try:
        # alice closes bob's warm session at once; his node process drops it when the
        # close arrives (a shell that crossed it is told the access was revoked).
        until(lambda: not _warm(nodes.bob), "bob's node process to drop the denied session")
        _one_line_error(_exec(nodes.bob, "alice-pc", "true"), 3, "denied you access")
        assert not _shells(engine, nodes.alice_id)
    finally:
        assert gpumesh(nodes.alice, "allow", "bob-laptop").returncode == 0


def test_exec_on_a_peer_without_docker_says_so(nodes: Nodes, tmp_path: Path) -> None:
    carol = tmp_path / "c"
    _init(carol, "carol", _free_udp_port())
    share = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "share"],
        env=dict(
            os.environ, GPUMESH_HOME=str(carol), DOCKER_HOST="unix:///nonexistent/docker.sock"
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_shares(carol, share)
        assert (
            gpumesh(nodes.bob, "pair", gpumesh(carol, "pair-code").stdout.strip()).returncode == 0
        )
        assert (
            gpumesh(carol, "pair", gpumesh(nodes.bob, "pair-code").stdout.strip()).returncode == 0
        )
        # No PEER: $GPUMESH_PEER's, as wherever a peer is taken.
        no_docker = _exec(nodes.bob, GPUMESH_PEER="carol")
        _one_line_error(no_docker, 6, "Docker is not reachable on carol")
    finally:
        share.send_signal(signal.SIGINT)
        share.wait(timeout=15)
