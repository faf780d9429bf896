"""Latency of the first request to a peer, next to a plain TCP+TLS request.

What is measured: the wall time from "I want to ask peer alice something" to
"I have the answer" on a brand-new connection. For GPUMesh that is
``async with node.session("alice")`` (peer lookup, UDP dial, QUIC/TLS 1.3
handshake with the provider's key pinned, the mutual identity proof) plus one
``Ping``/``Pong`` request on a new stream, until the close is sent. For the
baseline it is what a user would otherwise do: open a fresh TCP connection,
do a TLS 1.3 handshake that verifies a pinned self-signed certificate, send a
small request, read the reply, start the close.

Why it is fair: both servers run in this one process and event loop on
127.0.0.1, both use a self-signed Ed25519 certificate by default (the key type
of GPUMesh nodes), neither resumes TLS sessions, and the two kinds of sample
are taken interleaved (alternating which goes first) so that noise on this
shared machine hits both alike. One untimed warm-up of each comes first and is
shown separately as the "cold" figure (imports, first-use caches).

Not a like-for-like protocol count: GPUMesh also proves the dialer's identity
(a signature over the TLS session, sent with the first request: no round trip
of its own); ``--mutual`` makes the TLS baseline authenticate the client with
a certificate too.

Round trips: on loopback they cost next to nothing and the figures are CPU.
``--rtt MS`` puts both behind an in-process proxy that holds every UDP
datagram (GPUMesh) and every TCP chunk (the baseline) MS/2 milliseconds each
way, so what a round trip costs shows: a first GPUMesh request takes two (the
QUIC handshake, then the proof with the request), TCP+TLS three (TCP, TLS, the
request), of which the proxy delays two: it accepts TCP itself, so the TCP
handshake crosses no delay and the baseline is shown one round trip short.
Bob's pairing code then names only the proxy's address.

The provider's per-IP connection rate limit (burst 20, then 5/s) would stall
the 21st back-to-back dial from 127.0.0.1 for a QUIC retransmission timeout,
which is a defence, not latency; the agent here gets a limiter sized to the run.
So is its allowance for connections from addresses not yet validated (burst
16, then 4/s), past which it asks each dial for a Retry round trip first, as
under a flood: ``--retry always`` measures GPUMesh with that round trip on
every connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import ipaddress
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from _benchlib import (
    Summary,
    exit_cleanly_on_sigterm,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from gpumesh.agent.ratelimit import ConnectionLimiter
from gpumesh.agent.server import Agent
from gpumesh.client.node import Node
from gpumesh.identity.codes import make_code
from gpumesh.protocol.messages import Ping, Pong
from gpumesh.store.home import Home

LOOPBACK = "127.0.0.1"
REQUEST = b"PING 0123456789abcdef\n"
REPLY = b"PONG 0123456789abcdef\n"


@dataclass
class Samples:
    gpumesh_total: list[float] = field(default_factory=list)
    gpumesh_open: list[float] = field(default_factory=list)
    tls_total: list[float] = field(default_factory=list)
    tls_open: list[float] = field(default_factory=list)


# --- the TLS baseline ------------------------------------------------------------------


def _self_signed(common_name: str, key_type: str) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) for 127.0.0.1."""
    key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
    if key_type == "ed25519":
        key = ed25519.Ed25519PrivateKey.generate()
        algorithm = None
    else:
        key = ec.generate_private_key(ec.SECP256R1())
        algorithm = hashes.SHA256()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(LOOPBACK))]),
            critical=False,
        )
        .sign(key, algorithm)
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _load_chain(context: ssl.SSLContext, tmp: Path, label: str, cert: bytes, key: bytes) -> None:
    # The ssl module loads certificates only from files.
    cert_path, key_path = tmp / f"{label}.crt", tmp / f"{label}.key"
    cert_path.write_bytes(cert)
    key_path.write_bytes(key)
    key_path.chmod(0o600)
    context.load_cert_chain(cert_path, key_path)


def tls_contexts(tmp: Path, key_type: str, mutual: bool) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts: TLS 1.3 only, each side pinning the other's certificate."""
    server_cert, server_key = _self_signed("bench-server", key_type)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_3
    _load_chain(server, tmp, "server", server_cert, server_key)
    client = ssl.create_default_context(cadata=server_cert.decode())
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    if mutual:
        client_cert, client_key = _self_signed("bench-client", key_type)
        _load_chain(client, tmp, "client", client_cert, client_key)
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_verify_locations(cadata=client_cert.decode())
    return server, client


async def _serve_tls_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while await reader.readline() == REQUEST:
            writer.write(REPLY)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def tls_request(port: int, context: ssl.SSLContext) -> tuple[float, float]:
    """One fresh TLS connection with one request; (open seconds, total seconds)."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(LOOPBACK, port, ssl=context)
    opened = time.perf_counter()
    writer.write(REQUEST)
    reply = await reader.readline()
    writer.close()
    total = time.perf_counter() - started
    if reply != REPLY:
        raise RuntimeError(f"TLS server answered {reply!r}")
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        await writer.wait_closed()
    return opened - started, total


# --- a link with a delay ------------------------------------------------------------------


class _UdpDelayUpstream(asyncio.DatagramProtocol):
    """The proxy's socket towards the server for one client: answers go back delayed."""

    def __init__(self, front: asyncio.DatagramTransport, client: Any, delay: float) -> None:
        self.front, self.client, self.delay = front, client, delay

    def datagram_received(self, data: bytes, addr: Any) -> None:
        asyncio.get_running_loop().call_later(self.delay, self.front.sendto, data, self.client)


class UdpDelay(asyncio.DatagramProtocol):
    """Forward datagrams to ``server``, each held ``delay`` seconds, both ways."""

    def __init__(self, server: tuple[str, int], delay: float) -> None:
        self.server, self.delay = server, delay
        self.front: asyncio.DatagramTransport | None = None
        self.upstreams: dict[Any, asyncio.DatagramTransport] = {}
        self.pending: dict[Any, list[bytes]] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.front = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        asyncio.get_running_loop().call_later(self.delay, self._forward, data, addr)

    def _forward(self, data: bytes, client: Any) -> None:
        upstream = self.upstreams.get(client)
        if upstream is not None:
            upstream.sendto(data)
        elif client in self.pending:
            self.pending[client].append(data)
        else:
            self.pending[client] = [data]
            task = asyncio.ensure_future(self._open(client))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _open(self, client: Any) -> None:
        assert self.front is not None
        front = self.front
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _UdpDelayUpstream(front, client, self.delay), remote_addr=self.server
        )
        self.upstreams[client] = transport
        for data in self.pending.pop(client):
            transport.sendto(data)

    def close(self) -> None:
        for transport in self.upstreams.values():
            transport.close()
        if self.front is not None:
            self.front.close()


async def udp_delay(server: tuple[str, int], delay: float) -> tuple[UdpDelay, int]:
    """A UdpDelay on an ephemeral loopback port; (proxy, port)."""
    proxy = UdpDelay(server, delay)
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: proxy, local_addr=(LOOPBACK, 0)
    )
    return proxy, int(transport.get_extra_info("sockname")[1])


async def tcp_delay(server_port: int, delay: float) -> asyncio.Server:
    """A TCP proxy to ``server_port`` that holds every chunk ``delay`` seconds each way."""
    loop = asyncio.get_running_loop()

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                loop.call_later(delay, writer.write, chunk)
        loop.call_later(delay, writer.close)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(LOOPBACK, server_port)
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    return await asyncio.start_server(serve, LOOPBACK, 0)


# --- GPUMesh -----------------------------------------------------------------------------


async def gpumesh_request(node: Node, peer: str) -> tuple[float, float]:
    """One fresh authenticated session with one Ping; (open seconds, total seconds)."""
    started = time.perf_counter()
    async with node.session(peer) as session:
        opened = time.perf_counter()
        reply = await session.request(Ping(sent=time.time()))
    total = time.perf_counter() - started
    if not isinstance(reply, Pong):
        raise RuntimeError(f"{peer} answered Ping with {type(reply).__name__}")
    return opened - started, total


def make_nodes(tmp: Path) -> tuple[Node, Node]:
    """alice (the provider) and bob (the dialer), initialized in ``tmp``."""
    alice = Node(tmp / "a")
    alice.init("alice")
    # Advertise only the address the agent below listens on.
    config = alice.home.config
    config.set("listen_host", LOOPBACK)
    # A closed connection stays open on the provider for QUIC's draining period
    # (three probe timeouts), so back-to-back dials would meet max_links_per_peer:
    # a defence, not latency.
    config.set("max_links_per_peer", "0")
    config.save()
    alice.home.reload_config()
    bob = Node(tmp / "b")
    bob.init("bob")
    return alice, bob


# --- the run -------------------------------------------------------------------------------


async def measure(args: argparse.Namespace, tmp: Path) -> tuple[Samples, tuple[float, float]]:
    alice, bob = make_nodes(tmp)
    # Sized to the run: see the module docstring.
    sized = args.count + 10
    limiter = ConnectionLimiter(
        rate=1000.0,
        burst=sized,
        quiet_rate=1000.0,
        quiet_burst=0 if args.retry == "always" else sized,
    )
    agent_home = Home(tmp / "a")
    agent = Agent(agent_home, host=LOOPBACK, port=0, limiter=limiter)
    server: asyncio.Server | None = None
    udp_proxy: UdpDelay | None = None
    tcp_proxy: asyncio.Server | None = None
    delay = args.rtt / 2000
    try:
        # Started first, so alice's pairing code carries the port it really got.
        await agent.start()
        if delay:
            udp_proxy, proxy_port = await udp_delay(agent.address, delay)
            bob.pair(make_code(alice.home.identity, "alice", [f"{LOOPBACK}:{proxy_port}"], ""))
        else:
            bob.pair(alice.pairing_code())
        alice.pair(bob.pairing_code())

        server_ctx, client_ctx = tls_contexts(tmp, args.tls_key, args.mutual)
        server = await asyncio.start_server(_serve_tls_client, LOOPBACK, 0, ssl=server_ctx)
        tls_port = server.sockets[0].getsockname()[1]
        if delay:
            tcp_proxy = await tcp_delay(tls_port, delay)
            tls_port = tcp_proxy.sockets[0].getsockname()[1]

        cold = (
            (await gpumesh_request(bob, "alice"))[1],
            (await tls_request(tls_port, client_ctx))[1],
        )
        samples = Samples()
        for index in range(args.count):
            order = ("gpumesh", "tls") if index % 2 == 0 else ("tls", "gpumesh")
            for kind in order:
                if kind == "gpumesh":
                    opened, total = await gpumesh_request(bob, "alice")
                    samples.gpumesh_open.append(opened)
                    samples.gpumesh_total.append(total)
                else:
                    opened, total = await tls_request(tls_port, client_ctx)
                    samples.tls_open.append(opened)
                    samples.tls_total.append(total)
        return samples, cold
    finally:
        for listening in (tcp_proxy, server):
            if listening is not None:
                listening.close()
                await listening.wait_closed()
        if udp_proxy is not None:
            udp_proxy.close()
        agent.stop()
        agent_home.close()
        alice.close()
        bob.close()


def _ms(summary: Summary) -> list[str]:
    return [f"{summary.p50 * 1e3:.2f}", f"{summary.p90 * 1e3:.2f}", f"{summary.low * 1e3:.2f}"]


def report(args: argparse.Namespace, samples: Samples, cold: tuple[float, float]) -> None:
    g_total, g_open = summarize(samples.gpumesh_total), summarize(samples.gpumesh_open)
    t_total, t_open = summarize(samples.tls_total), summarize(samples.tls_open)
    tls_name = f"TCP+TLS 1.3 ({args.tls_key}{', mutual' if args.mutual else ''})"
    print(
        f"First request on a fresh connection: {args.count} of each, interleaved, "
        + ("loopback" if not args.rtt else f"loopback behind a {args.rtt:g} ms round trip")
        + ", one process and event loop"
        + (", a Retry round trip on every GPUMesh dial" if args.retry == "always" else "")
    )
    print_rows(
        ["", "p50 ms", "p90 ms", "min ms"],
        [
            ["GPUMesh: session + Ping", *_ms(g_total)],
            ["  of which session open", *_ms(g_open)],
            [f"{tls_name}: connect + request", *_ms(t_total)],
            ["  of which connect + handshake", *_ms(t_open)],
        ],
    )
    print(
        f"  ratio GPUMesh / TLS: p50 {g_total.p50 / t_total.p50:.2f}x, "
        f"p90 {g_total.p90 / t_total.p90:.2f}x"
    )
    print(
        f"  cold (first of each in this process, not in the figures above): "
        f"GPUMesh {cold[0] * 1e3:.1f} ms, TLS {cold[1] * 1e3:.1f} ms"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time GPUMesh's first request to a peer (dial, QUIC/TLS handshake, "
        "identity proof, one Ping) next to a fresh TCP+TLS request, in one run.",
    )
    parser.add_argument(
        "--count", type=int, default=50, help="fresh connections of each kind (default 50)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 of each")
    parser.add_argument(
        "--tls-key",
        choices=["ed25519", "p256"],
        default="ed25519",
        help="key type of the TLS baseline's certificates (default ed25519, as GPUMesh's)",
    )
    parser.add_argument(
        "--retry",
        choices=["never", "always"],
        default="never",
        help="whether the agent asks every dial to validate its address with a QUIC Retry "
        "first, as it does under a flood (default never, as when quiet)",
    )
    parser.add_argument(
        "--rtt",
        type=float,
        default=0.0,
        metavar="MS",
        help="hold every packet MS/2 milliseconds each way (an in-process proxy), so round "
        "trips show (default 0: plain loopback)",
    )
    parser.add_argument(
        "--mutual",
        action="store_true",
        help="the TLS baseline also authenticates the client with a certificate",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.count = 10
    if args.count < 2:
        parser.error("--count must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    try:
        with tempfile.TemporaryDirectory(prefix="gpumesh-bench-") as tmp:
            samples, cold = asyncio.run(measure(args, Path(tmp)))
    except KeyboardInterrupt:
        return interrupted()
    report(args, samples, cold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
