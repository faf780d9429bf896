"""The desktop tunnel next to `ssh -L` (aes128-gcm) and a direct connection.

A `gpumesh share` provider (alice) shares a local TCP server as its desktop;
bob runs `gpumesh desktop connect alice` (the real CLI, its own process). The
same server is reached three ways, side by side in one run: through the
tunnel, through `ssh -c aes128-gcm@openssh.com -L` to a throwaway loopback
sshd (bench/sshd.sh), and directly. Figures:

* bulk: ``--size`` MiB sent to the server, which answers how many it got after
  the client's half-close; MB/s, median of ``--repeat`` taken in turns across the
  paths (goal: the tunnel at least 1.2x `ssh -L`), and the CPU the two ends of
  each path spent per GB (the tunnel and the provider's agent; ssh and sshd).
* round trip: ``--pings`` 64-byte request/response exchanges on one connection;
  p50 and p90 (goal: the tunnel's p50 no more than `ssh -L`'s), and the ends'
  CPU per round trip. The tunnel's data channel moves sealed frames (AES-128-GCM,
  up to 256 KiB each, one AEAD call per frame) once its TLS handshake is done;
  ``--baseline REV`` adds the tunnel of an earlier revision (TLS records) to
  these two tables.
* VNC full-screen update: with Xvfb and x11vnc installed, ``--updates`` full
  framebuffer updates of a 1280x800 screen in one `vncdo` session, per update.
* deny: from spawning `gpumesh desktop deny bob` until an open tunnelled
  connection reads EOF (goal: within 1 s), and from the same change made in
  this process (no CLI start-up) until then; nothing to compare with.

Everything it starts (agent, tunnel, sshd, X) is stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from _benchlib import (
    exit_cleanly_on_sigterm,
    free_port,
    interrupted,
    print_rows,
    source_note,
    summarize,
)
from bulk import gpumesh_command, loopback_sshd, make_nodes, running_agent
from gpumesh.daemon.client import NoAnswer, NodeClient

MIB = 1024 * 1024
CIPHER = "aes128-gcm@openssh.com"
BULK_GOAL = 1.2
DENY_GOAL = 1.0
X11VNC_FLAGS = ("-localhost", "-nopw", "-forever", "-shared", "-nocursor", "-quiet")
SSH_ROW = "ssh -L (aes128-gcm)"
PEER = "alice"
CONSUMER = "bob"


# --- the server every path reaches ----------------------------------------------------------


def _serve(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def _handle(conn: socket.socket) -> None:
    """First byte ``S``: count what arrives until EOF, answer the count. ``E``: echo."""
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        if mode == b"S":
            total = 0
            buffer = bytearray(MIB)
            while count := conn.recv_into(buffer):
                total += count
            conn.sendall(f"{total}\n".encode())
        elif mode == b"E":
            while data := conn.recv(65536):
                conn.sendall(data)


@contextlib.contextmanager
def target_server() -> Iterator[int]:
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve, args=(listener,), daemon=True).start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.close()


# --- the ways there ---------------------------------------------------------------------------


def wait_port(port: int, proc: subprocess.Popen[bytes] | None = None, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")
        time.sleep(0.05)


@contextlib.contextmanager
def stopping(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def gpumesh(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*gpumesh_command(), *args],
        env=dict(os.environ, GPUMESH_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@contextlib.contextmanager
def tunnel(bob: Path, wrap: tuple[str, ...] = ()) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """`gpumesh desktop connect alice` on a free loopback port (``wrap`` as
    :func:`running_agent`'s)."""
    port = free_port()
    proc = subprocess.Popen(
        [*wrap, *gpumesh_command(), "desktop", "connect", PEER, "--bind", f"127.0.0.1:{port}"],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with stopping(proc):
        wait_port(port, proc)
        yield port, proc


@contextlib.contextmanager
def ssh_forward(ssh_options: list[str], target: int) -> Iterator[tuple[int, int]]:
    """`ssh -L` on a free loopback port: (the port, ssh's process id)."""
    port = free_port()
    proc = subprocess.Popen(
        ["ssh", *ssh_options, "-c", CIPHER, "-N", "-L", f"{port}:127.0.0.1:{target}", "bench"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with stopping(proc):
        wait_port(port, proc)
        yield port, proc.pid


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU these processes and their descendants have spent so far
    (Linux's /proc; 0 elsewhere, and the CPU columns then read 0)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
    total, todo, seen = 0.0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += (_stat(pid) or (0, 0.0))[1]
        todo += children.get(pid, [])
    return total


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --- the measurements -----------------------------------------------------------------------


def bulk(port: int, size: int) -> float:
    """Seconds to send ``size`` bytes and hear that all arrived."""
    block = memoryview(os.urandom(MIB))
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"S")
        sent = 0
        while sent < size:
            conn.sendall(block[: min(MIB, size - sent)])
            sent += min(MIB, size - sent)
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(64):
            answer += chunk
    seconds = time.perf_counter() - started
    if int(answer) != size:
        raise RuntimeError(f"the server got {answer!r} bytes of {size}")
    return seconds


def round_trips(port: int, count: int) -> list[float]:
    request = os.urandom(64)
    samples = []
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(b"E")
        for index in range(count + 10):
            started = time.perf_counter()
            conn.sendall(request)
            got = b""
            while len(got) < len(request):
                got += conn.recv(len(request) - len(got))
            if index >= 10:  # the first few warm the path up
                samples.append(time.perf_counter() - started)
            if got != request:
                raise RuntimeError("the echo differs")
    return samples


def deny_cut(alice: Path, bob: Path, repeat: int) -> tuple[list[float], list[float], list[float]]:
    """Until an open tunnelled connection reads EOF: after spawning `gpumesh desktop
    deny` (and that command's own duration), and after the same change asked of the
    node process's API from this process, which leaves out the CLI's start-up."""
    cuts, commands, direct = [], [], []
    for index in range(2 * repeat):
        in_process = index % 2 == 1
        with tunnel(bob) as (port, _proc), socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"E" + b"x")
            if conn.recv(1) != b"x":
                raise RuntimeError("no echo through the tunnel")
            started = time.perf_counter()
            deny = None
            if in_process:
                path = f"/api/v1/peers/{CONSUMER}/desktop/deny"
                NodeClient(alice).call("POST", path, NoAnswer)
            else:
                deny = subprocess.Popen(
                    [*gpumesh_command(), "desktop", "deny", CONSUMER],
                    env=dict(os.environ, GPUMESH_HOME=str(alice)),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            conn.settimeout(30)
            if conn.recv(1) != b"":
                raise RuntimeError("the connection was not cut")
            (direct if in_process else cuts).append(time.perf_counter() - started)
            if deny is not None:
                deny.wait(timeout=60)
                commands.append(time.perf_counter() - started)
        if gpumesh(alice, "desktop", "allow", CONSUMER).returncode != 0:
            raise RuntimeError("desktop allow failed")
    return cuts, commands, direct


@contextlib.contextmanager
def vnc_server(tmp: Path) -> Iterator[int | None]:
    """x11vnc on a 1280x800 Xvfb with a window on it; None when they are not installed."""
    if not all(shutil.which(p) for p in ("Xvfb", "x11vnc", "xmessage")):
        yield None
        return
    read, write = os.pipe()
    xvfb = subprocess.Popen(
        [
            "Xvfb",
            "-displayfd",
            str(write),
            "-screen",
            "0",
            "1280x800x24",
            "-nolisten",
            "tcp",
            "-noreset",
        ],
        pass_fds=(write,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write)
    with stopping(xvfb), os.fdopen(read) as pipe:
        env = dict(os.environ, DISPLAY=f":{pipe.readline().strip()}", HOME=str(tmp))
        port = free_port()
        window = subprocess.Popen(
            ["xmessage", "-geometry", "900x500+100+100", "a window to draw"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        vnc = subprocess.Popen(
            ["x11vnc", "-display", env["DISPLAY"], "-rfbport", str(port), *X11VNC_FLAGS],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with stopping(window), stopping(vnc):
            wait_port(port, vnc)
            yield port


def vnc_updates(port: int, updates: int, tmp: Path) -> float:
    """Seconds per full-screen update, ``updates`` of them in one vncdo session."""
    vncdo = Path(sys.executable).with_name("vncdo")
    command = [str(vncdo), "-s", f"127.0.0.1::{port}"]
    for index in range(updates):
        command += ["capture", str(tmp / f"screen{index % 2}.png")]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return (time.perf_counter() - started) / updates


# --- the run --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    size = args.size * MIB
    with tempfile.TemporaryDirectory(prefix="gpumesh-desktop-bench-") as where:
        tmp = Path(where)
        alice_node, bob_node = make_nodes(tmp, free_port(kind=socket.SOCK_DGRAM))
        alice_node.close()
        bob_node.close()
        alice, bob = tmp / "a", tmp / "b"
        with contextlib.ExitStack() as stack:
            target = stack.enter_context(target_server())
            agent = stack.enter_context(running_agent(alice, tmp / "agent.log"))
            for command in (
                ("desktop", "share", "--port", str(target)),
                ("desktop", "allow", CONSUMER),
            ):
                if (done := gpumesh(alice, *command)).returncode != 0:
                    raise SystemExit(f"gpumesh {' '.join(command)} failed: {done.stderr}")
            ssh_options, why = stack.enter_context(loopback_sshd(tmp / "ssh"))
            paths: dict[str, int] = {}
            ends: dict[str, list[int]] = {}
            """The processes at each end of a path, whose CPU is counted."""
            port, proc = stack.enter_context(tunnel(bob))
            paths["gpumesh desktop"], ends["gpumesh desktop"] = port, [proc.pid, agent.pid]
            if ssh_options is not None:
                port, ssh_pid = stack.enter_context(ssh_forward(ssh_options, target))
                sshd_pid = int((tmp / "ssh" / "sshd.pid").read_text())
                paths["ssh -L (aes128-gcm)"], ends["ssh -L (aes128-gcm)"] = (
                    port,
                    [ssh_pid, sshd_pid],
                )
            else:
                print(f"note: no `ssh -L` rows: {why}")
            if args.baseline:
                name = f"gpumesh desktop ({args.baseline})"
                paths[name], ends[name] = stack.enter_context(baseline(tmp, target, args.baseline))
            paths["direct"], ends["direct"] = target, []

            print(f"bulk: {args.size} MiB to the server, median of {args.repeat} taken in turns")
            seconds: dict[str, list[float]] = {name: [] for name in paths}
            spent = dict.fromkeys(paths, 0.0)
            for _ in range(args.repeat):
                for name, port in paths.items():
                    before = cpu_seconds(ends[name])
                    seconds[name].append(bulk(port, size))
                    spent[name] += cpu_seconds(ends[name]) - before
            rates = {name: size / summarize(runs).p50 / 1e6 for name, runs in seconds.items()}
            ssh_rate = next((r for n, r in rates.items() if n.startswith("ssh")), None)
            print_rows(
                ["path", "MB/s", "vs ssh -L", "ends' CPU s/GB"],
                [
                    [
                        name,
                        f"{rate:.0f}",
                        f"{rate / ssh_rate:.2f}x" if ssh_rate else "-",
                        f"{spent[name] / (args.repeat * size) * 1e9:.2f}" if ends[name] else "-",
                    ]
                    for name, rate in rates.items()
                ],
            )
            if ssh_rate:
                ratio = rates["gpumesh desktop"] / ssh_rate
                verdict = "meets" if ratio >= BULK_GOAL else "misses"
                print(f"  the tunnel {verdict} the goal of {BULK_GOAL}x ssh -L ({ratio:.2f}x)")

            print(f"\nround trip of 64 bytes, {args.pings} on one connection")
            trips, per_trip = {}, {}
            for name, port in paths.items():
                before = cpu_seconds(ends[name])
                trips[name] = summarize(round_trips(port, args.pings))
                per_trip[name] = (cpu_seconds(ends[name]) - before) / (args.pings + 10)
            print_rows(
                ["path", "p50 µs", "p90 µs", "ends' CPU µs"],
                [
                    [
                        n,
                        f"{s.p50 * 1e6:.0f}",
                        f"{s.p90 * 1e6:.0f}",
                        f"{per_trip[n] * 1e6:.0f}" if ends[n] else "-",
                    ]
                    for n, s in trips.items()
                ],
            )
            ssh_trip = next((s for n, s in trips.items() if n.startswith("ssh")), None)
            if ssh_trip:
                ours = trips["gpumesh desktop"].p50
                verdict = "meets" if ours <= ssh_trip.p50 else "misses"
                print(f"  the tunnel {verdict} the goal of a p50 no more than ssh -L's")

            vnc = stack.enter_context(vnc_server(tmp)) if args.updates else None
            if not args.updates:
                pass
            elif vnc is None:
                print("\nnote: no VNC rows (Xvfb, x11vnc or xmessage not installed)")
            else:
                gpumesh(alice, "desktop", "share", "--vnc", "--port", str(vnc))
                vnc_paths = {"gpumesh desktop": stack.enter_context(tunnel(bob))[0]}
                if ssh_options is not None:
                    vnc_paths["ssh -L"] = stack.enter_context(ssh_forward(ssh_options, vnc))[0]
                vnc_paths["direct"] = vnc
                print(f"\nVNC full-screen update (1280x800), {args.updates} in one vncdo session")
                per = {n: vnc_updates(p, args.updates, tmp) for n, p in vnc_paths.items()}
                print_rows(
                    ["path", "ms per update"], [[n, f"{s * 1e3:.1f}"] for n, s in per.items()]
                )
                gpumesh(alice, "desktop", "share", "--port", str(target))

            if not args.deny:
                return 0
            print(f"\n`desktop deny` until an open tunnelled connection reads EOF, {args.deny}x")
            cuts, commands, direct = deny_cut(alice, bob, args.deny)
            cut, command, change = summarize(cuts), summarize(commands), summarize(direct)
            print_rows(
                ["", "p50 ms", "max ms"],
                [
                    ["connection cut", f"{cut.p50 * 1e3:.0f}", f"{cut.high * 1e3:.0f}"],
                    ["deny command done", f"{command.p50 * 1e3:.0f}", f"{command.high * 1e3:.0f}"],
                    [
                        "cut after the store change",
                        f"{change.p50 * 1e3:.0f}",
                        f"{change.high * 1e3:.0f}",
                    ],
                ],
            )
            verdict = "meets" if cut.high <= DENY_GOAL else "misses"
            print(f"  {verdict} the goal of {DENY_GOAL:.0f} s (the command's start-up included)")
    return 0


@contextlib.contextmanager
def baseline(tmp: Path, target: int, rev: str) -> Iterator[tuple[int, list[int]]]:
    """A second provider and tunnel running this checkout's ``src/`` as of ``rev``
    (``git archive``), sharing the same server: old and new side by side in one run."""
    source = tmp / "baseline-src"
    source.mkdir()
    checkout = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "-C", str(checkout), "archive", rev, "src"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(f"git archive {rev} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    wrap = ("env", f"PYTHONPATH={source / 'src'}")
    alice_node, bob_node = make_nodes(tmp / "baseline", free_port(kind=socket.SOCK_DGRAM))
    alice_node.close()
    bob_node.close()
    alice, bob = tmp / "baseline" / "a", tmp / "baseline" / "b"
    with contextlib.ExitStack() as stack:
        agent = stack.enter_context(running_agent(alice, tmp / "baseline-agent.log", wrap))
        for command in (
            ("desktop", "share", "--port", str(target)),
            ("desktop", "allow", CONSUMER),
        ):
            if (done := gpumesh(alice, *command)).returncode != 0:
                raise SystemExit(f"gpumesh {' '.join(command)} failed: {done.stderr}")
        port, proc = stack.enter_context(tunnel(bob, wrap))
        yield port, [proc.pid, agent.pid]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=256, help="MiB per bulk run (256)")
    parser.add_argument("--repeat", type=int, default=3, help="bulk runs per path (3)")
    parser.add_argument("--pings", type=int, default=1000, help="round trips per path (1000)")
    parser.add_argument(
        "--updates", type=int, default=20, help="VNC updates per path (20; 0: no VNC rows)"
    )
    parser.add_argument(
        "--deny", type=int, default=5, help="deny measurements (5; 0: no deny rows)"
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure the tunnel as of git revision REV (bulk and round trip rows)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of a few seconds (tiny sizes, one of each)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeat, args.pings, args.updates, args.deny = 16, 1, 100, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    exit_cleanly_on_sigterm()
    args = parse_args(argv)
    if note := source_note():
        print(note)
    try:
        return run(args)
    except KeyboardInterrupt:
        return interrupted()


if __name__ == "__main__":
    sys.exit(main())
