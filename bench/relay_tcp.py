"""The relay over TCP/TLS, for a host whose UDP is dropped: `gpumesh cp` next to scp
through an ssh jump host, `gpumesh connect` next to the relay over UDP, and the UDP
relay's own figures against the commit before the relay's TCP work, in one run.

Needs root (network namespaces, a TUN device, iptables). Three parts (``--only``):

* ``cp``: the WAN lab (``scripts/wanlab.sh``: two namespaces joined by the
  user-space link of ``scripts/wanemu.py``) shaped to ``--rate`` Mbit/s and
  ``--rtt`` ms (default 100 Mbit/s, 20 ms: ``--rate 100 --delay 10``). Host B
  holds ``gpumesh-relay --listen 10.77.0.2:4799 --tcp 10.77.0.2:443`` (443: the
  port a node tries by default), the provider (alice, a ``gpumesh share``
  process on UDP 4711, registered with the relay over UDP) and one throwaway
  sshd (``bench/sshd.sh``, port 2222), the jump host and the target alike.
  Host A holds the consumer, bob, whose firewall drops every UDP packet in and
  out (iptables, silently, loopback spared), so his node process reaches alice
  through the relay's TCP: ``gpumesh connect alice --json`` must say
  ``relayed (tcp) via 10.77.0.2:4799`` before anything is timed, and ``gpumesh
  daemon status --json`` must still say so after every copy. Timed, whole
  processes run in host A, ``--rounds`` rounds in a rotating order, median
  MB/s (10^6 bytes/s) of a ``--size`` file (default 64 MiB) on tmpfs:
  ``gpumesh cp --json FILE alice:PATH`` (upload) and ``gpumesh cp --json
  alice:PATH FILE`` (download), through bob's node process (its session and
  relay registration kept between copies, as a user's successive copies
  have them), next to ``scp -J relay -c aes128-gcm@openssh.com`` of the same
  file both ways (both hops aes128-gcm, the fastest cipher here: the inner
  connection's bytes ride the jump connection across the link, as QUIC rides
  the relay's TLS). One untimed copy of each kind first. Also shown: the CPU
  time the relay, bob's node process and alice's node process spent per copy
  (``/proc``), and what the relay forwarded and dropped (its stats file).
  Goal: ``gpumesh cp`` >= 0.9x scp -J, each way.
* ``connect``: the same lab. ``gpumesh connect alice --fresh --json`` from
  bob with all of his UDP dropped (the relay over TCP) against the same from
  carol, whose UDP reaches the relay but not alice's port (so the relay over
  UDP carries her session and punching fails), alternated, ``--rounds``
  each. Each turn first stops that consumer's node process (untimed): the
  cold connect starts a new one, which registers with the relay (for bob
  the TCP stream wins the race against an unanswered UDP Hello) and dials;
  the warm connect right after dials again from the same node process, its
  relay registration kept. Medians of the whole command's wall time and of
  its own ``connect_ms``. Goal: TCP <= UDP + 1 s.
* ``udp-relay``: ``bench/relay.py``'s measurement (the NAT lab of
  ``scripts/natlab.sh``: a hole-punched direct session and one every byte of
  which crosses the UDP relay, ``connect --fresh`` and ``connect --speed
  --relay-size``), run with a copy of this checkout's ``src/`` and with each
  ``--baseline``'s (``git archive``d; all on tmpfs, compiled alike) first on
  ``PYTHONPATH``, in turn, ``--relay-rounds`` rounds, the order rotating. The default baselines are
  found by their subjects: the commit before "Relay core: a TCP connection is
  an address of its own" (the relay's TCP work; the node's TCP race is in
  it) and the commit before "Protocol: the relay over TCP" (before any of
  it). Goal: the UDP relay does not regress.

Everything (link, namespaces and their firewalls, processes, files) is removed
on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import relay as udp_relay_bench
from _benchlib import (
    ensure_bytecode,
    exit_cleanly_on_sigterm,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from bulk import gpumesh_command, loopback_sshd, make_nodes, parse_size, running_agent, write_source
from dispatch import baseline_source
from gpumesh.client.node import Node

MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent
WANLAB = ROOT / "scripts" / "wanlab.sh"
PREFIX = "gmwt"
"""The bench's own WAN lab prefix: it never touches a lab someone built by hand."""
ADDRESS_A, ADDRESS_B = "10.77.0.1", "10.77.0.2"
PORT = 4711
RELAY_UDP = f"{ADDRESS_B}:4799"
RELAY_TCP = f"{ADDRESS_B}:443"
"""The port a node tries by default (``relay_tcp`` empty: the relay host's 443)."""
SSH_PORT = 2222
CIPHER = "aes128-gcm@openssh.com"
BEFORE_SUBJECTS = (
    "Relay core: a TCP connection is an address of its own",
    "Protocol: the relay over TCP",
)
"""The default baselines: the parent of the earliest commit with each of these subjects."""

GM_UP, GM_DOWN, SCP_UP, SCP_DOWN = (
    "gpumesh cp, up",
    "gpumesh cp, down",
    "scp -J, up",
    "scp -J, down",
)
TCP, UDP = "relay over TCP (bob: no UDP)", "relay over UDP (carol: no UDP to alice)"
PARTS = ("cp", "connect", "udp-relay")


# --- the lab -----------------------------------------------------------------------------


def lab(*args: str) -> str:
    """Run ``wanlab.sh`` with the bench's prefix; its output."""
    result = subprocess.run(
        ["bash", str(WANLAB), *args],
        env=dict(os.environ, GPUMESH_WANLAB_PREFIX=PREFIX, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"wanlab.sh {args[0]} failed: {result.stderr.strip()}")
    return (result.stdout + result.stderr).strip()


def on(side: str) -> list[str]:
    return ["ip", "netns", "exec", f"{PREFIX}{side}"]


@contextlib.contextmanager
def wan_lab(rate: float, rtt: float) -> Iterator[str]:
    try:
        yield lab("up", "--rate", f"{rate:g}", "--delay", f"{rtt / 2:g}")
    finally:
        with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
            lab("down")


FIREWALLS: dict[str, list[tuple[str, list[str]]]] = {
    "open": [],
    # A network that blocks UDP, silently: nothing comes back, nothing says so.
    "no-udp": [
        ("INPUT", ["-p", "udp", "!", "-i", "lo", "-j", "DROP"]),
        ("OUTPUT", ["-p", "udp", "!", "-o", "lo", "-j", "DROP"]),
    ],
    # UDP reaches the relay, never alice's port: her session is relayed, punching fails.
    "no-udp-to-alice": [
        ("OUTPUT", ["-p", "udp", "-d", ADDRESS_B, "--dport", str(PORT), "-j", "DROP"]),
    ],
}


def firewall(kind: str) -> None:
    """Host A's firewall: ``kind`` of :data:`FIREWALLS`, replacing what was there."""
    for chain in ("INPUT", "OUTPUT"):
        subprocess.run([*on("A"), "iptables", "-F", chain], check=True)
    for chain, rule in FIREWALLS[kind]:
        subprocess.run([*on("A"), "iptables", "-A", chain, *rule], check=True)


# --- processes ---------------------------------------------------------------------------


class Stalled(Exception):
    """A command ran past the limit and was killed."""


def timed(
    command: Sequence[str], limit: float, env: dict[str, str] | None = None
) -> tuple[float, str]:
    """(seconds, stdout) of a whole process run in host A; Stalled past ``limit``."""
    started = time.perf_counter()
    with subprocess.Popen(
        [*on("A"), *command],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise Stalled(f"{' '.join(command[:3])} ran past {limit:g} s") from None
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:3])} failed (exit {proc.returncode}): {err.strip()}"
        )
    return seconds, out


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 when it is gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def running_relay(log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``gpumesh-relay`` on host B (UDP and TCP/TLS) until the block ends; then what it
    forwarded and dropped (its stats file, written at exit)."""
    relay = str(Path(sys.executable).parent / "gpumesh-relay")
    stats = log.with_suffix(".json")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*on("B"), relay, "--listen", RELAY_UDP, "--tcp", RELAY_TCP, "--open",
             "--log-level", "warning", "--stats-file", str(stats)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while b"listening on" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gpumesh-relay did not start: {log.read_text().strip()}")
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError, ValueError):
            counters = json.loads(stats.read_text())
            shown = {k: v for k, v in counters.items() if isinstance(v, int | float) and v}
            print(f"  relay's counters at exit: {json.dumps(shown, sort_keys=True)}", flush=True)


def wait_registered(home: Path) -> None:
    env = dict(os.environ, GPUMESH_HOME=str(home))
    env.pop("GPUMESH_LOG", None)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = subprocess.run(
            [*on("B"), *gpumesh_command(), "status", "--json"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode == 0 and "registered" in (
            json.loads(result.stdout).get("relay_state") or ""
        ):
            return
        time.sleep(0.3)
    raise RuntimeError("alice's share did not register with the relay within 30 s")


@dataclass
class Consumer:
    name: str
    home: Path
    sandbox: Path
    """Its folder in alice's sandbox (``alice:/`` for it)."""

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ, GPUMESH_HOME=str(self.home))
        for name in ("GPUMESH_LOG", "GPUMESH_PEER"):
            env.pop(name, None)
        return env

    def gm(self, *args: str, limit: float = 120) -> tuple[float, str]:
        return timed([*gpumesh_command(), *args], limit, self.env)

    def node(self) -> dict[str, object] | None:
        _, out = self.gm("daemon", "status", "--json")
        view = json.loads(out)["node"]
        return None if view is None else dict(view)

    def session_path(self) -> str:
        """The path of its node process's warm session to alice ("none" without one)."""
        view = self.node() or {}
        sessions = view.get("warm_sessions") or []
        assert isinstance(sessions, list)
        paths = [str(s["path"]) for s in sessions if s["peer"] == "alice"]
        return paths[0] if paths else "none"

    def stop(self) -> None:
        with contextlib.suppress(OSError, subprocess.SubprocessError, RuntimeError):
            self.gm("daemon", "stop", limit=60)


def make_consumer(home: Path, alice: Node, tmp: Path, name: str) -> Consumer:
    """A consumer paired with alice both ways who knows the relay (its TCP port is the
    default, the relay host's 443)."""
    node = Node(home)
    node.init(name)
    node.pair(alice.pairing_code())
    alice.pair(node.pairing_code())
    node.home.config.set("relay", RELAY_UDP)
    node.home.config.save()
    sandbox = tmp / "a" / "files" / str(node.info().node_id)
    node.close()
    return Consumer(name, home, sandbox)


# --- the cp part ------------------------------------------------------------------------


@dataclass
class CpSetup:
    tmp: Path
    source: Path
    size: int
    bob: Consumer
    ssh: list[str]
    limit: float
    relay_pid: int
    alice_pid: int | None
    runs: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    """Per process (relay, bob's node, alice's node): CPU seconds of each gpumesh copy."""
    copy_seconds: list[float] = field(default_factory=list)
    """Wall seconds of each gpumesh copy, in the order of ``cpu``'s."""
    count: int = 0

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}-{self.count}.bin"


def ssh_config(state: Path) -> Path:
    """An ssh config with ``relay`` (the jump host) and ``bench`` (the target, reached
    through it), both the sshd in host B, both hops aes128-gcm."""
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout
    config = state / "jump_config"
    hosts = []
    for alias in ("relay", "bench"):
        hosts.append(
            f"Host {alias}\n  HostName {ADDRESS_B}\n  Port {SSH_PORT}\n  User {user.strip()}\n"
            f"  IdentityFile {state / 'id'}\n  IdentitiesOnly yes\n  HostKeyAlias bench\n"
            f"  UserKnownHostsFile {state / 'known_hosts'}\n  StrictHostKeyChecking yes\n"
            f"  BatchMode yes\n  LogLevel ERROR\n  Ciphers {CIPHER}\n"
        )
    config.write_text("\n".join(hosts))
    return config


def check_size(path: Path, size: int, what: str) -> None:
    got = path.stat().st_size
    path.unlink()
    if got != size:
        raise RuntimeError(f"{what} copied {got} of {size} bytes")


def gm_copy(setup: CpSetup, up: bool) -> float:
    bob = setup.bob
    node = bob.node()
    node_pid = None if node is None else int(str(node["pid"]))
    pids = {"relay": setup.relay_pid, "bob's node": node_pid, "alice's node": setup.alice_pid}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    if up:
        name = setup.fresh("up")
        seconds, out = bob.gm(
            "cp", "--json", str(setup.source), f"alice:/{name}", limit=setup.limit
        )
        arrived = bob.sandbox / name
    else:
        arrived = setup.tmp / "b-in" / setup.fresh("down")
        seconds, out = bob.gm("cp", "--json", "alice:/down.bin", str(arrived), limit=setup.limit)
    for name, pid in pids.items():
        setup.cpu.setdefault(name, []).append(cpu_seconds(pid) - before[name])
    setup.copy_seconds.append(seconds)
    result = json.loads(out)
    if result.get("channel") != "quic":
        raise RuntimeError(f"gpumesh cp went over {result.get('channel')!r}, not the relay")
    check_size(arrived, setup.size, "gpumesh cp")
    path = bob.session_path()
    if not path.startswith("relayed (tcp)"):
        raise RuntimeError(f"bob's session moved to {path!r}")
    return setup.size / seconds / 1e6


def scp_copy(setup: CpSetup, up: bool) -> float:
    options = [*setup.ssh, "-J", "relay", "-c", CIPHER]
    if up:
        arrived = setup.tmp / "ssh-in" / setup.fresh("scp-up")
        command = ["scp", "-q", *options, str(setup.source), f"bench:{arrived}"]
    else:
        arrived = setup.tmp / "b-in" / setup.fresh("scp-down")
        command = ["scp", "-q", *options, f"bench:{setup.tmp / 'ssh-out.bin'}", str(arrived)]
    seconds, _ = timed(command, setup.limit)
    check_size(arrived, setup.size, "scp")
    return setup.size / seconds / 1e6


RUNNERS = {
    GM_UP: lambda s: gm_copy(s, True),
    SCP_UP: lambda s: scp_copy(s, True),
    GM_DOWN: lambda s: gm_copy(s, False),
    SCP_DOWN: lambda s: scp_copy(s, False),
}


def measure_cp(setup: CpSetup, rounds: int) -> None:
    firewall("no-udp")
    _, out = setup.bob.gm("connect", "alice", "--json")
    path = str(json.loads(out)["path"])
    print(f"bob, all UDP dropped: `gpumesh connect alice --json` says the path is {path!r}")
    if path != f"relayed (tcp) via {RELAY_UDP}":
        raise RuntimeError(f"bob's session is not on the relay's TCP: {path!r}")
    for name, run in RUNNERS.items():  # untimed: first-use costs of each tool
        run(setup)
        print(f"  warm-up: {name} done", flush=True)
    names = list(RUNNERS)
    for index in range(rounds):
        order = names[index % len(names) :] + names[: index % len(names)]
        figures = []
        for name in order:
            mbps = run_one(setup, name)
            figures.append(f"{name} {mbps:.1f}")
        print(f"  round {index + 1}: " + ", ".join(figures) + " MB/s", flush=True)


def run_one(setup: CpSetup, name: str) -> float:
    mbps = RUNNERS[name](setup)
    setup.runs.setdefault(name, []).append(mbps)
    return mbps


def report_cp(setup: CpSetup, args: argparse.Namespace) -> None:
    print(
        f"\n`gpumesh cp` of {args.size / MIB:g} MiB through the relay's TCP vs scp -J, over "
        f"{f'{args.rate:g} Mbit/s' if args.rate else 'an unlimited rate'} and {args.rtt:g} ms "
        f"RTT; MB/s, median of {args.rounds} rounds:"
    )
    rows = []
    for name in RUNNERS:
        s = summarize(setup.runs[name])
        rows.append([name, f"{s.p50:.2f}", f"{s.low:.2f}", f"{s.high:.2f}"])
    print_rows(["path", "MB/s p50", "low", "high"], rows)
    if args.rate:
        print(f"  (the link's rate: {args.rate / 8:.2f} MB/s)")
    for gm, scp, way in ((GM_UP, SCP_UP, "upload"), (GM_DOWN, SCP_DOWN, "download")):
        ratio = summarize(setup.runs[gm]).p50 / summarize(setup.runs[scp]).p50
        verdict = "met" if ratio >= 0.9 else "missed"
        print(f"  {way}: gpumesh cp / scp -J = {ratio:.2f}x (goal >= 0.9x: {verdict})")
    copies = len(setup.copy_seconds)
    print(f"  CPU per gpumesh copy (median of {copies}, up and down; share of a core meanwhile):")
    for name, values in setup.cpu.items():
        share = summarize([c / w for c, w in zip(values, setup.copy_seconds, strict=True)])
        print(f"    {name}: {summarize(values).p50:.2f} s ({share.p50:.0%})")


# --- the connect part -------------------------------------------------------------------


@dataclass
class Connects:
    cold_wall: list[float] = field(default_factory=list)
    cold_own: list[float] = field(default_factory=list)
    warm_wall: list[float] = field(default_factory=list)
    warm_own: list[float] = field(default_factory=list)
    paths: set[str] = field(default_factory=set)


def connect_once(consumer: Consumer, limit: float) -> tuple[float, float, str]:
    seconds, out = consumer.gm("connect", "alice", "--fresh", "--json", limit=limit)
    view = json.loads(out)
    return seconds * 1000, float(view["connect_ms"]), str(view["path"])


def measure_connect(
    bob: Consumer, carol: Consumer, rounds: int, limit: float
) -> dict[str, Connects]:
    results = {TCP: Connects(), UDP: Connects()}
    turns = (
        (TCP, bob, "no-udp", "relayed (tcp) via"),
        (UDP, carol, "no-udp-to-alice", "relayed via"),
    )
    for index in range(rounds):
        order = turns if index % 2 == 0 else turns[::-1]
        shown = []
        for label, consumer, wall, want in order:
            consumer.stop()
            firewall(wall)
            got = results[label]
            try:
                for kind in ("cold", "warm"):
                    ms, own, path = connect_once(consumer, limit)
                    if not path.startswith(want):
                        raise RuntimeError(f"{consumer.name}'s connect took the path {path!r}")
                    got.paths.add(path)
                    getattr(got, f"{kind}_wall").append(ms)
                    getattr(got, f"{kind}_own").append(own)
                    shown.append(f"{consumer.name} {kind} {ms:.0f} ms ({own:.0f})")
            finally:
                consumer.stop()
        print(f"  round {index + 1}: " + ", ".join(shown), flush=True)
    return results


def report_connect(results: dict[str, Connects], args: argparse.Namespace) -> None:
    print(
        f"\n`gpumesh connect alice --fresh --json`, whole command (its own connect_ms), ms, "
        f"median of {args.rounds} (low-high):"
    )
    rows = []
    for label, got in results.items():
        cells = [label]
        for wall, own in ((got.cold_wall, got.cold_own), (got.warm_wall, got.warm_own)):
            w, o = summarize(wall), summarize(own)
            cells += [
                f"{w.p50:.0f} ({w.low:.0f}-{w.high:.0f})",
                f"{o.p50:.0f} ({o.low:.0f}-{o.high:.0f})",
            ]
        rows.append(cells)
    print_rows(
        ["path", "cold: command", "cold: connect_ms", "warm: command", "warm: connect_ms"], rows
    )
    for label, got in results.items():
        print(f"  {label}: paths {sorted(got.paths)}")
    tcp, udp = results[TCP], results[UDP]
    for what, t, u in (
        ("cold, command", tcp.cold_wall, udp.cold_wall),
        ("cold, connect_ms", tcp.cold_own, udp.cold_own),
        ("warm, command", tcp.warm_wall, udp.warm_wall),
        ("warm, connect_ms", tcp.warm_own, udp.warm_own),
    ):
        extra = summarize(t).p50 - summarize(u).p50
        verdict = "met" if extra <= 1000 else "missed"
        print(f"  {what}: TCP - UDP = {extra:+.0f} ms (goal <= +1000 ms: {verdict})")


# --- the udp-relay part -----------------------------------------------------------------


def default_baselines() -> list[str]:
    """The commit before each of :data:`BEFORE_SUBJECTS`, abbreviated."""
    found = []
    for subject in BEFORE_SUBJECTS:
        result = subprocess.run(
            ["git", "-C", str(ROOT), "log", "-F", "--format=%h", f"--grep={subject}"],
            capture_output=True,
            text=True,
            check=False,
        )
        commits = result.stdout.split()
        if not commits:
            raise SystemExit(f"no commit named {subject!r} here: give --baseline REV")
        parent = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", f"{commits[-1]}~1"],
            capture_output=True,
            text=True,
            check=True,
        )
        found.append(parent.stdout.strip())
    return found


Results = dict[str, dict[str, list[dict[str, object]]]]
"""Per tree ("this checkout", "at REV"), per set-up (direct, relayed): bench/relay.py's
runs."""


def measure_udp_relay(tmp: Path, baselines: list[str], rounds: int, size: str) -> Results:
    """bench/relay.py's direct and relayed runs with each tree's ``src`` first on
    PYTHONPATH (its ``gpumesh`` and ``gpumesh-relay`` then import that tree), in a
    rotating order."""
    # Every tree runs from a copy on the same medium, compiled alike: run from this
    # checkout's src/ on ext4, the same code's `connect --fresh` took 50-130 ms more
    # in most runs than from its copy on tmpfs (not traced further).
    (tmp / "this").mkdir()
    this = shutil.copytree(
        ROOT / "src", tmp / "this" / "src", ignore=shutil.ignore_patterns("__pycache__")
    )
    trees = {"this checkout": this}
    for index, rev in enumerate(baselines):
        trees[f"at {rev}"] = baseline_source(rev, tmp / f"old{index}")
    for tree in trees.values():
        compileall.compile_dir(tree, quiet=1)
    (tmp / "lab").mkdir()
    results: Results = {tree: {"direct": [], "relayed": []} for tree in trees}
    modes = {"direct": ["drop"], "relayed": ["drop", "--random-fully"]}
    saved = os.environ.get("PYTHONPATH")
    names = list(trees)
    try:
        for index in range(rounds):
            for tree in names[index % len(names) :] + names[: index % len(names)]:
                os.environ["PYTHONPATH"] = str(trees[tree])
                for mode in modes if index % 2 == 0 else reversed(modes):
                    got = udp_relay_bench._measure(tmp / "lab", modes[mode], size)
                    results[tree][mode].append(got)
                    print(
                        f"  round {index + 1}, {tree}, {mode}: {got['path']}, "
                        f"{got['mb_per_s']} MB/s, connect {float(str(got['connect_ms'])):.0f} ms",
                        flush=True,
                    )
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return results


def report_udp_relay(results: Results, args: argparse.Namespace) -> None:
    print(
        f"\nbench/relay.py ({args.relay_size} per run, NAT lab), MB/s and `connect --fresh` ms, "
        f"median of {args.relay_rounds} (low-high):"
    )
    rows = []
    medians: dict[tuple[str, str], float] = {}
    for mode in ("direct", "relayed"):
        for tree, modes in results.items():
            runs = modes[mode]
            want = "direct" if mode == "direct" else "relayed"
            wrong = [r["path"] for r in runs if not str(r["path"]).startswith(want)]
            mb = summarize([float(str(r["mb_per_s"])) for r in runs])
            ms = summarize([float(str(r["connect_ms"])) for r in runs])
            medians[(tree, mode)] = mb.p50
            rows.append(
                [f"{mode}, {tree}" + (f" (other paths: {wrong})" if wrong else ""),
                 f"{mb.p50:.1f} ({mb.low:.1f}-{mb.high:.1f})",
                 f"{ms.p50:.0f} ({ms.low:.0f}-{ms.high:.0f})"]
            )  # fmt: skip
    print_rows(["path", "MB/s", "connect ms"], rows)
    after, *befores = list(results)
    for before in befores:
        ratios = ", ".join(
            f"{mode} {medians[(after, mode)] / medians[(before, mode)]:.2f}x"
            for mode in ("direct", "relayed")
        )
        print(f"  this checkout / {before.removeprefix('at ')}: {ratios}")


# --- main ---------------------------------------------------------------------------------


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM ignored until the block ends (a teardown half done would leave
    namespaces, processes or files behind); the commands it runs ignore them too."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_wan_parts(args: argparse.Namespace, tmp: Path) -> None:
    with contextlib.ExitStack() as stack:
        print(f"Writing a {args.size / MIB:g} MiB file...")
        source = tmp / "source.bin"
        write_source(source, args.size)
        for folder in ("ssh-in", "b-in"):
            (tmp / folder).mkdir()
        alice, bob_node = make_nodes(tmp, PORT, ADDRESS_B)
        alice.home.config.set("relay", RELAY_UDP)
        # alice shares from a namespace of her own while the engine stays in this
        # machine's: job network rules made there would filter nothing.
        alice.home.config.set("job_network", "bridge")
        alice.home.config.save()
        bob_node.home.config.set("relay", RELAY_UDP)
        bob_node.home.config.save()
        bob = Consumer("bob", tmp / "b", tmp / "a" / "files" / str(bob_node.info().node_id))
        bob_node.close()
        carol = make_consumer(tmp / "c", alice, tmp, "carol")
        alice.close()
        print(stack.enter_context(wan_lab(args.rate, args.rtt)))
        relay = stack.enter_context(running_relay(tmp / "relay.log"))
        stack.enter_context(running_agent(tmp / "a", tmp / "agent.log", wrap=on("B")))
        wait_registered(tmp / "a")
        for consumer in (bob, carol):
            stack.callback(consumer.stop)
        alice_view = Consumer("alice", tmp / "a", tmp).node()
        alice_pid = None if alice_view is None else int(str(alice_view["pid"]))
        if "cp" in args.only:
            ssh, why = stack.enter_context(
                loopback_sshd(tmp / "ssh", address=ADDRESS_B, wrap=on("B"), port=SSH_PORT)
            )
            if ssh is None:
                raise RuntimeError(f"no sshd for the scp baseline: {why}")
            shutil.copyfile(source, tmp / "ssh-out.bin")
            bob.sandbox.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, bob.sandbox / "down.bin")
            setup = CpSetup(
                tmp=tmp,
                source=source,
                size=args.size,
                bob=bob,
                ssh=["-F", str(ssh_config(tmp / "ssh"))],
                limit=args.limit,
                relay_pid=relay.pid,
                alice_pid=alice_pid,
            )
            print(f"cp: {args.rounds} rounds, bob's UDP dropped:", flush=True)
            measure_cp(setup, args.rounds)
            bob.stop()
        connects = None
        if "connect" in args.only:
            print(f"connect: {args.rounds} rounds, bob (no UDP) and carol (no UDP to alice):")
            connects = measure_connect(bob, carol, args.rounds, args.limit)
        firewall("open")
        if "cp" in args.only:
            report_cp(setup, args)
        if connects is not None:
            report_connect(connects, args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds of cp and connect (default 5)"
    )
    parser.add_argument(
        "--size", type=parse_size, default=64 * MIB, help="file size (default 64MiB)"
    )
    parser.add_argument(
        "--rate", type=float, default=100.0, help="link rate, Mbit/s (default 100; 0: none)"
    )
    parser.add_argument("--rtt", type=float, default=20.0, help="link round trip, ms (default 20)")
    parser.add_argument(
        "--limit", type=float, default=180.0, help="seconds one command may take (default 180)"
    )
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"parts to run, of {','.join(PARTS)} (default all)"
    )
    parser.add_argument(
        "--baseline",
        action="append",
        metavar="REV",
        help="udp-relay: a revision to compare (repeatable; default: the commit before the "
        "relay's TCP work and the one before the node's)",
    )
    parser.add_argument("--relay-rounds", type=int, default=3, help="udp-relay: rounds (default 3)")
    parser.add_argument(
        "--relay-size", default="256MiB", help="udp-relay: bytes per run (default 256MiB)"
    )
    args = parser.parse_args(argv)
    args.only = {part.strip() for part in args.only.split(",") if part.strip()}
    if unknown := args.only - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_cleanly_on_sigterm()
    if os.geteuid() != 0:
        print("bench/relay_tcp.py needs root (network namespaces, iptables)", file=sys.stderr)
        return 2
    for tool in ("ip", "iptables", "scp"):
        if shutil.which(tool) is None:
            print(f"bench/relay_tcp.py needs {tool}", file=sys.stderr)
            return 2
    if note := source_note():
        print(note, file=sys.stderr)
    ensure_bytecode()
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-bench-relaytcp-", dir=shm))
    try:
        if args.only & {"cp", "connect"}:
            run_wan_parts(args, tmp)
        if "udp-relay" in args.only:
            baselines = args.baseline or default_baselines()
            print(f"udp-relay: bench/relay.py's runs, this checkout and {baselines}:")
            results = measure_udp_relay(tmp, baselines, args.relay_rounds, args.relay_size)
            report_udp_relay(results, args)
    except KeyboardInterrupt:
        return interrupted()
    finally:
        # Each part stops what it started; a Ctrl-C in the middle of that must
        # not leave a lab behind: both labs' `down` once more, uninterrupted.
        with signals_held():
            if args.only & {"cp", "connect"}:
                with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
                    lab("down")
            if "udp-relay" in args.only:
                with contextlib.suppress(subprocess.SubprocessError):
                    udp_relay_bench._natlab("down")
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
