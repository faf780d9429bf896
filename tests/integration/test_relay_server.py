"""gpumesh-relay as a real process on loopback UDP, driven by small clients
that speak the relay codec: registration, access, forwarding, caps, the
probe port, the stats file, shutdown and restart, and the CLI's errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.identity.keys import Identity, node_id_for
from gpumesh.protocol.addresses import Address
from gpumesh.protocol.relay import (
    Accept,
    Challenge,
    Close,
    Connect,
    Connected,
    Hello,
    Incoming,
    KeepAlive,
    KeepAliveAck,
    ReachProbe,
    ReachTest,
    Refused,
    Register,
    Registered,
    RelayMessage,
    decode_data,
    decode_packet,
    encode_data,
    encode_packet,
    hello_packet,
    is_data,
    keepalive_packet,
    register_payload,
    token_proof,
)

PRIVATE_LINE = (
    "error: the relay is private by default: give --allow NODE_ID, --allow-file FILE or "
    "--token-file FILE (or --open to serve anyone)"
)


def _command() -> list[str]:
    script = Path(sys.executable).parent / "gpumesh-relay"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "gpumesh.relay.main"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_command(), *args], capture_output=True, text=True, timeout=30, check=False
    )


class RelayProcess:
    def __init__(self, proc: subprocess.Popen[bytes], address: Address, log: Path) -> None:
        self.proc = proc
        self.address = address
        self.log = log

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=10)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@contextlib.contextmanager
def relay(tmp_path: Path, *args: str, listen: str = "127.0.0.1:0") -> Iterator[RelayProcess]:
    """Start gpumesh-relay, wait for its listening line, and always stop it."""
    log = tmp_path / f"relay-{time.monotonic_ns()}.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [*_command(), "--listen", listen, *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env={k: v for k, v in os.environ.items() if k != "GPUMESH_LOG"},
        )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        line = proc.stdout.readline().decode() if ready else ""
        assert line.startswith("gpumesh-relay listening on "), (line, log.read_text())
        host, port = line.split()[3].rsplit(":", 1)
        running = RelayProcess(proc, (host, int(port)), log)
        yield running
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


class Client:
    """One UDP socket on loopback, speaking for one node key."""

    def __init__(self, relay_address: Address, identity: Identity | None = None) -> None:
        self.relay = relay_address
        self.identity = identity or Identity.generate()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address: Address = self.sock.getsockname()

    @property
    def key(self) -> bytes:
        return self.identity.public_key

    def close(self) -> None:
        self.sock.close()

    def send(self, message: RelayMessage) -> None:
        self.sock.sendto(encode_packet(message), self.relay)

    def send_raw(self, packet: bytes) -> None:
        self.sock.sendto(packet, self.relay)

    def receive(self, timeout: float = 5.0) -> tuple[Any, Address]:
        self.sock.settimeout(timeout)
        packet, source = self.sock.recvfrom(2048)
        return (decode_data(packet) if is_data(packet) else decode_packet(packet)), source

    def expect(self, kind: type, timeout: float = 5.0) -> Any:
        message, source = self.receive(timeout)
        assert isinstance(message, kind), message
        assert source == self.relay
        return message

    def nothing(self, within: float = 0.4) -> None:
        self.sock.settimeout(within)
        with pytest.raises(TimeoutError):
            packet = self.sock.recvfrom(2048)
            pytest.fail(f"unexpected packet {packet!r}")

    def register(self, *, serving: bool = True, token: str = "", key: bytes | None = None) -> Any:
        self.send_raw(hello_packet())
        challenge = self.expect(Challenge)
        assert challenge.observed == f"127.0.0.1:{self.address[1]}"
        public_key = key or self.key
        signature = self.identity.sign(register_payload(challenge.nonce, public_key, serving))
        self.send(
            Register(
                public_key=public_key,
                nonce=challenge.nonce,
                signature=signature,
                token_proof=token_proof(token, challenge.nonce),
                serving=serving,
            )
        )
        message, _ = self.receive()
        return message


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    for client in made:
        client.close()


def _stats(path: Path, wait_for: Any = None, timeout: float = 5.0) -> dict[str, Any]:
    """The stats file, once ``wait_for(stats)`` holds (it is written once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            stats: dict[str, Any] = json.loads(path.read_text())
            if wait_for is None or wait_for(stats):
                return stats
        if time.monotonic() > deadline:
            pytest.fail(f"stats never matched: {path.read_text() if path.exists() else None}")
        time.sleep(0.1)


def _session(relay_address: Address, clients: list[Client], *args: Any) -> tuple[Any, ...]:
    server, requester = Client(relay_address), Client(relay_address)
    clients += [server, requester]
    assert isinstance(server.register(), Registered)
    assert isinstance(requester.register(serving=False), Registered)
    requester.send(Connect(request=5, peer=server.key, candidates=["192.0.2.1:47000"]))
    incoming = server.expect(Incoming)
    server.send(Accept(session=incoming.session, candidates=["192.0.2.2:47000"]))
    connected = requester.expect(Connected)
    assert connected.session == incoming.session
    return server, requester, incoming.session


# --- the command line ---------------------------------------------------------------------------


def test_private_by_default_refuses_to_start_with_one_line() -> None:
    result = _cli("--listen", "127.0.0.1:0")
    assert result.returncode == 2
    assert result.stderr.strip() == PRIVATE_LINE
    assert result.stdout == ""


def test_bad_settings_are_one_line_errors(tmp_path: Path) -> None:
    good = node_id_for(Identity.generate().public_key)
    allow = tmp_path / "nodes.txt"
    allow.write_text(f"{good}\nnot-a-node-id\n")
    cases = [
        (["--allow-file", str(allow)], "nodes.txt:2"),
        (["--allow-file", str(tmp_path / "missing")], "cannot read allow file"),
        (["--open", "--session-bytes", "lots"], "--session-bytes"),
        (["--open", "--no-such-flag"], "no-such-flag"),
    ]
    for args, needle in cases:
        result = _cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith("error: ") and needle in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_taken_port_is_one_line_error(tmp_path: Path) -> None:
    with relay(tmp_path, "--open") as running:
        host, port = running.address
        result = _cli("--open", "--listen", f"{host}:{port}")
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: cannot listen on udp {host}:{port}")
    assert result.stderr.count("\n") == 1


def test_help_has_examples_and_version() -> None:
    result = _cli("--help")
    assert result.returncode == 0
    for flag in (
        "--listen",
        "--allow-file",
        "--token-file",
        "--open",
        "--session-bytes",
        "--max-sessions-initiated",
        "--max-sessions-per-pair",
    ):
        assert flag in result.stdout
    assert "Examples:" in result.stdout
    version = _cli("--version")
    assert version.returncode == 0 and "gpumesh-relay" in version.stdout


# --- the relay at work --------------------------------------------------------------------------


def test_sessions_forward_only_between_their_ends(tmp_path: Path, clients: list[Client]) -> None:
    stats_file = tmp_path / "stats.json"
    with relay(tmp_path, "--open", "--stats-file", str(stats_file)) as running:
        server, requester, session = _session(running.address, clients)
        packet = encode_data(session, b"\xc0" + bytes(999))
        requester.send_raw(packet)
        assert server.receive() == ((session, b"\xc0" + bytes(999)), running.address)
        server.send_raw(encode_data(session, b"\x40pong"))
        assert requester.receive() == ((session, b"\x40pong"), running.address)

        intruder = Client(running.address)
        clients.append(intruder)
        assert isinstance(intruder.register(), Registered)
        intruder.send_raw(encode_data(session, b"\x40injected"))
        refused = intruder.expect(Refused)
        assert (refused.code, refused.session) == ("no-session", session)

        stranger = Client(running.address)
        clients.append(stranger)
        stranger.send_raw(encode_data(session, b"\x40spoofed" + bytes(40)))
        assert stranger.expect(Refused).code == "not-registered"
        server.nothing()
        requester.nothing()

        stats = _stats(stats_file, lambda s: s["bytes_relayed"] == 1005)
        assert stats["registrations"] == 3 and stats["sessions_opened"] == 1
        [entry] = stats["sessions"]
        assert entry["a"] == node_id_for(requester.key) and entry["b"] == node_id_for(server.key)
        assert (entry["id"], entry["state"], entry["bytes"]) == (session, "active", 1005)
        assert stats["refusals"] == {"no-session": 1, "not-registered": 1}
        assert stats["listen"] == f"{running.address[0]}:{running.address[1]}"
        # Every packet it wrote (the two it forwarded among them); none dropped.
        assert stats["packets_sent"] >= 2 and stats["dropped_queue_full"] == 0
        assert running.stop() == 0
    log = running.log.read_text()
    assert f"registered {node_id_for(server.key)}" in log
    assert f"session {session:x} opened" in log and "shutting-down, 1005 bytes relayed" in log


def test_private_relay_checks_allowlist_token_and_signature(
    tmp_path: Path, clients: list[Client]
) -> None:
    friend = Identity.generate()
    allow = tmp_path / "nodes.txt"
    allow.write_text(f"# friends\n{node_id_for(friend.public_key)}\n")
    token = tmp_path / "token.txt"
    token.write_text("correct horse\n")
    with relay(tmp_path, "--allow-file", str(allow), "--token-file", str(token)) as running:
        for _ in range(4):
            clients.append(Client(running.address))
        clients[0].identity = friend
        assert isinstance(clients[0].register(), Registered)
        assert isinstance(clients[1].register(token="correct horse"), Registered)
        assert clients[2].register(token="wrong").code == "not-allowed"
        # Signing with one key while claiming another:
        assert clients[3].register(key=friend.public_key).code == "bad-signature"


def test_byte_cap_closes_both_ends(tmp_path: Path, clients: list[Client]) -> None:
    with relay(tmp_path, "--open", "--session-bytes", "2KB") as running:
        server, requester, session = _session(running.address, clients)
        requester.send_raw(encode_data(session, bytes(1200)))
        assert server.receive()[0] == (session, bytes(1200))
        requester.send_raw(encode_data(session, bytes(1200)))  # would pass 2000
        for end in (server, requester):
            close = end.expect(Close)
            assert (close.session, close.code) == (session, "byte-cap")
        server.nothing(0.2)
        server.send_raw(encode_data(session, b"\x40late"))
        assert server.expect(Refused).code == "no-session"
        requester.nothing(0.2)


def test_per_ip_limit_and_garbage(tmp_path: Path, clients: list[Client]) -> None:
    with relay(tmp_path, "--open", "--max-per-ip", "2") as running:
        for _ in range(3):
            clients.append(Client(running.address))
        junk = Client(running.address)
        clients.append(junk)
        for packet in (b"", b"\x01GM", b"\xc3" + os.urandom(1300), os.urandom(1600), b"\x03GM\x01"):
            junk.send_raw(packet)
        junk.send_raw(encode_packet(ReachTest(seq=1))[:3])
        assert isinstance(clients[0].register(), Registered)
        assert isinstance(clients[1].register(), Registered)
        assert clients[2].register().code == "too-many-per-ip"
        junk.nothing(0.2)
        assert junk.register().code == "too-many-per-ip"  # still alive, still counting


def test_an_unregistered_address_never_gets_more_bytes_than_it_sent(
    tmp_path: Path, clients: list[Client]
) -> None:
    with relay(tmp_path, "--open") as running:
        server, _, session = _session(running.address, clients)
        cases = [
            encode_packet(KeepAlive(seq=1)),  # bare: nothing comes back
            keepalive_packet(2),
            encode_packet(Hello()),
            hello_packet(),
            encode_packet(Connect(request=3, peer=server.key, candidates=[])),
            encode_data(session, b"\x40"),
            encode_data(session, b"\x40" + bytes(40)),
            encode_packet(ReachTest(seq=4)),
            b"\x0dGM\x01",
        ]
        got: list[tuple[int, int]] = []
        for packet in cases:
            stranger = Client(running.address)  # a fresh address each: no throttle in the way
            clients.append(stranger)
            stranger.send_raw(packet)
            stranger.sock.settimeout(0.3)
            with contextlib.suppress(TimeoutError):
                while True:
                    answer, _ = stranger.sock.recvfrom(2048)
                    got.append((len(packet), len(answer)))
                    assert len(answer) <= len(packet), (packet[:8], answer)
        assert len(got) == 5, got  # the padded and the large ones are answered
        stranger = Client(running.address)
        clients.append(stranger)
        stranger.send_raw(keepalive_packet(7))
        ack = stranger.expect(KeepAliveAck)
        assert (ack.seq, ack.registered) == (7, False)


def test_one_node_cannot_take_all_of_anothers_sessions(
    tmp_path: Path, clients: list[Client]
) -> None:
    quotas = ("--max-sessions", "3", "--max-sessions-per-pair", "2")
    with relay(tmp_path, "--open", *quotas, "--max-sessions-initiated", "2") as running:
        c, a, b = (Client(running.address) for _ in range(3))
        clients += [c, a, b]
        assert isinstance(c.register(), Registered)
        for dialer in (a, b):
            assert isinstance(dialer.register(serving=False), Registered)

        def open_session(dialer: Client, request: int) -> None:
            dialer.send(Connect(request=request, peer=c.key, candidates=[]))
            incoming = c.expect(Incoming)
            assert incoming.peer == dialer.key
            c.send(Accept(session=incoming.session, candidates=[]))
            assert dialer.expect(Connected).request == request

        open_session(a, 1)
        open_session(a, 2)
        a.send(Connect(request=3, peer=c.key, candidates=[]))
        refused = a.expect(Refused)
        assert (refused.code, refused.session) == ("too-many-to-peer", 3)
        assert "too many relayed sessions open to that peer" in refused.message
        c.nothing(0.2)
        open_session(b, 1)  # c's last slot was not a's to take


def test_reach_probe_comes_from_another_port(tmp_path: Path, clients: list[Client]) -> None:
    with relay(tmp_path, "--open") as running:
        client = Client(running.address)
        clients.append(client)
        client.send(ReachTest(seq=9))
        probe, source = client.receive()
        assert probe == ReachProbe(seq=9)
        assert source[1] != running.address[1]


def test_the_probe_port_answers_a_padded_hello_from_itself_and_nothing_else(
    tmp_path: Path, clients: list[Client]
) -> None:
    with relay(tmp_path, "--open") as running:
        client = Client(running.address)
        clients.append(client)
        client.send_raw(hello_packet())
        challenge = client.expect(Challenge)
        probe_port = challenge.probe_port
        assert probe_port not in (0, running.address[1])
        second = (running.address[0], probe_port)
        client.sock.sendto(hello_packet(), second)
        answer, source = client.receive()
        assert source == second and isinstance(answer, Challenge)
        assert (answer.observed, answer.probe_port) == (challenge.observed, probe_port)
        for packet in (
            encode_packet(Hello()),  # unpadded
            encode_packet(ReachTest(seq=1)),
            keepalive_packet(1),
            encode_data(1, bytes(200)),
        ):
            client.sock.sendto(packet, second)
        client.nothing()
        # The main port still answers, from itself.
        client.send_raw(hello_packet())
        assert client.expect(Challenge).probe_port == probe_port


def test_shutdown_closes_sessions_and_a_restarted_relay_asks_to_register(
    tmp_path: Path, clients: list[Client]
) -> None:
    stats_file = tmp_path / "stats.json"
    with relay(tmp_path, "--open", "--stats-file", str(stats_file)) as first:
        server, requester, session = _session(first.address, clients)
        server.send(KeepAlive(seq=1))
        assert server.expect(KeepAliveAck).registered is True
        assert first.stop(signal.SIGINT) == 0
        for end in (server, requester):
            close = end.expect(Close)
            assert (close.session, close.code) == (session, "shutting-down")
    stats = json.loads(stats_file.read_text())
    assert stats["sessions"] == [] and stats["sessions_opened"] == 1
    port = first.address[1]
    with relay(tmp_path, "--open", listen=f"127.0.0.1:{port}") as second:
        server.send_raw(keepalive_packet(2))
        ack = server.expect(KeepAliveAck)
        assert (ack.seq, ack.registered) == (2, False)
        assert isinstance(server.register(), Registered)  # and it may register again
        server.send(KeepAlive(seq=3))
        assert server.expect(KeepAliveAck).registered is True
        assert second.stop() == 0


def test_serve_in_process(clients: list[Client]) -> None:
    from gpumesh.relay import RelayConfig, serve

    async def scenario() -> None:
        server = await serve(RelayConfig(host="127.0.0.1", port=0, open=True))
        try:
            client = Client(server.address)
            clients.append(client)
            loop = asyncio.get_running_loop()
            reply = await loop.run_in_executor(None, client.register)
            assert isinstance(reply, Registered)
            assert server.stats()["registrations"] == 1
        finally:
            server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(scenario(), 30))
