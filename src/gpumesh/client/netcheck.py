"""``gpumesh netcheck``: what the network between this machine and its relay lets through.

Everything is asked of the relay from plain UDP sockets (no QUIC, no
registration), and of its TCP listener through the relay-over-TCP client:

- **UDP**: padded Hellos to the relay's port, each answered by a Challenge; the
  round trip is the median of a few. A connected socket, so a port where
  nothing listens says so at once (ICMP) instead of after the timeout.
- **The NAT**: from one more socket, a Hello to the relay's port and one to its
  second port (the Challenge's ``probe_port``). The address the first Challenge
  names equal to this socket's own: no NAT. The same public address from both
  ports: the NAT maps independently of the destination (hole punching can
  work); two: it maps by destination ("symmetric": peers need the relay).
- **Inbound**: a ReachTest from that socket before it ever sent to the second
  port, which answers with a ReachProbe: it arrives only where unsolicited
  packets get in.
- **The path MTU**: Hellos padded to sizes bisected up to the relay's
  ``MAX_PACKET``, sent with the don't-fragment bit (Linux), each size from a
  socket of its own so that a late answer is never taken for another size's;
  a size the local interface refuses (``EMSGSIZE``) is too big at once.
- **TCP**: one round trip to the relay over TCP (``relay_tcp``, through
  ``HTTPS_PROXY`` when set).

It runs where it is called (the CLI's process, as doctor's relay check), and
never raises for what the network or a setting does: each path that fails is
a check whose one line says which step failed and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import statistics
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol
from urllib.parse import urlsplit

from gpumesh import platform
from gpumesh.client.checks import FAIL, OK, WARN, Check
from gpumesh.errors import GPUMeshError, ProtocolError, UnreachableError
from gpumesh.protocol import relay as wire
from gpumesh.protocol.addresses import Address, format_address, parse_address
from gpumesh.settings import env
from gpumesh.store.config import KEYS, Config
from gpumesh.transport.quicsetup import MAX_DATAGRAM
from gpumesh.transport.relaytcp import relay_tcp_round_trip, tcp_route
from gpumesh.transport.session import resolve_relay

__all__ = [
    "BY_DESTINATION",
    "INDEPENDENT",
    "NO_NAT",
    "TCP_FAILED",
    "TCP_NOT_TRIED",
    "TCP_OFF",
    "TCP_OK",
    "Mtu",
    "Netcheck",
    "TcpResult",
    "TcpRoundTrip",
    "UdpResult",
    "classify_mapping",
    "describe_inbound",
    "describe_nat",
    "netcheck",
    "probe_udp",
    "relay_settings",
    "sized_hello",
    "with_node",
]

UDP_TIMEOUT = 3.0
"""How long the relay's port has to answer a first Hello."""
TCP_TIMEOUT = 5.0
"""How long the round trip over TCP may take, connection and TLS included."""
SAMPLES = 5
"""Round trips measured over UDP (their median is reported)."""
HELLO_RETRY = 0.5
"""A Hello not answered this long is sent again (UDP loses packets)."""
RELAYED_PACKET = MAX_DATAGRAM + wire.DATA_HEADER
"""The largest packet a relayed QUIC session sends to the relay."""

NO_NAT = "none"
INDEPENDENT = "independent"
BY_DESTINATION = "by-destination"

_IP_MTU_DISCOVER = 10  # Linux's <linux/in.h>: set the don't-fragment bit, never fragment
_IP_PMTUDISC_DO = 2
_IP_UDP_HEADERS = 28
_RECEIVE = 2048


class TcpRoundTrip(Protocol):
    """One round trip with the relay over TCP, in seconds; raises a GPUMeshError whose
    message names the step that failed (connect, proxy CONNECT, TLS, upgrade...)."""

    def __call__(
        self, host: str, port: int, *, proxy: str | None, timeout: float
    ) -> Awaitable[float]: ...


@dataclass(frozen=True)
class UdpResult:
    """What the relay's two UDP ports said to this machine."""

    rtt: float
    """Seconds: the median of the round trips measured."""
    samples: int
    local: str
    """The NAT test's socket, by its own address towards the relay."""
    observed: str | None
    """That socket as the relay's port sees it; None: it got no answer."""
    probe_port: int
    """The relay's second port; 0: an older relay that has none to ask."""
    observed_second: str | None
    """The same socket as the second port sees it; None: no answer from there."""
    inbound: bool | None
    """Whether the second port's ReachProbe got in; None: not tested."""

    @property
    def mapping(self) -> str | None:
        """:data:`NO_NAT`, :data:`INDEPENDENT`, :data:`BY_DESTINATION`; None: not known."""
        return classify_mapping(self.local, self.observed, self.observed_second)


@dataclass(frozen=True)
class Mtu:
    payload: int | None
    """The largest UDP payload the relay answered; None: not measured."""
    capped: bool = False
    """``payload`` is the most the relay answers: the path may carry more."""
    why: str = ""
    """Why it was not measured."""


TCP_OK = "ok"
TCP_OFF = "off"
TCP_NOT_TRIED = "not-tried"
TCP_FAILED = "failed"


@dataclass(frozen=True)
class TcpResult:
    outcome: str
    """:data:`TCP_OK`, :data:`TCP_OFF` (``relay_tcp off``), :data:`TCP_NOT_TRIED` (a
    setting is missing or invalid) or :data:`TCP_FAILED`."""
    target: str | None = None
    """``host:port`` tried; None when none was."""
    rtt: float | None = None
    proxy: str | None = None
    """The proxy's ``host:port`` (never its credentials), when one was used."""
    error: str = ""
    """Why it failed, or why it was not tried."""


@dataclass(frozen=True)
class Netcheck:
    relay: str
    """The relay as configured (or given); empty: none."""
    relay_address: Address | None
    """Its IPv4 address and UDP port; None when it is not known."""
    udp: UdpResult | None
    """None when the relay did not answer over UDP (``checks`` says why)."""
    mtu: Mtu
    tcp: TcpResult
    setting_error: bool
    """No relay configured, or its address is invalid: nothing could be tried."""
    checks: list[Check]
    node_relay: str | None = None
    """What this home's running node process says of its relay (:func:`with_node`)."""

    @property
    def reachable(self) -> bool:
        """Whether the relay answered over any path."""
        return self.udp is not None or self.tcp.rtt is not None


# --- the whole check -------------------------------------------------------------------------


async def netcheck(
    relay: str,
    *,
    relay_tcp: str = "",
    proxy: str | None = None,
    timeout: float = UDP_TIMEOUT,
    tcp_timeout: float = TCP_TIMEOUT,
    tcp_round_trip: TcpRoundTrip = relay_tcp_round_trip,
) -> Netcheck:
    """Check every path to ``relay`` (``host[:port]``); ``relay_tcp``: ``HOST:PORT``,
    empty for the relay host's port 443, or ``off``; ``proxy``: an HTTPS proxy's URL;
    ``tcp_round_trip``: the TCP client (the relay-over-TCP transport's). Never raises
    for what the network or a setting does."""
    relay = relay.strip()
    tcp_task = asyncio.create_task(_tcp(relay, relay_tcp, proxy, tcp_timeout, tcp_round_trip))
    try:
        paths = await _udp_paths(relay, timeout)
        tcp = await tcp_task
    finally:
        tcp_task.cancel()
    udp = paths.udp
    checks = [paths.row]
    if udp is not None:
        checks += [nat_check(udp), inbound_check(udp), mtu_check(paths.mtu)]
    checks.append(tcp_check(tcp, udp_works=udp is not None))
    return Netcheck(relay, paths.address, udp, paths.mtu, tcp, paths.bad_setting, checks)


@dataclass(frozen=True)
class _UdpPaths:
    row: Check
    address: Address | None = None
    udp: UdpResult | None = None
    mtu: Mtu = Mtu(None, why="the relay does not answer over UDP")
    bad_setting: bool = False


async def _udp_paths(relay: str, timeout: float) -> _UdpPaths:
    """The UDP row, and what UDP found."""
    if not relay:
        fix = "gpumesh config set relay HOST:PORT, or gpumesh netcheck --relay HOST:PORT"
        return _UdpPaths(Check("udp", FAIL, "no relay configured", fix), bad_setting=True)
    try:
        parse_address(relay, wire.DEFAULT_RELAY_PORT)
        address = await resolve_relay(relay)
    except ValueError as exc:
        line = f"invalid relay address {relay!r}: {exc}"
        fix = "gpumesh config set relay HOST:PORT"
        return _UdpPaths(Check("udp", FAIL, line, fix), bad_setting=True)
    except GPUMeshError as exc:
        return _UdpPaths(Check("udp", FAIL, exc.message, "check the relay's name"))
    label = _label(relay, address)
    try:
        udp = await probe_udp(address, label, timeout=timeout)
    except UnreachableError as exc:
        fix = f"check that gpumesh-relay runs at {label} and that UDP to it is not blocked"
        return _UdpPaths(Check("udp", FAIL, exc.message, fix), address)
    if not udp.probe_port:
        mtu = Mtu(None, why="the relay is an older gpumesh-relay")
    else:
        mtu = await probe_mtu(address, udp.rtt)
    return _UdpPaths(udp_check(label, udp), address, udp, mtu)


def _label(relay: str, address: Address) -> str:
    text = format_address(address)
    return relay if relay == text else f"{relay} ({text})"


def relay_settings(config: Config) -> tuple[str, str]:
    """``(relay, relay_tcp)`` as set; one the environment sets to something invalid
    comes as that text, for :func:`netcheck` to say what is wrong with it."""

    def text(name: str) -> str:
        try:
            return str(config.get(name))
        except GPUMeshError:
            variable = KEYS[name].env
            return (env(variable) if variable else None) or ""

    return text("relay"), text("relay_tcp")


# --- UDP: round trips, the NAT, inbound packets ----------------------------------------------


async def probe_udp(
    address: Address, label: str = "", *, timeout: float = UDP_TIMEOUT
) -> UdpResult:
    """Ask the relay at ``address`` over UDP: round trips, the NAT's mapping, inbound
    packets. Raises UnreachableError, one line naming ``label``, when its port does
    not answer."""
    label = label or format_address(address)
    loop = asyncio.get_running_loop()
    try:
        with _udp_socket(connect=address) as main, _udp_socket() as free:
            rtts = await _round_trips(loop, main, label, timeout)
            rtt = statistics.median(rtts)
            local = format_address((main.getsockname()[0], free.getsockname()[1]))
            wait = min(timeout, max(1.0, 4 * rtt))
            first, inbound, second = await _nat(loop, free, address, rtt, wait)
    except OSError as exc:  # no route there, a broadcast address...
        raise UnreachableError(f"{label}: cannot send over UDP: {_why(exc)}") from None
    if first is None:
        return UdpResult(rtt, len(rtts), local, None, 0, None, None)
    return UdpResult(rtt, len(rtts), local, first.observed, first.probe_port, second, inbound)


async def _nat(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, relay: Address, rtt: float, wait: float
) -> tuple[wire.Challenge | None, bool | None, str | None]:
    """From ``sock`` (never used before): the relay port's Challenge, whether the second
    port's ReachProbe got in, and the address the second port sees (None: not known)."""
    seq = int.from_bytes(os.urandom(4), "big")

    def challenge_from(source: Address) -> Callable[[wire.RelayMessage, Address], bool]:
        return lambda message, at: isinstance(message, wire.Challenge) and at == source

    def reach_probe(message: wire.RelayMessage, at: Address) -> bool:
        return isinstance(message, wire.ReachProbe) and message.seq == seq

    hello = wire.hello_packet()
    try:
        first = await _ask(loop, sock, hello, relay, challenge_from(relay), wait, HELLO_RETRY)
    except OSError:
        return None, None, None
    if not isinstance(first, wire.Challenge):
        return None, None, None
    # Only this socket's packets before any to the second port show whether
    # unsolicited packets get in: the test comes first.
    reach = wire.encode_packet(wire.ReachTest(seq=seq))
    try:
        reached = await _ask(loop, sock, reach, relay, reach_probe, wait, max(0.35, rtt))
    except OSError:
        return first, None, None
    if not first.probe_port:
        return first, reached is not None, None
    other = (relay[0], first.probe_port)
    try:
        second = await _ask(loop, sock, hello, other, challenge_from(other), wait, HELLO_RETRY)
    except OSError:
        second = None
    observed = second.observed if isinstance(second, wire.Challenge) else None
    return first, reached is not None, observed


async def _round_trips(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, label: str, timeout: float
) -> list[float]:
    """Seconds per Hello answered on ``sock`` (connected to the relay): at least one, or
    UnreachableError."""
    hello = wire.hello_packet()
    rtts: list[float] = []
    try:
        started = loop.time()
        first = await _ask(loop, sock, hello, None, _any_challenge, timeout, HELLO_RETRY)
        if first is None:
            raise UnreachableError(f"{label}: no answer over UDP in {timeout:g} s")
        elapsed = loop.time() - started
        if elapsed < HELLO_RETRY:  # answered at once: its round trip is the first sample
            rtts.append(elapsed)
        wait = min(1.0, max(0.25, 4 * elapsed))
        for _ in range(SAMPLES - len(rtts)):
            _drain(sock)
            started = loop.time()
            if await _ask(loop, sock, hello, None, _any_challenge, wait, wait) is not None:
                rtts.append(loop.time() - started)
    except ConnectionRefusedError:
        raise UnreachableError(
            f"{label}: refused over UDP (nothing listens on that port)"
        ) from None
    except OSError as exc:
        raise UnreachableError(f"{label}: cannot send over UDP: {_why(exc)}") from None
    return rtts or [elapsed]


# --- path MTU --------------------------------------------------------------------------------


async def probe_mtu(address: Address, rtt: float) -> Mtu:
    """The largest UDP payload that reaches the relay unfragmented and is answered."""
    if platform.system() != "linux":
        return Mtu(
            None,
            why=f"it needs Linux's don't-fragment option, not {platform.system_name()}'s",
        )
    wait = min(1.0, max(0.2, 4 * rtt))
    if await _answered(address, wire.MAX_PACKET, wait):
        return Mtu(wire.MAX_PACKET, capped=True)
    low, high = len(wire.hello_packet()), wire.MAX_PACKET - 1
    while low < high:
        middle = (low + high + 1) // 2
        if await _answered(address, middle, wait):
            low = middle
        else:
            high = middle - 1
    return Mtu(low)


async def _answered(address: Address, size: int, wait: float) -> bool:
    """Whether a Hello of ``size`` bytes, sent twice at most with the don't-fragment bit,
    is answered: from a socket of its own, so no other size's late answer counts."""
    loop = asyncio.get_running_loop()
    hello = sized_hello(size)
    try:
        with _udp_socket(connect=address) as sock:
            sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
            for _ in range(2):
                if await _ask(loop, sock, hello, None, _any_challenge, wait, wait) is not None:
                    return True
    except OSError:  # EMSGSIZE: larger than this interface, or a router, carries
        return False
    return False


def _any_challenge(message: wire.RelayMessage, source: Address) -> bool:
    return isinstance(message, wire.Challenge)


def sized_hello(size: int) -> bytes:
    """A Hello of ``size`` bytes (from :data:`~wire.HELLO_MIN_SIZE` to
    :data:`~wire.MAX_PACKET`; one byte less where msgpack's length prefix leaves no
    way to make ``size`` itself)."""
    bare = len(wire.encode_packet(wire.Hello()))  # with an empty padding's 2-byte prefix
    padding = size - bare
    if padding > 255:  # a longer padding's prefix takes one byte more
        padding = max(255, padding - 1)
    return wire.encode_packet(wire.Hello(padding=bytes(padding)))


# --- TCP -------------------------------------------------------------------------------------


async def _tcp(
    relay: str, relay_tcp: str, proxy: str | None, timeout: float, round_trip: TcpRoundTrip
) -> TcpResult:
    setting = relay_tcp.strip()
    if setting == "off":
        return TcpResult(TCP_OFF, error="relay_tcp is off")
    if not relay and not setting:
        return TcpResult(TCP_NOT_TRIED, error="no relay configured")
    # Where the node's relay client would go: relay_tcp, else the relay host's 443.
    route = tcp_route(relay, setting, udp_retry=0.0, proxy=proxy or "")
    if route is None:
        why = f"invalid relay_tcp address {setting!r}" if setting else f"invalid relay {relay!r}"
        return TcpResult(TCP_NOT_TRIED, error=why)
    target, shown = route.label, _proxy_shown(proxy)
    try:
        rtt = await round_trip(route.host, route.port, proxy=proxy or None, timeout=timeout)
    except GPUMeshError as exc:
        return TcpResult(TCP_FAILED, target, proxy=shown, error=exc.message)
    except TimeoutError:
        error = f"TCP to {target}: no answer in {timeout:g} s"
        return TcpResult(TCP_FAILED, target, proxy=shown, error=error)
    except OSError as exc:
        return TcpResult(TCP_FAILED, target, proxy=shown, error=f"TCP to {target}: {_why(exc)}")
    return TcpResult(TCP_OK, target, rtt=rtt, proxy=shown)


def _proxy_shown(proxy: str | None) -> str | None:
    """A proxy URL as it may be shown: ``host[:port]``, never a user name or password."""
    if not proxy:
        return None
    try:
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host:
        return "HTTPS_PROXY (not a URL)"
    return format_address((host, port)) if port else host


# --- the checks, from the results (no I/O) ---------------------------------------------------


def classify_mapping(local: str, observed: str | None, second: str | None) -> str | None:
    """:data:`NO_NAT`, :data:`INDEPENDENT`, :data:`BY_DESTINATION`, or None (not known)."""
    if observed is None:
        return None
    if observed == local:
        return NO_NAT
    if second is None:
        return None
    return INDEPENDENT if second == observed else BY_DESTINATION


def describe_nat(udp: UdpResult) -> tuple[str, str, str]:
    """``(status, line, fix)`` of what the NAT does, as doctor and netcheck say it."""
    observed, mapping = udp.observed, udp.mapping
    if observed is None:
        return WARN, "not known: the relay answered one socket here but not another", ""
    if mapping == NO_NAT:
        return OK, f"no NAT: the relay sees this node's own address {observed}", ""
    if mapping == INDEPENDENT:
        return (
            OK,
            f"behind NAT, seen as {observed} from both of the relay's ports: the NAT maps "
            "independently of the destination (hole punching works)",
            "",
        )
    if mapping == BY_DESTINATION:
        return (
            WARN,
            f"behind NAT, seen as {observed}, and as {udp.observed_second} from the relay's "
            "second port: the NAT maps by destination (symmetric: hole punching fails, "
            "peers need the relay)",
            "forward the UDP port of `gpumesh share` to this machine, or use a network "
            "whose NAT keeps one mapping per socket",
        )
    if not udp.probe_port:
        return (
            WARN,
            f"behind NAT, seen as {observed}; whether it maps by destination is not known: "
            "the relay is an older gpumesh-relay (no second port to ask)",
            "update gpumesh-relay",
        )
    return (
        WARN,
        f"behind NAT, seen as {observed}; whether it maps by destination is not known: the "
        f"relay's second port (udp {udp.probe_port}) did not answer",
        "let UDP to the relay's second port through (a firewall in front of the relay?)",
    )


def describe_inbound(udp: UdpResult) -> str:
    if udp.inbound is None:
        return "whether unsolicited packets get in is not known"
    if udp.inbound:
        return "unsolicited packets get in: peers can dial directly"
    return (
        "unsolicited packets are filtered: peers reach this node by hole punching or through "
        "the relay"
    )


def udp_check(label: str, udp: UdpResult) -> Check:
    return Check("udp", OK, f"{label} answers in {_ms(udp.rtt)} (median of {udp.samples})")


def nat_check(udp: UdpResult) -> Check:
    status, line, fix = describe_nat(udp)
    return Check("nat", status, line, fix)


def inbound_check(udp: UdpResult) -> Check:
    return Check("inbound", OK if udp.inbound is not None else WARN, describe_inbound(udp))


def mtu_check(mtu: Mtu) -> Check:
    if mtu.payload is None:
        return Check("mtu", WARN, f"not measured: {mtu.why}")
    if mtu.capped:
        return Check(
            "mtu", OK, f"{mtu.payload}+ bytes of UDP payload reach the relay (the most it answers)"
        )
    line = (
        f"{mtu.payload} bytes of UDP payload reach the relay unfragmented (an IPv4 MTU of "
        f"{mtu.payload + _IP_UDP_HEADERS})"
    )
    if mtu.payload < RELAYED_PACKET:
        return Check(
            "mtu",
            WARN,
            f"{line}: less than the {RELAYED_PACKET} bytes of a full relayed QUIC packet, "
            "which would be lost on the way",
        )
    return Check("mtu", OK, line)


def tcp_check(tcp: TcpResult, *, udp_works: bool) -> Check:
    via = f" through the proxy {tcp.proxy}" if tcp.proxy else ""
    if tcp.outcome == TCP_OK and tcp.rtt is not None:
        return Check("tcp", OK, f"{tcp.target} answers over TCP{via} in {_ms(tcp.rtt)}")
    if tcp.outcome == TCP_OFF:
        if udp_works:
            return Check("tcp", OK, "not tried: relay_tcp is off")
        fix = "gpumesh config set relay_tcp HOST:PORT (the relay's TCP listener)"
        return Check("tcp", WARN, "not tried: relay_tcp is off, and UDP fails", fix)
    if tcp.outcome == TCP_NOT_TRIED:
        fix = "gpumesh config set relay_tcp HOST:PORT (or off)" if "relay_tcp" in tcp.error else ""
        return Check("tcp", FAIL, f"not tried: {tcp.error}", fix)
    fix = (
        f"check HTTPS_PROXY ({tcp.proxy}) and relay_tcp"
        if tcp.proxy
        else f"check that gpumesh-relay serves TCP at {tcp.target} (--tcp) and that TCP to it "
        "is not blocked (behind a proxy: set HTTPS_PROXY)"
    )
    # With UDP working, a TCP that fails only leaves this node without the fallback.
    return Check("tcp", WARN if udp_works else FAIL, tcp.error, fix)


def with_node(result: Netcheck, relay_state: str | None) -> Netcheck:
    """``result`` with what this home's running node process says of its relay
    (``registered as ADDR``, ``registering``, ``refused: WHY``, ``unavailable: WHY``;
    None: no node process, or no relay there) as one more row."""
    if not relay_state:
        return result
    status = OK if relay_state.startswith("registered") else WARN
    row = Check("node", status, f"the node process's relay: {relay_state}")
    return replace(result, node_relay=relay_state, checks=[*result.checks, row])


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


# --- sockets ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _udp_socket(connect: Address | None = None) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        if connect is not None:
            sock.connect(connect)  # an ICMP "port unreachable" then surfaces as an error
        else:
            sock.bind(("0.0.0.0", 0))
        yield sock
    finally:
        sock.close()


async def _ask(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    packet: bytes,
    to: Address | None,
    want: Callable[[wire.RelayMessage, Address], bool],
    wait: float,
    resend: float,
) -> wire.RelayMessage | None:
    """Send ``packet`` (to ``to``, else the connected peer) every ``resend`` seconds until
    a packet for which ``want(message, source)`` holds arrives, or ``wait`` seconds pass."""
    deadline = loop.time() + wait
    while True:
        if to is None:
            sock.send(packet)
        else:
            sock.sendto(packet, to)
        until = min(deadline, loop.time() + resend)
        while (left := until - loop.time()) > 0:
            try:
                data, source = await asyncio.wait_for(loop.sock_recvfrom(sock, _RECEIVE), left)
            except TimeoutError:
                break
            try:
                message = wire.decode_packet(data)
            except ProtocolError:
                continue
            if want(message, (source[0], source[1])):
                return message
        if loop.time() >= deadline:
            return None


def _drain(sock: socket.socket) -> None:
    """Drop what waits on ``sock`` (a late answer to an earlier Hello)."""
    with contextlib.suppress(OSError):
        for _ in range(64):
            sock.recv(_RECEIVE)


def _why(exc: OSError) -> str:
    return exc.strerror or errno.errorcode.get(exc.errno or 0, "") or str(exc)
