"""Every bulk path of GPUMesh over an emulated long and lossy link, next to scp, in one run.

The link is the WAN lab (``scripts/wanlab.sh``): two network namespaces joined
by a user-space link with a one-way delay and random loss each way
(``scripts/wanemu.py``; this kernel has no ``netem``). Host A holds the
provider (a ``gpumesh share`` process, alice) and a throwaway sshd
(``bench/sshd.sh``); host B runs every command as a new process, bob's CLI
and the ssh tools alike. For each row of ``--rows`` (RTT in ms / loss in %
each way, default 20/0, 50/0.5, 100/1) the link is restarted with that delay
and loss, and each path is timed as a whole process, ``--repeat`` runs each
(the paths taken in a rotating order), median MB/s (10^6 bytes/s):

* ``cp``: ``gpumesh cp --json FILE alice:PATH`` (the data channel; checked:
  ``channel`` is ``tls``, the size arrived) next to ``scp -c
  aes128-gcm@openssh.com FILE`` of the same ``--size`` file;
* ``cp --no-fast-path``: the same over QUIC with ``GPUMESH_FEC=auto`` on both
  nodes (parity under it where the link asks for it, see docs/architecture.md);
* ``QUIC, FEC off``: the same with ``GPUMESH_FEC=off`` for bob's command (the
  provider then sends no parity either): QUIC as it was before FEC;
* folder ``cp`` of a tree of ``--files`` files making up ``--size`` bytes,
  next to ``scp -r`` of it;
* ``run --workdir TREE -- true`` (needs Docker and its image; a container run
  is part of the time), next to ``scp -r``;
* ``app sync`` of the tree as a new app (a first sync), next to ``rsync -a``
  over ssh of it;
* folder ``cp``, ``run --workdir`` and ``app sync`` again "over QUIC": from a
  second consumer (carol) whose ``data_channel`` is ``off``, the way every
  hole-punched or relayed session carries them (the data channel needs a
  direct TCP path);
* ``gpumesh connect --fresh --json`` (bob's node process dials anew each time,
  beside the session it keeps): the whole process, and the time it reports
  itself (``connect_ms``: that dial and the identity proof).

A run that takes longer than ``--limit`` seconds is killed and shown as
timed out (below size/limit MB/s); that path's other runs in that row are
skipped. Sources
and both homes live on tmpfs (``/dev/shm``), so neither disk counts; every
copy is removed after it is checked. Needs root (namespaces, a TUN device).
The hosts' TCP uses BBR where the kernel has it: the script prints the
congestion control of the hosts and of the data channel (as ``cp --json``
reports it). Hole-punched and relayed sessions: ``gpumesh-relay`` runs on
host A beside the provider (which registers with it), and a third consumer
(dave, data channel off, who knows the relay) copies the file while an
iptables rule on host B shapes his path: ``cp, hole-punched`` drops only
QUIC Initials to the provider's port (the dial goes through the relay, then
punching moves the session to a direct path), ``cp, relayed`` drops
everything to that port (punching fails; every byte crosses the link to the
relay). Each of these paths has two rows. The warm row (``cp, hole-punched``,
``cp, relayed``) measures it as the direct rows are measured, the way a user
runs successive copies: through the consumer's node process (erin relayed,
frank hole-punched), whose session and relay registration stay warm between
copies; its first copy, untimed, dials under the broad rule before the first
row, then the rule holds for that node process's own UDP port only, for the
whole run (``gpumesh daemon status --json`` checks after each copy that the
session is still on its path). The same warm consumers also run folder ``cp``,
``run --workdir`` and ``app sync`` of the tree over their paths (rows ``folder
cp, hole-punched`` ... ``app sync, relayed``, next to ``scp -r`` and ``rsync
-a``; the path checked after each run alike). The cold row (``..., cold``) is dave's: each
copy is a new ``python -c`` script that copies with
``gpumesh.Mesh(in_process=True).cp`` (no node process; the CLI has no
in-process mode), so each copy dials afresh under the broad rule (the
script's start, relay registration and punching included in its time; a
script's one ``Node.connect`` checks the path once per row). With
``--trace`` each cold copy prints its dial (which attempts started, failed and
won, and when) and its link's window and losses when it ended, and each warm
row what the consumer's node process logged of its links meanwhile (it then
logs at debug): packets QUIC declared lost at once, with the link's window and
round trip then.
Everything (link, namespaces, processes, files) is removed on exit.

The report has one line per path: its median MB/s in each link row (the
slowest and fastest run beside it) and its ratio to the median of its
baseline in that row, measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _benchlib import (
    IN_PROCESS_CONNECT,
    IN_PROCESS_CP,
    ensure_bytecode,
    exit_cleanly_on_sigterm,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from bulk import gpumesh_command, loopback_sshd, make_nodes, parse_size, running_agent
from dispatch import DEFAULT_IMAGE, remove_containers
from gpumesh.client.node import Node
from gpumesh.runtime.base import LABEL_NODE

MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent
WANLAB = ROOT / "scripts" / "wanlab.sh"
PREFIX = "gmwb"

"""The bench's own lab prefix: it never touches a lab someone built by hand."""
ADDRESS_A = "10.77.0.1"
PORT = 4711
SSH_PORT = 2222
CIPHER = "aes128-gcm@openssh.com"
DEFAULT_ROWS = "20/0,50/0.5,100/1"

# The paths, in the order of the tables; each GPUMesh path names its baseline.
CP, QUIC, FOLDER, WORKDIR, APP = "cp", "cp --no-fast-path", "folder cp", "run --workdir", "app sync"
FOLDER_Q, WORKDIR_Q, APP_Q = "folder cp, QUIC", "run --workdir, QUIC", "app sync, QUIC"
PUNCHED, RELAYED = "cp, hole-punched", "cp, relayed"
PUNCHED_COLD, RELAYED_COLD = (
    "Mesh(in_process=True).cp, hole-punched, cold",
    "Mesh(in_process=True).cp, relayed, cold",
)
FOLDER_P, WORKDIR_P, APP_P = (
    "folder cp, hole-punched",
    "run --workdir, hole-punched",
    "app sync, hole-punched",
)
FOLDER_R, WORKDIR_R, APP_R = "folder cp, relayed", "run --workdir, relayed", "app sync, relayed"
WARM_PATHS = (RELAYED, PUNCHED)
"""Relay paths measured as a user's successive copies: through a consumer's node process."""
WARM_OF = {
    PUNCHED: PUNCHED,
    FOLDER_P: PUNCHED,
    WORKDIR_P: PUNCHED,
    APP_P: PUNCHED,
    RELAYED: RELAYED,
    FOLDER_R: RELAYED,
    WORKDIR_R: RELAYED,
    APP_R: RELAYED,
}
"""Each warm row and the relay path (and so the warm consumer) it takes."""
COLD_OF = {PUNCHED_COLD: PUNCHED, RELAYED_COLD: RELAYED}
"""Each cold row and the path it takes: every copy a new script process that copies
with ``Mesh(in_process=True)`` (a dial of its own)."""
SCP, SCP_R, RSYNC = "scp -c aes128-gcm", "scp -r", "rsync -a"
QUIC_PLAIN = "QUIC, FEC off"
BASELINE = {
    CP: SCP,
    QUIC: SCP,
    QUIC_PLAIN: SCP,
    FOLDER: SCP_R,
    WORKDIR: SCP_R,
    APP: RSYNC,
    FOLDER_Q: SCP_R,
    WORKDIR_Q: SCP_R,
    APP_Q: RSYNC,
    PUNCHED: SCP,
    RELAYED: SCP,
    PUNCHED_COLD: SCP,
    RELAYED_COLD: SCP,
    FOLDER_P: SCP_R,
    WORKDIR_P: SCP_R,
    APP_P: RSYNC,
    FOLDER_R: SCP_R,
    WORKDIR_R: SCP_R,
    APP_R: RSYNC,
}
ONLY = {
    "cp": (CP,),
    "quic": (QUIC,),
    "quic-plain": (QUIC_PLAIN,),
    "folder": (FOLDER,),
    "workdir": (WORKDIR,),
    "app": (APP,),
    "folder-quic": (FOLDER_Q,),
    "workdir-quic": (WORKDIR_Q,),
    "app-quic": (APP_Q,),
    "punched": (PUNCHED, PUNCHED_COLD),
    "relayed": (RELAYED, RELAYED_COLD),
    "punched-warm": (PUNCHED,),
    "relayed-warm": (RELAYED,),
    "punched-cold": (PUNCHED_COLD,),
    "relayed-cold": (RELAYED_COLD,),
    "folder-punched": (FOLDER_P,),
    "workdir-punched": (WORKDIR_P,),
    "app-punched": (APP_P,),
    "folder-relayed": (FOLDER_R,),
    "workdir-relayed": (WORKDIR_R,),
    "app-relayed": (APP_R,),
    "scp": (SCP,),
    "scp-r": (SCP_R,),
    "rsync": (RSYNC,),
}
"""``--only`` keys and the paths they name (``punched``, ``relayed``: the file's copy warm
and cold)."""
RELAY_ADDRESS = "10.77.0.1:4799"
"""gpumesh-relay runs on host A, beside the provider: a relayed session crosses the
link once, as it would to a relay near the provider."""
Rule = tuple[str, str, list[str]]
"""An iptables rule: host, chain, rule."""


def block_rule(path: str, *, port: int | None = None, spare: int | None = None) -> Rule:
    """The firewall rule that makes ``path`` for a consumer on host B: only for its
    packets from UDP ``port`` (a node process's shared socket), else for every port
    but ``spare`` (another consumer's, whose warm session must not be touched).

    Relayed: host B drops what goes to the provider's port (so the dial and hole
    punching fail). Hole-punched: host A's firewall drops what comes from host B to
    that port unasked, as a NAT or a stateful firewall in front of the provider
    does (the dial goes through the relay; the provider's probes open the way for
    host B's answers, and punching moves the session to a direct path). An
    earlier rule dropped every QUIC long header to the port instead: that also
    dropped the punched session's own last Initial (and, sent in one GSO buffer
    with it, the client's Finished), so every hole-punched copy lost its
    handshake's first 1-RTT packets and left slow start at a window of 12 KB."""
    ports = ["--sport", str(port)] if port is not None else []
    if port is None and spare is not None:
        ports = ["!", "--sport", str(spare)]
    if path == RELAYED:
        return ("B", "OUTPUT", ["-p", "udp", "-d", ADDRESS_A, *ports, "--dport", str(PORT),
                                "-j", "DROP"])  # fmt: skip
    return (
        "A",
        "INPUT",
        [
            *("-p", "udp", "-s", "10.77.0.2", *ports, "--dport", str(PORT)),
            *("-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"),
        ],
    )


@dataclass
class Runs:
    """One path's runs in one row."""

    mbps: list[float] = field(default_factory=list)
    stalled: bool = False
    note: str = ""


@dataclass
class Row:
    rtt: float
    loss: float
    paths: dict[str, Runs] = field(default_factory=dict)
    connect_wall: list[float] = field(default_factory=list)
    connect_own: list[float] = field(default_factory=list)
    channel_congestion: set[str] = field(default_factory=set)
    paths_checked: dict[str, str] = field(default_factory=dict)
    """What ``connect`` said dave's path was, per relay path, once per row."""

    @property
    def label(self) -> str:
        return f"{self.rtt:g} ms, {self.loss:g}%"


class Stalled(Exception):
    """A command ran past the limit and was killed."""


# --- the lab -----------------------------------------------------------------------------


def lab(*args: str) -> str:
    """Run ``wanlab.sh`` with the bench's prefix; its output (it prints what it set up)."""
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


def link_options(row: Row, seed: int) -> list[str]:
    return ["--delay", f"{row.rtt / 2:g}", "--loss", f"{row.loss:g}", "--seed", str(seed)]


def on(side: str) -> list[str]:
    return ["ip", "netns", "exec", f"{PREFIX}{side}"]


def lab_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and a TUN device)"
    if shutil.which("ip") is None:
        return "ip (iproute2) is not installed"
    if not Path("/dev/net/tun").exists():
        return "/dev/net/tun is missing"
    return None


@contextlib.contextmanager
def wan_lab(first: Row, seed: int) -> Iterator[str]:
    try:
        yield lab("up", *link_options(first, seed))
    finally:
        with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
            lab("down")


# --- one timed command -------------------------------------------------------------------


def timed(
    command: Sequence[str],
    limit: float,
    env: dict[str, str] | None = None,
    *,
    stderr: list[str] | None = None,
) -> tuple[float, str]:
    """(seconds, stdout) of a whole process run on host B; Stalled past ``limit``.
    ``stderr``: where its standard error's lines go (else only into a failure's error)."""
    started = time.perf_counter()
    with subprocess.Popen(
        [*on("B"), *command],
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
            raise Stalled from None
    seconds = time.perf_counter() - started
    if stderr is not None:
        stderr.extend(err.splitlines())
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:3])} failed (exit {proc.returncode}): {err.strip()}"
        )
    return seconds, out


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# --- the run -----------------------------------------------------------------------------


@dataclass
class WarmConsumer:
    """A consumer with carol's settings and the relay whose copies go through its node
    process, as a user's successive commands do: its session (and relay registration)
    stays warm between copies. Its path's firewall rule holds for its own UDP port
    from its first copy on, so the session cannot drift to another path."""

    name: str
    env: dict[str, str]
    sandbox: Path
    port: int | None = None
    """Its node process's shared UDP port, once its first copy opened it."""
    path: str = ""
    """The path its warm session took, as ``daemon status`` says."""
    log_seen: int = 0
    """``--trace``: how much of its node process's log was already printed."""

    def new_log_lines(self) -> list[str]:
        """``--trace``: what its node process logged since the last call."""
        log = Path(self.env["GPUMESH_HOME"]) / "logs" / "node.log"
        with contextlib.suppress(OSError), log.open("rb") as file:
            file.seek(self.log_seen)
            text = file.read()
            self.log_seen += len(text)
            return text.decode(errors="replace").splitlines()
        return []


@dataclass
class Setup:
    tmp: Path
    source: Path
    tree: Path
    size: int
    tree_size: int
    sandbox: Path
    env: dict[str, str]
    """bob's CLI environment."""
    quic_sandbox: Path
    quic_env: dict[str, str]
    """carol's CLI environment: the same as bob's, with the data channel off."""
    relay_sandbox: Path
    relay_env: dict[str, str]
    """dave's: carol's settings, and the relay; for the cold rows' in-process scripts."""
    warm: dict[str, WarmConsumer]
    """The consumer of each warm relay path (erin: relayed, frank: hole-punched)."""
    ssh: list[str] | None
    ssh_note: str
    docker_note: str | None
    args: argparse.Namespace
    counter: int = 0

    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}-{self.counter}"

    def consumer(self, via: str) -> tuple[dict[str, str], Path]:
        """The CLI environment and the provider's sandbox of the consumer ``via`` names:
        ``bob``, ``carol`` (data channel off), or a warm relay path's consumer."""
        if via == "bob":
            return self.env, self.sandbox
        if via == "carol":
            return self.quic_env, self.quic_sandbox
        return self.warm[via].env, self.warm[via].sandbox


def gm(*args: str) -> list[str]:
    return [*gpumesh_command(), *args]


def run_cp(setup: Setup, row: Row, *, fast: bool, fec: bool = True) -> float:
    name = setup.fresh("file") + ".bin"
    flags = [] if fast else ["--no-fast-path"]
    seconds, out = timed(
        gm("cp", "--json", *flags, str(setup.source), f"alice:/wan/{name}"),
        setup.args.limit,
        setup.env if fec else dict(setup.env, GPUMESH_FEC="off"),
    )
    result = json.loads(out)
    arrived = setup.sandbox / "wan" / name
    size = arrived.stat().st_size
    arrived.unlink()
    if size != setup.size or result["resumed_from"] != 0:
        raise RuntimeError(f"gpumesh cp did not copy all {setup.size} bytes: {result}")
    if fast:
        if result["channel"] != "tls":
            raise RuntimeError("gpumesh cp did not take the data channel on a direct path")
        row.channel_congestion.add(str(result.get("congestion") or "unknown"))
    return setup.size / seconds / 1e6


def run_folder(setup: Setup, _row: Row, *, via: str = "bob") -> float:
    name = setup.fresh("tree")
    env, sandbox = setup.consumer(via)
    seconds, _ = timed(
        gm("cp", "--json", str(setup.tree), f"alice:/wan/{name}"), setup.args.limit, env
    )
    arrived = sandbox / "wan" / name
    check_tree(arrived, setup.tree_size, "gpumesh cp")
    return setup.tree_size / seconds / 1e6


def check_tree(arrived: Path, size: int, what: str) -> None:
    got = tree_bytes(arrived) if arrived.is_dir() else -1
    shutil.rmtree(arrived, ignore_errors=True)
    if got != size:
        raise RuntimeError(f"{what} delivered {got} of {size} bytes")


def run_workdir(setup: Setup, _row: Row, *, via: str = "bob") -> float:
    seconds, _ = timed(
        gm(
            "run",
            "--peer",
            "alice",
            "--image",
            setup.args.image,
            "--workdir",
            str(setup.tree),
            "-q",
            "--",
            "true",
        ),
        setup.args.limit,
        setup.consumer(via)[0],
    )
    return setup.tree_size / seconds / 1e6


def run_app(setup: Setup, _row: Row, *, via: str = "bob") -> float:
    # A new app each time (a first sync): hard links of the tree under a fresh name.
    app = setup.tmp / "apps" / setup.fresh("app")
    shutil.copytree(setup.tree, app, copy_function=os.link)
    env, sandbox = setup.consumer(via)
    try:
        seconds, _ = timed(
            gm("app", "sync", "--json", "--peer", "alice", "--dir", str(app)),
            setup.args.limit,
            env,
        )
    finally:
        shutil.rmtree(app, ignore_errors=True)
    shutil.rmtree(sandbox / "apps" / app.name, ignore_errors=True)
    return setup.tree_size / seconds / 1e6


def run_scp(setup: Setup, _row: Row) -> float:
    assert setup.ssh is not None
    target = setup.tmp / "ssh-in" / (setup.fresh("scp") + ".bin")
    seconds, _ = timed(
        ["scp", "-q", "-c", CIPHER, *setup.ssh, str(setup.source), f"bench:{target}"],
        setup.args.limit,
    )
    size = target.stat().st_size
    target.unlink()
    if size != setup.size:
        raise RuntimeError(f"scp copied {size} of {setup.size} bytes")
    return setup.size / seconds / 1e6


def run_scp_r(setup: Setup, _row: Row) -> float:
    assert setup.ssh is not None
    target = setup.tmp / "ssh-in" / setup.fresh("scp-r")
    seconds, _ = timed(
        ["scp", "-q", "-r", "-c", CIPHER, *setup.ssh, str(setup.tree), f"bench:{target}"],
        setup.args.limit,
    )
    check_tree(target, setup.tree_size, "scp -r")
    return setup.tree_size / seconds / 1e6


def run_rsync(setup: Setup, _row: Row) -> float:
    assert setup.ssh is not None
    target = setup.tmp / "ssh-in" / setup.fresh("rsync")
    shell = " ".join(["ssh", "-c", CIPHER, *setup.ssh])
    seconds, _ = timed(
        ["rsync", "-a", "-e", shell, f"{setup.tree}/", f"bench:{target}/"], setup.args.limit
    )
    check_tree(target, setup.tree_size, "rsync -a")
    return setup.tree_size / seconds / 1e6


@contextlib.contextmanager
def blocked(rule: tuple[str, str, list[str]]) -> Iterator[None]:
    """``rule`` (host, chain, rule) in that host's firewall for the block."""
    side, chain, spec = rule
    subprocess.run([*on(side), "iptables", "-I", chain, *spec], check=True)
    try:
        yield
    finally:
        subprocess.run([*on(side), "iptables", "-D", chain, *spec], check=False)


def want_path(path: str) -> str:
    return "hole-punched" if path == PUNCHED else "relayed"


def copy_checked(
    setup: Setup, env: dict[str, str], sandbox: Path, what: str, *, in_process: bool = False
) -> float:
    """Seconds of one whole ``cp`` of the file (QUIC) with ``env``; checked and removed.
    ``in_process``: a script's ``Mesh(in_process=True).cp`` instead of ``gpumesh cp``."""
    name = setup.fresh("relay") + ".bin"
    log: list[str] | None = [] if setup.args.trace else None
    if log is not None:  # a warm consumer's own level (its node process's) is kept
        env = dict(env, GPUMESH_LOG=env.get("GPUMESH_LOG", TRACE_LOG))
    ends = (str(setup.source), f"alice:/wan/{name}")
    command = (
        [sys.executable, "-c", IN_PROCESS_CP, *ends] if in_process else gm("cp", "--json", *ends)
    )
    seconds, _ = timed(command, setup.args.limit, env, stderr=log)
    for line in log or ():
        if any(mark in line for mark in TRACE_MARKS):
            print(f"    {what} ({seconds:.2f} s): {line.strip()}", flush=True)
    arrived = sandbox / "wan" / name
    size = arrived.stat().st_size
    arrived.unlink()
    if size != setup.size:
        raise RuntimeError(f"gpumesh cp ({what}) copied {size} of {setup.size} bytes")
    return seconds


TRACE_LOG = (
    "warning,gpumesh.client.node=info,gpumesh.transport.quic=debug,gpumesh.transport.endpoint=debug,"
    "gpumesh.transport.relayclient=info"
)
"""``--trace``: what a cold copy logs (its dial, and its link's recovery at the end)."""
TRACE_MARKS = ("session with", "ended:", "parity on", "at once", "direct path")


def run_cold(setup: Setup, row: Row, *, cold: str) -> float:
    """The file copied by dave (QUIC) from a new script process with
    ``Mesh(in_process=True).cp`` (a fresh dial each time), with the firewall making
    his path (sparing the warm hole-punched consumer's port)."""
    path = COLD_OF[cold]
    punched = setup.warm.get(PUNCHED)
    spare = None if punched is None else punched.port
    with blocked(block_rule(path, spare=spare)):
        if cold not in row.paths_checked:
            dial = [sys.executable, "-c", IN_PROCESS_CONNECT, "alice"]
            _, out = timed(dial, setup.args.limit, setup.relay_env)
            got = str(json.loads(out)["path"])
            if want_path(path) not in got:
                raise RuntimeError(f"{cold}: dave's session took the path {got!r}")
            row.paths_checked[cold] = got
            print(f"  {cold}: Node.connect says the path is {got!r}", flush=True)
        seconds = copy_checked(setup, setup.relay_env, setup.relay_sandbox, cold, in_process=True)
    return setup.size / seconds / 1e6


def node_view(consumer: WarmConsumer, limit: float) -> dict[str, Any]:
    """``gpumesh daemon status --json`` of the consumer's node process."""
    _, out = timed(gm("daemon", "status", "--json"), limit, consumer.env)
    view = json.loads(out)["node"]
    if view is None:
        raise RuntimeError(f"{consumer.name}'s node process is not running")
    return dict(view)


def session_path(consumer: WarmConsumer, limit: float) -> tuple[str, int | None]:
    """The path of the consumer's warm session to alice and its shared UDP port."""
    view = node_view(consumer, limit)
    paths = [str(s["path"]) for s in view["warm_sessions"] if s["peer"] == "alice"]
    port = view["outgoing"]["port"] if view.get("outgoing") else None
    return (paths[0] if paths else "none"), port


def warm_up(setup: Setup, path: str, stack: contextlib.ExitStack) -> None:
    """The consumer's first copy (untimed: the cold rows show what a first dial costs)
    under the broad rule for its path, then that rule for its own port only, kept."""
    consumer = setup.warm[path]
    stack.callback(stop_node, consumer)
    if setup.args.trace:  # its node process logs at the level of the command that starts it
        consumer.env["GPUMESH_LOG"] = "debug"
    punched = setup.warm.get(PUNCHED)
    spare = None if punched is None or punched is consumer else punched.port
    with blocked(block_rule(path, spare=spare)):
        try:
            copy_checked(setup, consumer.env, consumer.sandbox, f"{path}, first copy")
        except RuntimeError:
            log = Path(consumer.env["GPUMESH_HOME"]) / "logs" / "node.log"
            if log.exists():
                print("\n".join(log.read_text().splitlines()[-15:]), file=sys.stderr)
            raise
        got, port = session_path(consumer, setup.args.limit)
        if want_path(path) not in got or port is None:
            raise RuntimeError(f"{path}: {consumer.name}'s session took the path {got!r}")
        stack.enter_context(blocked(block_rule(path, port=port)))
    consumer.port, consumer.path = port, got
    print(f"{path} (warm): {consumer.name}'s node process, UDP port {port}: {got!r}", flush=True)


def stop_node(consumer: WarmConsumer) -> None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            [*on("B"), *gm("daemon", "stop")],
            env=consumer.env,
            capture_output=True,
            timeout=30,
            check=False,
        )


WARM_BULK: dict[str, Callable[..., float]] = {
    FOLDER_P: run_folder,
    FOLDER_R: run_folder,
    WORKDIR_P: run_workdir,
    WORKDIR_R: run_workdir,
    APP_P: run_app,
    APP_R: run_app,
}
"""The warm rows other than ``cp`` and what each runs (by the path's warm consumer)."""


def run_warm(setup: Setup, row: Row, *, name: str) -> float:
    """Row ``name`` (``cp`` of the file, or a folder ``cp``, ``run --workdir`` or ``app
    sync`` of the tree) by its path's warm consumer, through its node process; the
    session it used must still be on the path (checked after the run, untimed)."""
    path = WARM_OF[name]
    consumer = setup.warm[path]
    if name in WARM_BULK:
        mbps = WARM_BULK[name](setup, row, via=path)
    else:
        mbps = setup.size / copy_checked(setup, consumer.env, consumer.sandbox, path) / 1e6
    if setup.args.trace:
        for line in consumer.new_log_lines():
            if any(mark in line for mark in TRACE_MARKS):
                print(f"    {name} ({consumer.name}'s node process): {line.strip()}", flush=True)
    got, _ = session_path(consumer, setup.args.limit)
    if want_path(path) not in got:
        raise RuntimeError(f"{name}: {consumer.name}'s warm session moved to {got!r}")
    if name not in row.paths_checked:
        row.paths_checked[name] = got
        print(f"  {name}: the node process says the path is {got!r}", flush=True)
    return mbps


def run_connect(setup: Setup, row: Row) -> None:
    # --fresh: a new dial each time, not the node process's warm session.
    seconds, out = timed(gm("connect", "--fresh", "--json", "alice"), setup.args.limit, setup.env)
    row.connect_wall.append(seconds * 1000)
    row.connect_own.append(float(json.loads(out)["connect_ms"]))


def runners(setup: Setup) -> dict[str, Callable[[Setup, Row], float]]:
    chosen: dict[str, Callable[[Setup, Row], float]] = {
        CP: lambda s, r: run_cp(s, r, fast=True),
        QUIC: lambda s, r: run_cp(s, r, fast=False),
        QUIC_PLAIN: lambda s, r: run_cp(s, r, fast=False, fec=False),
        FOLDER: run_folder,
    }
    if setup.docker_note is None:
        chosen[WORKDIR] = run_workdir
    chosen[APP] = run_app
    chosen[FOLDER_Q] = lambda s, r: run_folder(s, r, via="carol")
    if setup.docker_note is None:
        chosen[WORKDIR_Q] = lambda s, r: run_workdir(s, r, via="carol")
    chosen[APP_Q] = lambda s, r: run_app(s, r, via="carol")
    for name, path in WARM_OF.items():
        if path in setup.warm and (setup.docker_note is None or name not in (WORKDIR_P, WORKDIR_R)):
            chosen[name] = functools.partial(run_warm, name=name)
    if setup.relay_env:
        chosen[PUNCHED_COLD] = lambda s, r: run_cold(s, r, cold=PUNCHED_COLD)
        chosen[RELAYED_COLD] = lambda s, r: run_cold(s, r, cold=RELAYED_COLD)
    if setup.ssh is not None:
        chosen[SCP] = run_scp
        chosen[SCP_R] = run_scp_r
        if shutil.which("rsync"):
            chosen[RSYNC] = run_rsync
    if setup.args.only:
        chosen = {name: run for name, run in chosen.items() if name in setup.args.only}
    return chosen


def measure_row(setup: Setup, row: Row) -> None:
    chosen = runners(setup)
    names = list(chosen)
    for name in names:
        row.paths[name] = Runs()
    for index in range(setup.args.repeat):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            path = row.paths[name]
            if path.stalled:
                continue
            try:
                mbps = chosen[name](setup, row)
            except Stalled:
                path.stalled = True
                print(f"  run {index + 1}: {name:<18} timed out (> {setup.args.limit:g} s)")
                continue
            path.mbps.append(mbps)
            print(f"  run {index + 1}: {name:<18} {mbps:8.1f} MB/s", flush=True)
        run_connect(setup, row)


def docker_missing(image: str) -> str | None:
    if shutil.which("docker") is None:
        return "docker is not installed"
    try:
        result = subprocess.run(
            ["docker", "image", "inspect", "--format", "{{.Id}}", image],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run docker: {exc}"
    if result.returncode != 0:
        return (
            f"docker cannot use image {image} (scripts/ensure-docker.sh starts dockerd "
            "and builds the offline test image)"
        )
    return None


def make_tree(root: Path, files: int, size: int) -> None:
    each, extra = divmod(size, files)
    chunk = os.urandom(MIB)
    for index in range(files):
        folder = root / f"d{index // 100:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        want = each + (1 if index < extra else 0)
        with (folder / f"f{index:05d}.bin").open("wb") as out:
            written = 0
            while written < want:
                piece = index.to_bytes(8, "big") + chunk[8 : min(MIB, want - written)]
                out.write(piece[: want - written])
                written += len(piece[: want - written])


def quic_consumer(home: Path, alice: Node, name: str, relay: str | None = None) -> Node:
    """A consumer paired with alice both ways whose data channel is off (and who
    knows ``relay``)."""
    node = Node(home)
    node.init(name)
    node.pair(alice.pairing_code())
    alice.pair(node.pairing_code())
    node.home.config.set("data_channel", "off")
    if relay:
        node.home.config.set("relay", relay)
    node.home.config.save()
    node.home.reload_config()
    return node


def relay_missing() -> str | None:
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    if not (Path(sys.executable).parent / "gpumesh-relay").exists():
        return "gpumesh-relay is not installed beside this Python"
    return None


@contextlib.contextmanager
def running_relay(log: Path) -> Iterator[None]:
    """``gpumesh-relay`` on host A until the block ends; then what it forwarded and
    what it dropped (its stats file, written at exit)."""
    relay = str(Path(sys.executable).parent / "gpumesh-relay")
    stats = log.with_suffix(".json")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*on("A"), relay, "--listen", RELAY_ADDRESS, "--open", "--log-level", "warning",
             "--stats-file", str(stats)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError, ValueError):
            counters = json.loads(stats.read_text())
            print(
                f"  relay: {counters.get('packets_sent', '?')} packets forwarded, "
                f"{counters.get('dropped_queue_full', '?')} dropped for a full queue",
                flush=True,
            )


def wait_registered(home: Path) -> str | None:
    """None once alice's share has registered with the relay, else why not."""
    env = dict(os.environ, GPUMESH_HOME=str(home))
    env.pop("GPUMESH_LOG", None)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = subprocess.run(
            [*on("A"), *gm("status", "--json")],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode == 0:
            state = json.loads(result.stdout).get("relay_state") or ""
            if "registered" in state:
                return None
        time.sleep(0.3)
    return "the provider did not register with the relay within 30 s"


def write_source(path: Path, size: int) -> None:
    chunk = os.urandom(MIB)
    with path.open("wb") as out:
        written = 0
        while written < size:
            piece = chunk[: min(MIB, size - written)]
            out.write(piece)
            written += len(piece)


def run(args: argparse.Namespace, rows: list[Row]) -> None:
    with contextlib.ExitStack() as stack:
        shm_parent = "/dev/shm" if Path("/dev/shm").is_dir() else None
        tmp = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="gpumesh-wan-", dir=shm_parent))
        )
        print(f"Writing a {args.size / MIB:g} MiB file and a tree of {args.files} files...")
        source, tree = tmp / "source.bin", tmp / "tree"
        write_source(source, args.size)
        make_tree(tree, args.files, args.size)
        (tmp / "ssh-in").mkdir()
        (tmp / "apps").mkdir()
        alice, bob = make_nodes(tmp, PORT, ADDRESS_A)
        # alice shares from a namespace of her own while the engine stays in this
        # machine's: job network rules made there would filter nothing.
        alice.home.config.set("job_network", "bridge")
        alice.home.config.save()
        alice_id = str(alice.info().node_id)
        sandbox = tmp / "a" / "files" / str(bob.info().node_id)
        carol = quic_consumer(tmp / "c", alice, "carol")
        quic_sandbox = tmp / "a" / "files" / str(carol.info().node_id)
        relay_note = relay_missing()
        dave = None if relay_note else quic_consumer(tmp / "d", alice, "dave", RELAY_ADDRESS)
        relay_sandbox = tmp / "a" / "files" / (str(dave.info().node_id) if dave else "-")
        warm_homes: dict[str, tuple[str, Path]] = {}
        if dave is not None:
            alice.home.config.set("relay", RELAY_ADDRESS)
            alice.home.config.save()
            dave.close()
            wanted = {WARM_OF[name] for name in args.only or WARM_OF if name in WARM_OF}
            for path, who in ((RELAYED, "erin"), (PUNCHED, "frank")):
                if path in wanted:
                    node = quic_consumer(tmp / who[0], alice, who, RELAY_ADDRESS)
                    warm_homes[path] = (who, tmp / "a" / "files" / str(node.info().node_id))
                    node.close()
        alice.close()
        bob.close()
        carol.close()
        print(lab_lines(stack.enter_context(wan_lab(rows[0], args.seed))))
        stack.callback(remove_containers, f"{LABEL_NODE}={alice_id}")
        if relay_note is None:
            stack.enter_context(running_relay(tmp / "relay.log"))
        stack.enter_context(running_agent(tmp / "a", tmp / "agent.log", wrap=on("A")))
        if relay_note is None:
            relay_note = wait_registered(tmp / "a")
        if relay_note:
            print(f"hole-punched and relayed rows: {relay_note}")
        ssh, ssh_note = None, "skipped (--no-scp)"
        if not args.no_scp:
            ssh, why = stack.enter_context(
                loopback_sshd(tmp / "ssh", address=ADDRESS_A, wrap=on("A"), port=SSH_PORT)
            )
            ssh_note = why or ""
        env = dict(os.environ, GPUMESH_HOME=str(tmp / "b"))
        for name in ("GPUMESH_LOG", "GPUMESH_PEER", "GPUMESH_IMAGE"):
            env.pop(name, None)
        quic_env = dict(env, GPUMESH_HOME=str(tmp / "c"))
        # No node process (in-process scripts): each run dials afresh under its own rule. A warm
        # session in dave's node process would outlive the rule it was made under (a
        # punched path black-holed by the relayed rule: measured 0.5-0.9 MB/s).
        relay_env = {} if relay_note else dict(env, GPUMESH_HOME=str(tmp / "d"))
        setup = Setup(
            tmp=tmp,
            source=source,
            tree=tree,
            size=args.size,
            tree_size=tree_bytes(tree),
            sandbox=sandbox,
            env=env,
            quic_sandbox=quic_sandbox,
            quic_env=quic_env,
            relay_sandbox=relay_sandbox,
            relay_env=relay_env,
            warm={
                path: WarmConsumer(who, dict(env, GPUMESH_HOME=str(tmp / who[0])), box)
                for path, (who, box) in warm_homes.items()
                if not relay_note
            },
            ssh=ssh,
            ssh_note=ssh_note,
            docker_note=None if args.no_docker else docker_missing(args.image),
            args=args,
        )
        if args.no_docker:
            setup.docker_note = "skipped (--no-docker)"
        if setup.docker_note:
            print(f"run --workdir: {setup.docker_note}")
        if ssh is None:
            print(f"scp, scp -r, rsync: {ssh_note}")
        # Untimed warm-up on the first link: first-use costs of both tools.
        run_connect(setup, Row(0, 0))
        for path in WARM_PATHS:  # relayed first: its broad rule would cut a punched path
            if path in setup.warm:
                warm_up(setup, path, stack)
        for index, row in enumerate(rows):
            if index:
                print(lab_lines(lab("link", *link_options(row, args.seed))))
            print(f"RTT {row.rtt:g} ms, {row.loss:g}% loss each way:", flush=True)
            before = {side: udp_counters(side) for side in ("A", "B")}
            measure_row(setup, row)
            print(lab_lines(lab("stats")))
            print(lab_lines(udp_drops(before)))
        report(args, rows, setup)


def udp_counters(side: str) -> dict[str, int]:
    """The kernel's UDP counters in host ``side``'s namespace (``/proc/net/snmp``)."""
    text = subprocess.run(
        [*on(side), "cat", "/proc/net/snmp"], capture_output=True, text=True, check=False
    ).stdout
    lines = [line.split() for line in text.splitlines() if line.startswith("Udp:")]
    counters = {}
    if len(lines) >= 2:
        counters = dict(zip(lines[0][1:], map(int, lines[1][1:]), strict=False))
    dropped = subprocess.run(
        [*on(side), "cat", "/sys/class/net/wan/statistics/tx_dropped"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    counters["TxDropped"] = int(dropped) if dropped.isdigit() else 0
    return counters


def udp_drops(before: dict[str, dict[str, int]]) -> str:
    """What each host's kernel dropped of UDP since ``before`` (full receive buffers)."""
    parts = []
    for side in ("A", "B"):
        now = udp_counters(side)
        was = before.get(side, {})
        got = {k: now.get(k, 0) - was.get(k, 0) for k in now}
        parts.append(
            f"host {side}: {got['InDatagrams']} UDP datagrams in, {got['RcvbufErrors']} dropped "
            f"for a full receive buffer ({got['InErrors']} errors in all), "
            f"{got['TxDropped']} dropped by its link device before the link took them"
        )
    return "; ".join(parts)


def lab_lines(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


# --- the report --------------------------------------------------------------------------


def median(path: Runs | None) -> float | None:
    return summarize(path.mbps).p50 if path and path.mbps else None


def cell(path: Runs | None, limit: float, size: int) -> str:
    if path is None:
        return "-"
    value = median(path)
    if value is None:
        return f"timed out (< {size / limit / 1e6:.2g})" if path.stalled else "-"
    text = f"{value:.1f}"
    return text + " (1 timed out)" if path.stalled else text


def ratio(row: Row, name: str, limit: float, size: int) -> str:
    """Row ``name``'s median over its baseline's in ``row`` (a bound if it timed out)."""
    if name not in BASELINE or BASELINE[name] not in row.paths:
        return ""
    ours, theirs = median(row.paths.get(name)), median(row.paths.get(BASELINE[name]))
    if ours is not None and theirs:
        return f"{ours / theirs:.2f}x"
    if row.paths[name].stalled and theirs:
        return f"< {size / limit / 1e6 / theirs:.2f}x"
    return "-"


def report(args: argparse.Namespace, rows: list[Row], setup: Setup) -> None:
    order = (
        CP,
        QUIC,
        QUIC_PLAIN,
        FOLDER,
        FOLDER_Q,
        WORKDIR,
        WORKDIR_Q,
        APP,
        APP_Q,
        PUNCHED,
        PUNCHED_COLD,
        FOLDER_P,
        WORKDIR_P,
        APP_P,
        RELAYED,
        RELAYED_COLD,
        FOLDER_R,
        WORKDIR_R,
        APP_R,
        SCP,
        SCP_R,
        RSYNC,
    )
    names = [n for n in order if n in rows[0].paths]
    print(
        f"\nOver the WAN lab, {args.size / MIB:g} MiB (file; tree of {args.files} files), "
        f"up to {args.repeat} runs of each, whole processes; MB/s = 10^6 bytes/s, median "
        f"(slowest-fastest run); timed out: killed after {args.limit:g} s; x: the median "
        "against the median of what a user would otherwise run (> 1: GPUMesh faster)"
    )
    header = ["path", "against"]
    for row in rows:
        header += [f"{row.label}: MB/s", "x"]
    table = []
    for name in names:
        cells = [name, BASELINE.get(name, "")]
        for row in rows:
            runs = row.paths.get(name)
            text = cell(runs, args.limit, setup.size)
            if runs is not None and len(runs.mbps) > 1:
                text += f" ({min(runs.mbps):.1f}-{max(runs.mbps):.1f})"
            cells += [text, ratio(row, name, args.limit, setup.size)]
        table.append(cells)
    connect = ["connect ms (own)", ""]
    for row in rows:
        if row.connect_wall:
            wall, own = summarize(row.connect_wall).p50, summarize(row.connect_own).p50
            connect += [f"{wall:.0f} ({own:.0f})", ""]
        else:
            connect += ["-", ""]
    print_rows(header, [*table, connect])
    congestion = sorted(set().union(*(row.channel_congestion for row in rows)))
    print(f"  data channel's TCP congestion control (cp --json): {', '.join(congestion) or '-'}")
    if WORKDIR in names:
        print("  run --workdir includes starting and running one container (`true`)")
    print("  app sync: a first sync of the tree as a new app; rsync -a to a new folder")
    print(
        "  connect: the whole `gpumesh connect --fresh` process (a new dial by the node "
        "process), and (in brackets) what it reports"
    )
    print(
        "  warm rows (successive copies through the consumer's node process, its session "
        "and relay registration kept): cp, cp --no-fast-path, QUIC FEC off, folder cp, "
        "run --workdir, app sync (and their QUIC rows); over the hole-punched and the "
        "relayed path each: cp, folder cp, run --workdir, app sync"
    )
    print(
        "  cold rows (each copy a new python -c script with Mesh(in_process=True).cp, no "
        "node process: its start, dial, relay registration and punching in its time): "
        f"{PUNCHED_COLD}, {RELAYED_COLD}"
    )


# --- command line ------------------------------------------------------------------------


def parse_rows(text: str) -> list[Row]:
    rows = []
    for item in text.split(","):
        try:
            rtt, loss = item.split("/")
            row = Row(float(rtt), float(loss))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not RTT/LOSS: {item!r} (e.g. 50/0.5: 50 ms RTT, 0.5% loss each way)"
            ) from None
        if row.rtt < 0 or not 0 <= row.loss < 100:
            raise argparse.ArgumentTypeError(f"out of range: {item!r}")
        rows.append(row)
    return rows


def parse_only(text: str) -> set[str]:
    chosen: set[str] = set()
    for key in text.split(","):
        if key.strip() not in ONLY:
            raise argparse.ArgumentTypeError(f"unknown path {key!r}: one of {', '.join(ONLY)}")
        chosen.update(ONLY[key.strip()])
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="GPUMesh's bulk paths over an emulated WAN link (scripts/wanlab.sh), "
        "next to scp and rsync over the same link, in one run. Needs root.",
    )
    parser.add_argument(
        "--rows",
        type=parse_rows,
        default=parse_rows(DEFAULT_ROWS),
        help=f"RTT ms / loss %% each way, comma-separated (default {DEFAULT_ROWS})",
    )
    parser.add_argument(
        "--size", type=parse_size, default=32 * MIB, help="bytes of the file and of the tree (32M)"
    )
    parser.add_argument("--files", type=int, default=64, help="files in the tree (default 64)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each path (default 3)")
    parser.add_argument(
        "--limit", type=float, default=45.0, help="seconds before a run counts as stalled (45)"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the link's losses")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="image for run --workdir")
    parser.add_argument("--no-docker", action="store_true", help="leave run --workdir out")
    parser.add_argument("--no-scp", action="store_true", help="measure GPUMesh only")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 16M, 1 run of each, 20 s limit"
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="print each cold copy's dial (attempts, and when each started and won) "
        "and its link's losses when it ended; for warm rows, what the node process "
        "logged of its links during each run (losses declared at once, parity)",
    )
    parser.add_argument(
        "--only",
        type=parse_only,
        default=None,
        help=f"measure only these paths, comma-separated: {', '.join(ONLY)}",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeat, args.limit = 16 * MIB, 1, 20.0
    if args.size < args.files or args.files < 1:
        parser.error("--size must be at least --files bytes, --files at least 1")
    if args.repeat < 1 or args.limit <= 0:
        parser.error("--repeat must be at least 1 and --limit positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Parity is off by default; the FEC rows measure `auto` on both nodes (and the
    # "FEC off" row turns it off for bob's command), unless the caller chose.
    os.environ.setdefault("GPUMESH_FEC", "auto")
    exit_cleanly_on_sigterm()
    if missing := lab_missing():
        print(f"wan.py: the WAN lab cannot be built here: {missing}")
        return 0
    if note := source_note():
        print(note)
    ensure_bytecode()
    try:
        run(args, args.rows)
    except KeyboardInterrupt:
        return interrupted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
