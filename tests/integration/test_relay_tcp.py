"""gpumesh-relay over TCP with TLS, on loopback: a node that speaks the upgrade and
the framed relay packets over ``ssl`` meets a UDP node through a real relay, in
this process (``serve``) or as the command; and what strangers get: a 404, a
cut connection, a refused one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gpumesh.identity.keys import Identity, node_id_for
from gpumesh.protocol.addresses import Address
from gpumesh.protocol.relay import (
    MAX_PACKET,
    Accept,
    Challenge,
    Close,
    Connect,
    Connected,
    Incoming,
    KeepAlive,
    KeepAliveAck,
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
    register_payload,
    token_proof,
)
from gpumesh.protocol.relaystream import (
    HEAD_END,
    MAX_HEAD,
    NOT_FOUND,
    UPGRADED,
    Deframer,
    encode_frame,
    upgrade_request,
)
from gpumesh.relay.config import RelayConfig
from gpumesh.relay.server import RelayServer, serve
from gpumesh.relay.tcp import HEAD_TIMEOUT, self_signed_certificate
from tests.integration.test_relay_server import Client

T = TypeVar("T")

CEILING = 15.0
"""Seconds within which what must happen happens; generous, never a verdict on speed."""


# --- a relay in this process, on a thread of its own -----------------------------------------


class RelayThread:
    """``serve(config)`` on its own event loop, so the nodes below can be plain
    blocking sockets; :meth:`call` runs a function on the relay's loop."""

    def __init__(self, config: RelayConfig, head_timeout: float) -> None:
        self._config = config
        self._head_timeout = head_timeout
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._server: RelayServer | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._server = await serve(self._config, head_timeout=self._head_timeout)
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._ready.set()
        await self._stop.wait()
        self._server.close()
        await self._server.wait_closed()

    def start(self) -> RelayThread:
        self._thread.start()
        assert self._ready.wait(CEILING), "the relay did not start"
        if self._failure is not None:
            raise self._failure
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(CEILING)
        assert not self._thread.is_alive(), "the relay did not stop"

    def call(self, function: Callable[[RelayServer], T]) -> T:
        assert self._loop is not None and self._server is not None
        server = self._server

        async def run() -> T:
            return function(server)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(CEILING)

    @property
    def udp(self) -> Address:
        return self.call(lambda server: server.address)

    @property
    def tcp(self) -> Address:
        address = self.call(lambda server: server.tcp_address)
        assert address is not None
        return address

    def stats(self) -> dict[str, Any]:
        return self.call(lambda server: server.stats())


@contextlib.contextmanager
def running_relay(
    nodes: list[Any], head_timeout: float = HEAD_TIMEOUT, **settings: Any
) -> Iterator[RelayThread]:
    """A relay on loopback, UDP and TCP; ``nodes`` are closed before it stops (else it
    would wait for their TLS goodbyes)."""
    settings.setdefault("open", True)
    config = RelayConfig(host="127.0.0.1", port=0, tcp_host="127.0.0.1", tcp_port=0, **settings)
    relay = RelayThread(config, head_timeout).start()
    try:
        yield relay
    finally:
        for node in nodes:
            node.close()
        relay.stop()


def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + CEILING
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        time.sleep(0.05)


# --- a node over TCP and TLS, made of plain ssl ----------------------------------------------


def _tls_client() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # as nodes: what matters is signed inside
    return context


class TcpNode:
    """One TLS connection to the relay, upgraded, speaking for one node key."""

    def __init__(
        self, relay: Address, identity: Identity | None = None, *, upgrade: bool = True
    ) -> None:
        self.identity = identity or Identity.generate()
        raw = socket.create_connection(relay, timeout=CEILING)
        try:
            self.sock = _tls_client().wrap_socket(raw, server_hostname="relay.example.org")
        except BaseException:
            raw.close()
            raise
        self.port: int = self.sock.getsockname()[1]
        self._deframer = Deframer()
        self._packets: deque[bytes] = deque()
        if upgrade:
            self.sock.sendall(upgrade_request("relay.example.org:443"))
            head, rest = self.read_head()
            assert head == UPGRADED, head
            self._packets += self._deframer.feed(rest)

    @property
    def key(self) -> bytes:
        return self.identity.public_key

    @property
    def observed(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.sock.close()

    def read_head(self) -> tuple[bytes, bytes]:
        data = b""
        while HEAD_END not in data:
            chunk = self.sock.recv(4096)
            assert chunk, f"closed before a whole head: {data!r}"
            data += chunk
        end = data.index(HEAD_END) + len(HEAD_END)
        return data[:end], data[end:]

    def send(self, message: RelayMessage) -> None:
        self.send_raw(encode_packet(message))

    def send_raw(self, packet: bytes) -> None:
        self.sock.sendall(encode_frame(packet))

    def receive(self, timeout: float = CEILING) -> Any:
        self.sock.settimeout(timeout)
        while not self._packets:
            data = self.sock.recv(65536)
            assert data, "the relay closed the connection"
            self._packets += self._deframer.feed(data)
        packet = self._packets.popleft()
        return decode_data(packet) if is_data(packet) else decode_packet(packet)

    def expect(self, kind: type) -> Any:
        message = self.receive()
        assert isinstance(message, kind), message
        return message

    def register(self, *, serving: bool = True, token: str = "") -> Any:
        self.send_raw(hello_packet())
        challenge = self.expect(Challenge)
        assert challenge.observed == self.observed
        signature = self.identity.sign(register_payload(challenge.nonce, self.key, serving))
        self.send(
            Register(
                public_key=self.key,
                nonce=challenge.nonce,
                signature=signature,
                token_proof=token_proof(token, challenge.nonce),
                serving=serving,
            )
        )
        return self.receive()

    def closed_by_relay(self) -> bytes:
        """What was left to read, once the relay has closed the connection."""
        return _until_closed(self.sock)


def _until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(CEILING)
    left = b""
    with contextlib.suppress(ConnectionResetError, ssl.SSLError, BrokenPipeError):
        while chunk := sock.recv(65536):
            left += chunk
    return left


@pytest.fixture
def nodes() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for node in made:
        node.close()


def _tcp(relay: RelayThread, nodes: list[Any], **options: Any) -> TcpNode:
    node = TcpNode(relay.tcp, **options)
    nodes.append(node)
    return node


def _udp(relay: RelayThread, nodes: list[Any]) -> Client:
    node = Client(relay.udp)
    nodes.append(node)
    return node


def _session(requester: TcpNode | Client, server: TcpNode | Client) -> int:
    assert isinstance(server.register(), Registered)
    assert isinstance(requester.register(serving=False), Registered)
    requester.send(Connect(request=5, peer=server.key, candidates=["192.0.2.1:47000"]))
    incoming = server.expect(Incoming)
    assert incoming.peer == requester.key
    server.send(Accept(session=incoming.session, candidates=["192.0.2.2:47000"]))
    connected = requester.expect(Connected)
    assert connected.session == incoming.session
    session: int = incoming.session
    return session


# --- a session across UDP and TCP -------------------------------------------------------------


def test_a_tcp_node_and_a_udp_node_share_a_session_byte_for_byte(nodes: list[Any]) -> None:
    with running_relay(nodes) as relay:
        server, requester = _udp(relay, nodes), _tcp(relay, nodes)
        assert isinstance(server.register(), Registered)
        registered = requester.register(serving=False)
        assert isinstance(registered, Registered) and registered.observed == requester.observed
        requester.send(Connect(request=5, peer=server.key, candidates=["192.0.2.1:47000"]))
        incoming = server.expect(Incoming)
        assert (incoming.peer, incoming.observed) == (requester.key, requester.observed)
        server.send(Accept(session=incoming.session, candidates=[]))
        session = requester.expect(Connected).session
        assert session == incoming.session

        sizes = [1, 2, 100, 1200, MAX_PACKET - 12]
        payloads = [os.urandom(size) for size in sizes]
        # Several frames in one write, crossing TLS records and reads.
        requester.sock.sendall(b"".join(encode_frame(encode_data(session, p)) for p in payloads))
        for payload in payloads:
            assert server.receive() == ((session, payload), relay.udp)
        for payload in payloads:
            server.send_raw(encode_data(session, payload))
        for payload in payloads:
            assert requester.receive() == (session, payload)

        stats = relay.stats()
        assert stats["tcp_connections"] == 1
        assert stats["listen_tcp"] == f"127.0.0.1:{relay.tcp[1]}"
        assert stats["bytes_relayed"] == 2 * sum(sizes)
        [entry] = stats["sessions"]
        assert entry["a"] == node_id_for(requester.key) and entry["b"] == node_id_for(server.key)


def test_two_tcp_nodes_share_a_session(nodes: list[Any]) -> None:
    with running_relay(nodes) as relay:
        server, requester = _tcp(relay, nodes), _tcp(relay, nodes)
        session = _session(requester, server)
        requester.send_raw(encode_data(session, b"\xc0ping"))
        assert server.receive() == (session, b"\xc0ping")
        server.send_raw(encode_data(session, b"\x40pong"))
        assert requester.receive() == (session, b"\x40pong")


def test_a_closed_tcp_connection_ends_its_session_at_the_udp_end(nodes: list[Any]) -> None:
    with running_relay(nodes) as relay:
        server, requester = _udp(relay, nodes), _tcp(relay, nodes)
        session = _session(requester, server)
        requester.close()
        close = server.expect(Close)
        assert (close.session, close.code) == (session, "closed")
        eventually(lambda: relay.stats()["tcp_connections"] == 0, "the connection is let go")
        stats = relay.stats()
        assert stats["registrations"] == 1 and stats["sessions"] == []
        assert stats["closes"] == {"closed": 1}


def test_stopping_the_relay_says_goodbye_over_tcp_then_closes(nodes: list[Any]) -> None:
    with running_relay(nodes) as relay:
        server, requester = _tcp(relay, nodes), _udp(relay, nodes)
        session = _session(requester, server)
        relay.stop()
        for end in (server, requester):
            close = end.expect(Close)
            assert (close.session, close.code) == (session, "shutting-down")
        assert server.closed_by_relay() == b""


def test_the_stats_file_counts_tcp_connections(tmp_path: Path, nodes: list[Any]) -> None:
    stats_file = tmp_path / "stats.json"

    def written() -> dict[str, Any]:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            stats: dict[str, Any] = json.loads(stats_file.read_text())
            return stats
        return {}

    with running_relay(nodes, stats_file=stats_file) as relay:
        eventually(lambda: written().get("listen_tcp") == f"127.0.0.1:{relay.tcp[1]}", "listed")
        _tcp(relay, nodes, upgrade=False)  # open, not registered: the core never hears of it
        eventually(lambda: written().get("tcp_connections") == 1, "the connection counted")
        nodes.pop().close()
        eventually(lambda: written().get("tcp_connections") == 0, "and let go")


def test_packets_for_a_connection_that_does_not_read_are_dropped_and_counted(
    nodes: list[Any],
) -> None:
    with running_relay(nodes, queue=4) as relay:
        server, requester = _tcp(relay, nodes), _udp(relay, nodes)
        server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        session = _session(requester, server)
        packet = encode_data(session, bytes(1200))
        deadline = time.monotonic() + CEILING
        while relay.stats()["dropped_queue_full"] == 0:  # the server end reads nothing
            assert time.monotonic() < deadline, relay.stats()
            for _ in range(200):
                requester.send_raw(packet)
            time.sleep(0.01)
        # Still open and still its session's end: it reads again and gets data.
        requester.send(KeepAlive(seq=1))
        assert requester.expect(KeepAliveAck).registered is True
        assert server.receive() == (session, bytes(1200))


# --- access and limits, as over UDP -----------------------------------------------------------


def test_a_node_off_the_allowlist_is_refused_over_tcp(nodes: list[Any]) -> None:
    friend = Identity.generate()
    with running_relay(
        nodes, open=False, allow=frozenset({node_id_for(friend.public_key)})
    ) as relay:
        stranger = _tcp(relay, nodes)
        refused = stranger.register()
        assert isinstance(refused, Refused) and refused.code == "not-allowed"
        assert isinstance(_tcp(relay, nodes, identity=friend).register(), Registered)


def test_max_per_ip_counts_tcp_connections_and_registrations(nodes: list[Any]) -> None:
    with running_relay(nodes, max_per_ip=2) as relay:
        assert isinstance(_udp(relay, nodes).register(), Registered)
        assert isinstance(_tcp(relay, nodes).register(), Registered)
        # A second connection from the host is let in, but the host has two registrations.
        second = _tcp(relay, nodes)
        refused = second.register()
        assert isinstance(refused, Refused) and refused.code == "too-many-per-ip"
        # A third connection from the host is closed before any TLS.
        with pytest.raises((ConnectionError, ssl.SSLError, OSError)):
            TcpNode(relay.tcp).close()
        assert relay.stats()["tcp_connections"] == 2


def test_max_registrations_bounds_the_connections(nodes: list[Any]) -> None:
    with running_relay(nodes, max_registrations=2) as relay:
        _tcp(relay, nodes, upgrade=False)
        _tcp(relay, nodes, upgrade=False)
        with pytest.raises((ConnectionError, ssl.SSLError, OSError)):
            TcpNode(relay.tcp).close()
        assert relay.stats()["tcp_connections"] == 2


def test_an_upgraded_connection_that_never_registers_is_closed(nodes: list[Any]) -> None:
    with running_relay(nodes, keepalive=0.1, registration_timeout=0.5) as relay:
        silent = _tcp(relay, nodes)
        assert silent.closed_by_relay() == b""
        eventually(lambda: relay.stats()["tcp_connections"] == 0, "the slot is given back")


def test_a_registered_connection_that_keeps_alive_stays_open(nodes: list[Any]) -> None:
    with running_relay(nodes, keepalive=0.5, registration_timeout=2.0) as relay:
        node = _tcp(relay, nodes)
        assert isinstance(node.register(), Registered)
        started = time.monotonic()
        seq = 0
        while time.monotonic() - started < 3.0:  # past the timeout: it is looked at again
            seq += 1
            node.send(KeepAlive(seq=seq))
            assert node.expect(KeepAliveAck).registered is True
            time.sleep(0.1)
        assert relay.stats()["tcp_connections"] == 1


# --- what strangers get -----------------------------------------------------------------------


def test_anything_but_the_upgrade_gets_404_and_is_closed(nodes: list[Any]) -> None:
    with running_relay(nodes) as relay:
        for request in (
            b"GET / HTTP/1.1\r\nHost: relay.example.org\r\n\r\n",
            b"GET /gpumesh/relay HTTP/1.1\r\nHost: x\r\n\r\n",  # no Upgrade header
            b"X" * MAX_HEAD,  # a head that never ends
        ):
            browser = _tcp(relay, nodes, upgrade=False)
            browser.sock.sendall(request)
            answer = browser.closed_by_relay()
            assert answer == NOT_FOUND, answer
            browser.close()
        eventually(lambda: relay.stats()["tcp_connections"] == 0, "404s are let go")


def test_a_head_sent_with_the_last_of_the_tls_handshake_is_answered(nodes: list[Any]) -> None:
    """TLS 1.3 lets a client send data with its Finished: the head (and a first frame)
    may reach the relay before it has the TLS transport in hand."""
    with running_relay(nodes) as relay:
        sock = socket.create_connection(relay.tcp, timeout=CEILING)
        nodes.append(sock)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = _tls_client().wrap_bio(incoming, outgoing, server_hostname="relay.example.org")
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                incoming.write(sock.recv(65536))
        tls.write(upgrade_request("relay.example.org") + encode_frame(hello_packet()))
        sock.sendall(outgoing.read())  # Finished, the head and a Hello: one write
        received = b""
        packets: list[bytes] = []
        while not packets:
            incoming.write(sock.recv(65536))
            with contextlib.suppress(ssl.SSLWantReadError):
                while chunk := tls.read(65536):
                    received += chunk
            head, _, rest = received.partition(HEAD_END)
            packets = Deframer().feed(rest)
        assert head + HEAD_END == UPGRADED
        [challenge] = packets
        assert isinstance(decode_packet(challenge), Challenge)


def test_a_bad_frame_closes_the_connection(nodes: list[Any]) -> None:
    with running_relay(nodes) as relay:
        for frame in (struct.pack("!H", MAX_PACKET + 1) + bytes(64), struct.pack("!H", 0)):
            node = _tcp(relay, nodes)
            assert isinstance(node.register(), Registered)
            node.sock.sendall(frame)
            assert node.closed_by_relay() == b""
        eventually(lambda: relay.stats()["registrations"] == 0, "registrations go with them")


def test_strangers_who_say_nothing_are_cut_and_a_flood_is_refused(nodes: list[Any]) -> None:
    with running_relay(nodes, head_timeout=0.5, max_per_ip=4) as relay:
        # Plain HTTP where TLS is expected:
        plain = socket.create_connection(relay.tcp, timeout=CEILING)
        nodes.append(plain)
        plain.sendall(b"GET / HTTP/1.1\r\nHost: relay.example.org\r\n\r\n")
        assert _until_closed(plain) == b""
        # No TLS at all, TLS and then nothing, and a head sent a byte at a time.
        mute = socket.create_connection(relay.tcp, timeout=CEILING)
        nodes.append(mute)
        quiet = _tcp(relay, nodes, upgrade=False)
        slow = _tcp(relay, nodes, upgrade=False)
        started = time.monotonic()
        with contextlib.suppress(ConnectionError, ssl.SSLError, OSError):
            for byte in upgrade_request("relay.example.org"):
                slow.sock.sendall(bytes([byte]))
                time.sleep(0.05)
        assert _until_closed(mute) == b""
        assert quiet.closed_by_relay() == b""
        assert slow.closed_by_relay() == b""
        assert time.monotonic() - started < CEILING
        eventually(lambda: relay.stats()["tcp_connections"] == 0, "their slots are free")

    with running_relay(nodes, head_timeout=60.0, max_per_ip=4) as relay:
        held = [_tcp(relay, nodes, upgrade=False) for _ in range(4)]
        flood = [socket.create_connection(relay.tcp, timeout=CEILING) for _ in range(50)]
        nodes.extend(flood)
        for sock in flood:
            assert _until_closed(sock) == b""  # cut before any TLS
        assert relay.stats()["tcp_connections"] == 4
        held[0].close()
        eventually(lambda: relay.stats()["tcp_connections"] == 3, "a held one is let go")
        assert isinstance(_tcp(relay, nodes).register(), Registered)  # room again


# --- the command ------------------------------------------------------------------------------


def _command() -> list[str]:
    script = Path(sys.executable).parent / "gpumesh-relay"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "gpumesh.relay.main"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_command(), *args], capture_output=True, text=True, timeout=30, check=False
    )


@contextlib.contextmanager
def relay_process(tmp_path: Path, *args: str) -> Iterator[tuple[str, Address, Address]]:
    """gpumesh-relay with a TCP listener: its ready line, UDP and TCP addresses."""
    log = tmp_path / f"relay-{time.monotonic_ns()}.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [*_command(), "--listen", "127.0.0.1:0", "--tcp", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], CEILING)
        line = proc.stdout.readline().decode() if ready else ""
        assert line.startswith("gpumesh-relay listening on "), (line, log.read_text())
        words = line.split()
        assert words[4:6] == ["and", "tcp"], line
        udp_host, udp_port = words[3].rsplit(":", 1)
        tcp_host, tcp_port = words[6].rsplit(":", 1)
        yield line, (udp_host, int(udp_port)), (tcp_host, int(tcp_port))
        proc.send_signal(2)
        assert proc.wait(timeout=CEILING) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=CEILING)
        if proc.stdout is not None:
            proc.stdout.close()


def _peer_certificate(address: Address) -> x509.Certificate:
    with (
        socket.create_connection(address, timeout=CEILING) as raw,
        _tls_client().wrap_socket(raw, server_hostname="relay.example.org") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def test_the_command_serves_tcp_with_the_given_certificate_or_its_own(
    tmp_path: Path, nodes: list[Any]
) -> None:
    cert_pem, key_pem = self_signed_certificate()
    cert, key = tmp_path / "relay.crt", tmp_path / "relay.key"
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    given = x509.load_pem_x509_certificate(cert_pem)
    with relay_process(tmp_path, "--open", "--tls-cert", str(cert), "--tls-key", str(key)) as (
        line,
        udp,
        tcp,
    ):
        assert line.rstrip().endswith("(open: any node may register)")
        presented = _peer_certificate(tcp)
        assert presented.public_bytes(serialization.Encoding.DER) == given.public_bytes(
            serialization.Encoding.DER
        )
        server, requester = Client(udp), TcpNode(tcp)
        nodes += [server, requester]
        session = _session(requester, server)
        requester.send_raw(encode_data(session, b"\xc0through the command"))
        assert server.receive() == ((session, b"\xc0through the command"), udp)
    with relay_process(tmp_path, "--open") as (_, _, tcp):
        made = _peer_certificate(tcp)
        assert made.issuer == made.subject
        assert made.public_bytes(serialization.Encoding.DER) != given.public_bytes(
            serialization.Encoding.DER
        )


def test_bad_tcp_settings_are_one_line_errors(tmp_path: Path) -> None:
    cert, key = tmp_path / "relay.crt", tmp_path / "relay.key"
    cert_pem, key_pem = self_signed_certificate()
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    junk = tmp_path / "junk.pem"
    junk.write_text("junk\n")
    tcp = ("--open", "--listen", "127.0.0.1:0", "--tcp", "127.0.0.1:0")
    cases = [
        ([*tcp, "--tls-cert", str(cert)], "give both the TLS certificate and its key"),
        ([*tcp, "--tls-key", str(key)], "give both the TLS certificate and its key"),
        ([*tcp, "--tls-cert", str(tmp_path / "none.crt"), "--tls-key", str(key)], "cannot read"),
        ([*tcp, "--tls-cert", str(junk), "--tls-key", str(key)], "holds no PEM certificate"),
        (["--open", "--tcp", "127.0.0.1:https"], "--tcp: invalid listen address"),
        (["--open", "--tls-cert", str(cert), "--tls-key", str(key)], "give --tcp too"),
    ]
    for args, needle in cases:
        result = _cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith("error: ") and needle in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert result.stdout == ""


def test_a_taken_tcp_port_is_one_line_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _cli("--open", "--listen", "127.0.0.1:0", "--tcp", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: cannot listen on tcp 127.0.0.1:{port}: ")
    assert result.stderr.count("\n") == 1
