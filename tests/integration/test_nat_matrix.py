"""Every pair of six kinds of network, for real: twelve nodes in the NAT lab's
matrix (``scripts/natlab.sh matrix``: home, cgnat, blocked-in, symmetric,
corporate, captive; two hosts each), one `gpumesh-relay` on the public segment,
and for each of the 21 pairs of presets (each preset with itself too) a
`gpumesh connect` that must take the path :data:`EXPECTED` holds, then a small
`gpumesh cp` to the peer and back.

Host 1 of each preset dials, host 2 shares: a pair of two presets is host 1 of
one and host 2 of the other (:func:`ends` picks which), a preset with itself
its hosts 1 and 2. The lab's routers are checked first, with plain sockets and
no gpumesh, to be what their presets' names say: a path that differs from the
table is then the node's doing, not the lab's.

The table, with each pair's time to connect, is printed (``-s``) and written to
``matrix.txt`` in the test's folder. ``GPUMESH_MATRIX_PRESETS=home,cgnat,...``
limits the presets while working on them; CI runs all six.

Needs root, iproute2, iptables and Docker; in CI never skipped.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpumesh.identity.keys import Identity
from gpumesh.store.config import KEYS as CONFIG_KEYS
from tests.cli import run_cli
from tests.conftest import _in_ci, _network_lab_missing, end_node_processes, require_docker
from tests.integration.conftest import remove_containers
from tests.integration.node import node_env

pytestmark = pytest.mark.usefixtures("network_lab", "gpumesh_processes")

ROOT = Path(__file__).resolve().parents[2]
NATLAB = ROOT / "scripts" / "natlab.sh"
PREFIX = "gmm"
"""Namespaces of their own, apart from the other NAT lab tests'."""
RELAY_HOST = "203.0.113.1"
RELAY = f"{RELAY_HOST}:4799"
RELAY_TCP = f"{RELAY_HOST}:443"
BIN = Path(sys.executable).parent
IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")

PRESETS = ("home", "cgnat", "blocked-in", "symmetric", "corporate", "captive")
TCP_ONLY = frozenset({"corporate", "captive"})
"""Presets whose routers let no UDP out but DNS: the relay only over TCP."""
SYMMETRIC = frozenset({"symmetric"})
"""Presets whose NAT maps each destination to a port of its own."""

DIRECT = "direct"
RELAY_UDP = "relay udp"
RELAY_OVER_TCP = "relay tcp"


@dataclass(frozen=True)
class Cell:
    path: str
    """:data:`DIRECT` (direct or hole-punched), :data:`RELAY_UDP` or :data:`RELAY_OVER_TCP`
    (what `connect` says on the side that reaches the relay only over TCP)."""
    why: str


_PUNCH = (
    "both map a port the same toward every destination and let in what answers it: "
    "each learns the other's port from the relay, and their probes meet"
)
_OPEN = (
    "no NAT on the blocked-in side (its port is its own) and a firewall that lets in "
    "what answers it; the other side maps the same toward every destination: probes meet"
)
_TO_SYMMETRIC = (
    "the symmetric NAT sends to the peer from a new port, not the one the relay saw, "
    "and the peer lets in only the address and port it sent to: probes never meet"
)
_CORPORATE = "corporate lets out only TCP 80/443 and DNS: no UDP reaches relay or peer"
_CAPTIVE = "captive lets out no UDP but DNS: the relay over TCP"

EXPECTED: dict[tuple[str, str], Cell] = {
    ("home", "home"): Cell(DIRECT, _PUNCH),
    ("home", "cgnat"): Cell(DIRECT, "the carrier's NAT keeps ports as a home NAT does; " + _PUNCH),
    ("home", "blocked-in"): Cell(DIRECT, _OPEN),
    ("home", "symmetric"): Cell(RELAY_UDP, _TO_SYMMETRIC),
    ("home", "corporate"): Cell(RELAY_OVER_TCP, _CORPORATE),
    ("home", "captive"): Cell(RELAY_OVER_TCP, _CAPTIVE),
    ("cgnat", "cgnat"): Cell(
        DIRECT, "two NATs in a row on each side, all keeping ports; " + _PUNCH
    ),
    ("cgnat", "blocked-in"): Cell(DIRECT, _OPEN),
    ("cgnat", "symmetric"): Cell(RELAY_UDP, _TO_SYMMETRIC),
    ("cgnat", "corporate"): Cell(RELAY_OVER_TCP, _CORPORATE),
    ("cgnat", "captive"): Cell(RELAY_OVER_TCP, _CAPTIVE),
    ("blocked-in", "blocked-in"): Cell(
        DIRECT,
        "public addresses whose firewalls drop a direct dial, but each side's probe "
        "opens its own firewall for the other's",
    ),
    ("blocked-in", "symmetric"): Cell(RELAY_UDP, _TO_SYMMETRIC),
    ("blocked-in", "corporate"): Cell(RELAY_OVER_TCP, _CORPORATE),
    ("blocked-in", "captive"): Cell(RELAY_OVER_TCP, _CAPTIVE),
    ("symmetric", "symmetric"): Cell(
        RELAY_UDP, "both NATs pick a new port per destination: neither learns the other's"
    ),
    ("symmetric", "corporate"): Cell(RELAY_OVER_TCP, _CORPORATE),
    ("symmetric", "captive"): Cell(RELAY_OVER_TCP, _CAPTIVE),
    ("corporate", "corporate"): Cell(RELAY_OVER_TCP, "neither side has UDP out: " + _CORPORATE),
    ("corporate", "captive"): Cell(RELAY_OVER_TCP, "neither side has UDP out: both over TCP"),
    ("captive", "captive"): Cell(RELAY_OVER_TCP, "neither side has UDP out: " + _CAPTIVE),
}
"""The path each pair of presets must take, and why."""


def _selected() -> tuple[str, ...]:
    """The presets this run covers: all, unless GPUMESH_MATRIX_PRESETS names some
    (while working on them; CI runs all)."""
    chosen = os.environ.get("GPUMESH_MATRIX_PRESETS", "").strip()
    if not chosen:
        return PRESETS
    names = [name.strip() for name in chosen.split(",") if name.strip()]
    unknown = sorted(set(names) - set(PRESETS))
    if unknown:
        pytest.fail(f"GPUMESH_MATRIX_PRESETS: unknown {unknown}; known: {', '.join(PRESETS)}")
    if _in_ci():
        pytest.fail("CI runs the whole matrix: unset GPUMESH_MATRIX_PRESETS")
    return tuple(preset for preset in PRESETS if preset in names)


def _pairs(presets: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(a, b) for i, a in enumerate(presets) for b in presets[i:]]


# ---- the lab ----


@dataclass(frozen=True)
class Host:
    preset: str
    number: int
    namespace: str
    address: str
    public: str

    @property
    def name(self) -> str:
        return f"{self.preset}-{self.number}"


def _natlab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(NATLAB), *args],
        check=False,
        env=dict(os.environ, GPUMESH_NATLAB_PREFIX=PREFIX),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def lab() -> Iterator[dict[tuple[str, int], Host]]:
    """The matrix lab, built once for the module: its hosts by (preset, number)."""
    # Set up before the tests' own network_lab fixture: the same verdict here.
    missing = _network_lab_missing()
    if missing:
        if _in_ci():
            pytest.fail(f"CI runs the network lab tests: {missing}")
        pytest.skip(f"network lab unavailable: {missing}")
    built = _natlab("matrix")
    try:
        assert built.returncode == 0, built.stderr
        hosts = {}
        for line in built.stdout.splitlines():
            preset, number, namespace, address, public = line.split()
            hosts[preset, int(number)] = Host(preset, int(number), namespace, address, public)
        assert {preset for preset, _ in hosts} == set(PRESETS), built.stdout
        yield hosts
    finally:
        down = _natlab("down")
        assert down.returncode == 0, down.stderr
        left = _natlab("check")
        assert left.returncode == 0, f"the NAT lab left things behind: {left.stderr}"


# ---- the routers, with plain sockets ----

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def _inside(namespace: str) -> Iterator[None]:
    """This thread in network namespace ``namespace`` (sockets made meanwhile stay
    in it for good)."""
    with (
        open("/proc/thread-self/ns/net") as here,
        open(f"/var/run/netns/{namespace}") as there,
    ):
        if _libc.setns(there.fileno(), _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        try:
            yield
        finally:
            if _libc.setns(here.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")


@contextlib.contextmanager
def _udp(namespace: str, host: str = "0.0.0.0", port: int = 0) -> Iterator[socket.socket]:
    with _inside(namespace):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        sock.bind((host, port))
        sock.settimeout(0.3)
        yield sock


def _heard(sock: socket.socket) -> tuple[bytes, tuple[str, int]] | None:
    """The next datagram and its source, or None when none comes soon."""
    try:
        data, source = sock.recvfrom(2048)
    except TimeoutError:
        return None
    return data, source


def _tcp_opens(namespace: str, port: int) -> bool:
    with _inside(f"{PREFIX}P"):
        server = socket.create_server((RELAY_HOST, port))
    with _inside(namespace):
        client = socket.socket()
    with server, client:
        client.settimeout(0.3)
        try:
            client.connect((RELAY_HOST, port))
        except OSError:
            return False
        return True


def _check_router(host: Host) -> list[str]:
    """What ``host``'s way out does that its preset says it must not (empty: all well)."""
    wrong: list[str] = []
    public = f"{PREFIX}P"
    with contextlib.ExitStack() as stack:
        echoes = [stack.enter_context(_udp(public, RELAY_HOST, 5001 + i)) for i in range(3)]
        stranger = stack.enter_context(_udp(public, RELAY_HOST, 5009))
        dns = stack.enter_context(_udp(public, RELAY_HOST, 53))
        inner = stack.enter_context(_udp(host.namespace))
        local_port = inner.getsockname()[1]
        for echo in echoes:
            inner.sendto(b"out", echo.getsockname())
        seen = [_heard(echo) for echo in echoes]
        if host.preset in TCP_ONLY:
            if any(seen):
                wrong.append(f"UDP got out: {seen}")
        else:
            sources = [heard[1] for heard in seen if heard is not None]
            if len(sources) != len(echoes):
                return [f"UDP did not get out: {seen}"]
            if {address for address, _ in sources} != {host.public}:
                wrong.append(f"seen from {sources}, not {host.public}")
            ports = {port for _, port in sources}
            if host.preset in SYMMETRIC and len(ports) == 1:
                wrong.append(f"one port {ports} toward every destination")
            if host.preset not in SYMMETRIC and ports != {local_port}:
                wrong.append(f"ports {ports} for local port {local_port}")
            echoes[0].sendto(b"answer", sources[0])
            if _heard(inner) is None:
                wrong.append("an answer did not come back in")
            stranger.sendto(b"unsolicited", sources[0])
            if _heard(inner) is not None:
                wrong.append("an unsolicited datagram came in")
        inner.sendto(b"query", dns.getsockname())
        if _heard(dns) is None:
            wrong.append("DNS did not get out")
    # Ports the relay never takes (TCP 80 leaves corporate as 443 does).
    for port, opens in ((80, True), (8080, host.preset != "corporate")):
        if _tcp_opens(host.namespace, port) != opens:
            wrong.append(f"TCP to port {port} {'failed' if opens else 'got out'}")
    return wrong


def _punches(a: Host, b: Host) -> bool:
    """Whether UDP probes between ``a`` and ``b``, each sent to the address a third
    party (standing in for the relay) saw the other come from, get through both ways."""
    with (
        _udp(f"{PREFIX}P", RELAY_HOST, 5010) as rendezvous,
        _udp(a.namespace) as one,
        _udp(b.namespace) as other,
    ):
        seen = []
        for sock in (one, other):
            sock.sendto(b"hello", rendezvous.getsockname())
            heard = _heard(rendezvous)
            assert heard is not None
            seen.append(heard[1])
        got = [False, False]
        for _ in range(3):
            one.sendto(b"probe", seen[1])
            other.sendto(b"probe", seen[0])
            for i, sock in enumerate((one, other)):
                sock.settimeout(0.1)
                got[i] = got[i] or _heard(sock) is not None
        return all(got)


def test_the_lab_routers_do_what_their_presets_say(lab: dict[tuple[str, int], Host]) -> None:
    wrong = {host.name: found for host in lab.values() if (found := _check_router(host))}
    assert not wrong, wrong
    # Punching, as the table has it, with nothing but sockets.
    punched = {}
    for a, b in _pairs(tuple(p for p in PRESETS if p not in TCP_ONLY)):
        one, other = ends(a, b)
        punched[a, b] = _punches(lab[one], lab[other])
    expected = {pair: EXPECTED[pair].path == DIRECT for pair in punched}
    assert punched == expected


# ---- the nodes ----


def ends(a: str, b: str) -> tuple[tuple[str, int], tuple[str, int]]:
    """The hosts of pair (a, b): the one that dials (a host 1), the one that shares
    (a host 2). The side that reaches the relay only over TCP dials, where there is
    one: `connect` there says so."""
    if b in TCP_ONLY and a not in TCP_ONLY:
        return (b, 1), (a, 2)
    return (a, 1), (b, 2)


@dataclass
class Matrix:
    folder: Path
    hosts: dict[tuple[str, int], Host]
    presets: tuple[str, ...]
    relay: subprocess.Popen[str] | None = None
    unregistered: dict[str, str] = field(default_factory=dict)
    """Providers that did not register with the relay, and their relay state."""
    registrations: dict[str, str] = field(default_factory=dict)
    """Each provider's relay state as `status` says it, once registered."""

    def home(self, host: Host) -> Path:
        return self.folder / host.name

    def gpumesh(
        self, host: Host, *args: str, timeout: float = 90
    ) -> subprocess.CompletedProcess[str]:
        """``gpumesh ARGS`` in ``host``'s namespace, for its home."""
        return subprocess.run(
            ["ip", "netns", "exec", host.namespace, str(BIN / "gpumesh"), *args],
            check=False,
            env=node_env(self.home(host)),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, host: Host, *args: str) -> str:
        result = self.gpumesh(host, *args)
        assert result.returncode == 0, (host.name, args, result.stdout, result.stderr)
        return result.stdout

    def node_id(self, host: Host) -> str:
        return str(Identity.load(self.home(host) / "identity.key").node_id)


def _relay_has_tcp() -> bool:
    shown = subprocess.run(
        [str(BIN / "gpumesh-relay"), "--help"], capture_output=True, text=True, check=False
    )
    return "--tcp" in shown.stdout


def _init(matrix: Matrix, host: Host) -> None:
    """A home for ``host``, made and configured here (no node process starts yet)."""
    env = node_env(matrix.home(host))
    # job_network bridge: the provider runs in a namespace of its own while the
    # engine and its containers stay in this machine's (as in test_nat.py).
    settings = [("relay", RELAY), ("image", IMAGE), ("job_network", "bridge")]
    # Nodes that do not know the relay over TCP yet fail the TCP-only presets' pairs.
    if "relay_tcp" in CONFIG_KEYS:
        settings.append(("relay_tcp", RELAY_TCP))
    for args in (["init", "--name", host.name], *(["config", "set", k, v] for k, v in settings)):
        result = run_cli(args, env)
        assert result.returncode == 0, (host.name, args, result.stderr)


def _start_relay(matrix: Matrix, tcp: bool) -> None:
    allow = [word for host in matrix.hosts.values() for word in ("--allow", matrix.node_id(host))]
    command = [
        "ip", "netns", "exec", f"{PREFIX}P", str(BIN / "gpumesh-relay"),
        "--listen", RELAY, *(("--tcp", RELAY_TCP) if tcp else ()), *allow,
        "--keepalive", "2s", "--registration-timeout", "10s",
    ]  # fmt: skip
    log = matrix.folder / "relay.log"
    with log.open("a") as out:
        matrix.relay = subprocess.Popen(command, stdout=out, stderr=out, text=True)
    deadline = time.monotonic() + 20
    while "listening on" not in log.read_text():
        assert matrix.relay.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def _registration(matrix: Matrix, host: Host) -> str:
    """``host``'s relay state once registered, or as it was after a generous wait."""
    deadline = time.monotonic() + 30
    while True:
        state = json.loads(matrix.ok(host, "status", "--json")).get("relay_state") or ""
        if state.startswith("registered") or time.monotonic() > deadline:
            return str(state)
        time.sleep(0.2)


def _stop(process: subprocess.Popen[str] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def matrix(
    lab: dict[tuple[str, int], Host], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Matrix]:
    """Twelve homes (host 2 of each selected preset sharing), the relay, and every
    pair of the run paired both ways."""
    require_docker()
    presets = _selected()
    hosts = {key: host for key, host in lab.items() if key[0] in presets}
    made = Matrix(tmp_path_factory.mktemp("natmatrix"), hosts, presets)
    started = time.monotonic()
    try:
        for host in hosts.values():
            _init(made, host)
        _start_relay(made, _relay_has_tcp())
        sharing = [host for host in hosts.values() if host.number == 2]
        with ThreadPoolExecutor(4) as pool:
            # The first command in a host's namespace starts its node process there.
            list(pool.map(lambda host: made.ok(host, "share", "--detach"), sharing))
            codes = dict(
                zip(
                    hosts,
                    pool.map(lambda host: made.ok(host, "pair-code").strip(), hosts.values()),
                    strict=True,
                )
            )
            # One that never registers fails its pairs, which the table shows.
            states = list(pool.map(lambda host: _registration(made, host), sharing))
            made.registrations = {h.name: state for h, state in zip(sharing, states, strict=True)}
            made.unregistered = {
                host.name: state
                for host, state in zip(sharing, states, strict=True)
                if not state.startswith("registered")
            }
            pairings = []
            for a, b in _pairs(presets):
                dialer, provider = ends(a, b)
                pairings += [(hosts[dialer], codes[provider]), (hosts[provider], codes[dialer])]
            list(pool.map(lambda job: made.ok(job[0], "pair", "--offline", job[1]), pairings))
        print(f"\nmatrix: {len(hosts)} nodes up and paired in {time.monotonic() - started:.1f} s")
        yield made
    finally:
        _stop(made.relay)
        # The lab's `down` ends every process in its namespaces, node processes too.
        down = _natlab("down")
        assert down.returncode == 0, down.stderr
        end_node_processes(made.folder)
        for host in hosts.values():
            if host.number == 2 and (made.home(host) / "identity.key").exists():
                remove_containers(made.node_id(host))


# ---- the pairs ----


@dataclass
class Outcome:
    dialer: str
    provider: str
    path: str = ""
    connect_ms: float | None = None
    punch_ms: float | None = None
    seconds: float = 0.0
    """The whole `connect` command."""
    failed: str = ""

    @property
    def kind(self) -> str:
        if self.path.startswith("direct"):
            return DIRECT
        if self.path.startswith("relayed (tcp)"):
            return RELAY_OVER_TCP
        if self.path.startswith("relayed via"):
            return RELAY_UDP
        return self.path or "-"


def _try_pair(matrix: Matrix, pair: tuple[str, str]) -> Outcome:
    one, other = ends(*pair)
    dialer, provider = matrix.hosts[one], matrix.hosts[other]
    outcome = Outcome(dialer.name, provider.name)
    started = time.monotonic()
    connected = matrix.gpumesh(dialer, "connect", provider.name, "--json")
    outcome.seconds = time.monotonic() - started
    if connected.returncode != 0:
        outcome.failed = f"connect: {connected.stderr.strip()}"
        if provider.name in matrix.unregistered:
            state = matrix.unregistered[provider.name]
            outcome.failed += f" ({provider.name} never registered with the relay: {state})"
        return outcome
    view = json.loads(connected.stdout)
    outcome.path, outcome.connect_ms, outcome.punch_ms = (
        view["path"],
        view["connect_ms"],
        view["punch_ms"],
    )
    blob = matrix.folder / f"{dialer.name}-to-{provider.name}.bin"
    blob.write_bytes(os.urandom(8 * 1024))
    back = blob.with_suffix(".back")
    for source, destination in (
        (str(blob), f"{provider.name}:/{blob.name}"),
        (f"{provider.name}:/{blob.name}", str(back)),
    ):
        copied = matrix.gpumesh(dialer, "cp", "-q", source, destination)
        if copied.returncode != 0:
            outcome.failed = f"cp {source} {destination}: {copied.stderr.strip()}"
            return outcome
    if back.read_bytes() != blob.read_bytes():
        outcome.failed = "cp: the bytes that came back differ"
    return outcome


def _table(presets: tuple[str, ...], outcomes: dict[tuple[str, str], Outcome]) -> str:
    """The matrix as a Markdown table: each pair's path and time to connect."""

    def cell(a: str, b: str) -> str:
        if (a, b) not in outcomes:
            return ""
        outcome = outcomes[a, b]
        text = outcome.kind
        if outcome.connect_ms is not None:
            text += f" {outcome.connect_ms / 1000:.2f} s"
        if outcome.failed:
            text += " (failed)"
        elif outcome.kind != EXPECTED[a, b].path:
            text += f" (expected {EXPECTED[a, b].path})"
        return text

    lines = [
        "| | " + " | ".join(presets) + " |",
        "|---" * (len(presets) + 1) + "|",
        *(f"| {a} | " + " | ".join(cell(a, b) for b in presets) + " |" for a in presets),
        "",
        "Each pair, dialled from the first host named (time to connect as `connect` "
        "reports it; punching after; the whole command), and why it takes that path:",
        "",
    ]
    for (a, b), outcome in outcomes.items():
        punch = "" if outcome.punch_ms is None else f", punched in {outcome.punch_ms:.0f} ms"
        connect = "-" if outcome.connect_ms is None else f"{outcome.connect_ms:.0f} ms"
        lines += [
            f"- {outcome.dialer} -> {outcome.provider}: {outcome.failed or outcome.path}, "
            f"connect {connect}{punch}, command {outcome.seconds:.2f} s",
            f"  ({EXPECTED[a, b].path}: {EXPECTED[a, b].why})",
        ]
    return "\n".join(lines) + "\n"


@pytest.mark.usefixtures("docker_daemon")
@pytest.mark.timeout(240)
def test_every_pair_of_presets_connects_on_the_path_the_table_holds(matrix: Matrix) -> None:
    pairs = _pairs(matrix.presets)
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        outcomes = dict(
            zip(pairs, pool.map(lambda pair: _try_pair(matrix, pair), pairs), strict=True)
        )
    took = time.monotonic() - started
    table = _table(matrix.presets, outcomes)
    (matrix.folder / "matrix.txt").write_text(table)
    print(f"\n{table}\n{len(pairs)} pairs in {took:.1f} s")
    wrong = [
        f"{a} / {b} ({o.dialer} -> {o.provider}): "
        + (o.failed or f"path {o.path!r}, expected {EXPECTED[a, b].path}: {EXPECTED[a, b].why}")
        for (a, b), o in outcomes.items()
        if o.failed or o.kind != EXPECTED[a, b].path
    ]
    assert not wrong, "\n".join(wrong)
    # The providers' own status names the path to the relay: over TCP exactly where
    # UDP is blocked.
    over_tcp = {name for name, state in matrix.registrations.items() if "(over tcp)" in state}
    assert over_tcp == {
        name for name in matrix.registrations if name.rsplit("-", 1)[0] in TCP_ONLY
    }, matrix.registrations
