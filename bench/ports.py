"""A job's forwarded port (`gpumesh port`) next to `ssh -L` (aes128-gcm) to the same
port of the same container.

A `gpumesh share` provider (alice, `job_network bridge`) runs bob's job: a small
Python server in the `gpumesh-test/python` image (scripts/build-python-image.sh)
that counts what it is sent or echoes it (bench/desktop.py's server). bob runs
`gpumesh port JOB LOCAL:7000` (the real CLI, its own process); `ssh -L` goes to a
throwaway loopback sshd (bench/sshd.sh) and on to the container's address. The
figures, side by side in one run, on a direct path (loopback):

* bulk: ``--size`` MiB sent to the server, which answers how many it got after
  the client's half-close; MB/s, median of ``--repeat`` taken in turns (goal: at
  least 1.2x `ssh -L`), and the CPU the two ends spent per GB (the `port` command
  and the provider's node process; ssh and sshd).
* round trip: ``--pings`` 64-byte request/response exchanges on one connection;
  p50 and p90 (goal: a p50 no more than 1.2x `ssh -L`'s).

Everything it starts (agent, job, forward, sshd) is stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
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
from desktop import CIPHER, bulk, cpu_seconds, gpumesh, round_trips, stopping, wait_port

MIB = 1024 * 1024
BULK_GOAL = 1.2
RTT_GOAL = 1.2
IMAGE = os.environ.get("GPUMESH_TEST_PYTHON_IMAGE", "gpumesh-test/python:1")
PEER = "alice"
CONTAINER_PORT = 7000
PORT_ROW = "gpumesh port"
SSH_ROW = "ssh -L (aes128-gcm)"

SERVER = f"""
import socket, threading
def handle(conn):
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        if mode == b"S":
            total, buffer = 0, bytearray(1 << 20)
            while count := conn.recv_into(buffer):
                total += count
            conn.sendall(f"{{total}}\\n".encode())
        elif mode == b"E":
            while data := conn.recv(65536):
                conn.sendall(data)
server = socket.create_server(("0.0.0.0", {CONTAINER_PORT}))
print("serving", flush=True)
while True:
    conn, _ = server.accept()
    threading.Thread(target=handle, args=(conn,), daemon=True).start()
"""


def container_address(job_id: str) -> str:
    """The job's container's address on its Docker network (where sshd forwards to)."""
    found = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label=io.gpumesh.job={job_id}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not found:
        raise RuntimeError(f"no container for job {job_id}")
    inspect = subprocess.run(
        ["docker", "inspect", found[0]], capture_output=True, text=True, check=True
    ).stdout
    attrs = json.loads(inspect)[0]
    mode = attrs["HostConfig"]["NetworkMode"]
    if mode.startswith("container:"):  # joined a network holder's namespace
        attrs = json.loads(
            subprocess.run(
                ["docker", "inspect", mode.split(":", 1)[1]],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )[0]
    for network in attrs["NetworkSettings"]["Networks"].values():
        if network.get("IPAddress"):
            return str(network["IPAddress"])
    raise RuntimeError(f"job {job_id}'s container has no address")


def answers(port: int, timeout: float = 60) -> None:
    """Wait until an echo through ``port`` comes back (the server in the job is up)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 5) as c:
            c.settimeout(5)
            c.sendall(b"Ex")
            if c.recv(1) == b"x":
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no echo through 127.0.0.1:{port}")
        time.sleep(0.2)


@contextlib.contextmanager
def forwarded(bob: Path, job_id: str) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    proc = subprocess.Popen(
        [*gpumesh_command(), "port", job_id, f"{port}:{CONTAINER_PORT}"],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with stopping(proc):
        wait_port(port, proc)
        answers(port)
        yield port, proc


@contextlib.contextmanager
def ssh_forward(ssh_options: list[str], host: str) -> Iterator[tuple[int, int]]:
    port = free_port()
    target = f"{port}:{host}:{CONTAINER_PORT}"
    proc = subprocess.Popen(
        ["ssh", *ssh_options, "-c", CIPHER, "-N", "-L", target, "bench"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with stopping(proc):
        wait_port(port, proc)
        answers(port)
        yield port, proc.pid


def node_pid(home: Path) -> int:
    status = json.loads(gpumesh(home, "daemon", "status", "--json").stdout)
    return int(status["node"]["pid"])


def run(args: argparse.Namespace) -> int:
    size = args.size * MIB
    with tempfile.TemporaryDirectory(prefix="gpumesh-ports-bench-") as where:
        tmp = Path(where)
        alice_node, bob_node = make_nodes(tmp, free_port(kind=socket.SOCK_DGRAM))
        alice_node.close()
        bob_node.close()
        alice, bob = tmp / "a", tmp / "b"
        for home, key, value in ((alice, "job_network", "bridge"), (bob, "image", IMAGE)):
            if (done := gpumesh(home, "config", "set", key, value)).returncode != 0:
                raise SystemExit(f"config set {key} failed: {done.stderr}")
        with contextlib.ExitStack() as stack:
            stack.enter_context(running_agent(alice, tmp / "agent.log"))
            started = gpumesh(bob, "run", "--peer", PEER, "--detach", "--", "python3", "-c", SERVER)
            if started.returncode != 0:
                raise SystemExit(f"gpumesh run failed: {started.stderr}")
            job_id = started.stdout.strip()
            stack.callback(gpumesh, bob, "cancel", job_id)
            paths: dict[str, int] = {}
            ends: dict[str, list[int]] = {}
            port, proc = stack.enter_context(forwarded(bob, job_id))
            paths[PORT_ROW], ends[PORT_ROW] = port, [proc.pid, node_pid(bob), node_pid(alice)]
            ssh_options, why = stack.enter_context(loopback_sshd(tmp / "ssh"))
            if ssh_options is not None:
                host = container_address(job_id)
                port, ssh_pid = stack.enter_context(ssh_forward(ssh_options, host))
                sshd_pid = int((tmp / "ssh" / "sshd.pid").read_text())
                paths[SSH_ROW], ends[SSH_ROW] = port, [ssh_pid, sshd_pid]
            else:
                print(f"note: no `ssh -L` rows: {why}")

            print(f"bulk: {args.size} MiB to the job's server, median of {args.repeat} in turns")
            seconds: dict[str, list[float]] = {name: [] for name in paths}
            spent = dict.fromkeys(paths, 0.0)
            for _ in range(args.repeat):
                for name, port in paths.items():
                    before = cpu_seconds(ends[name])
                    seconds[name].append(bulk(port, size))
                    spent[name] += cpu_seconds(ends[name]) - before
            rates = {name: size / summarize(runs).p50 / 1e6 for name, runs in seconds.items()}
            ssh_rate = rates.get(SSH_ROW)
            print_rows(
                ["path", "MB/s", "vs ssh -L", "ends' CPU s/GB"],
                [
                    [
                        name,
                        f"{rate:.0f}",
                        f"{rate / ssh_rate:.2f}x" if ssh_rate else "-",
                        f"{spent[name] / (args.repeat * size) * 1e9:.2f}",
                    ]
                    for name, rate in rates.items()
                ],
            )
            if ssh_rate:
                ratio = rates[PORT_ROW] / ssh_rate
                verdict = "meets" if ratio >= BULK_GOAL else "misses"
                print(f"  gpumesh port {verdict} the goal of {BULK_GOAL}x ssh -L ({ratio:.2f}x)")

            print(f"\nround trip of 64 bytes, {args.pings} on one connection")
            trips = {name: summarize(round_trips(port, args.pings)) for name, port in paths.items()}
            ssh_trip = trips.get(SSH_ROW)
            print_rows(
                ["path", "p50 µs", "p90 µs", "vs ssh -L"],
                [
                    [
                        n,
                        f"{s.p50 * 1e6:.0f}",
                        f"{s.p90 * 1e6:.0f}",
                        f"{s.p50 / ssh_trip.p50:.2f}x" if ssh_trip else "-",
                    ]
                    for n, s in trips.items()
                ],
            )
            if ssh_trip:
                ratio = trips[PORT_ROW].p50 / ssh_trip.p50
                verdict = "meets" if ratio <= RTT_GOAL else "misses"
                print(f"  gpumesh port {verdict} the goal of a p50 at most {RTT_GOAL}x ssh -L's")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=256, help="MiB per bulk run (256)")
    parser.add_argument("--repeat", type=int, default=3, help="bulk runs per path (3)")
    parser.add_argument("--pings", type=int, default=1000, help="round trips per path (1000)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run of a few seconds (tiny sizes)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeat, args.pings = 16, 1, 100
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
