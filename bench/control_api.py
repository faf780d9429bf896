"""A question to this node: the control API next to the CLI a user would otherwise run.

What is measured: the wall time of listing this node's peers, median and p90 of
``--runs`` runs each, four ways, in a freshly initialized temporary home with
``--peers`` paired peers:

* ``gpumesh peers --json``: the CLI in a new process (what a script does today);
* ``GET /api/v1/peers`` on the home's unix socket, a new connection per request
  (``curl --unix-socket``'s pattern, but from this process with the standard
  library's ``http.client``, so neither a process nor a client library starts);
* the same request on loopback TCP with the bearer token, a new connection each;
* the same request on one kept-alive TCP connection (a dashboard or a client
  library).

Why it is fair: every way answers the same question from the same SQLite file
and returns the same JSON (the CLI's ``--json`` struct is what the route
returns); the four take turns in one round-robin loop after two untimed
warm-ups each, so the noise of this shared machine hits each alike. The server
is a real ``gpumesh-control`` process.
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from _benchlib import (
    ensure_bytecode,
    exit_cleanly_on_sigterm,
    free_port,
    interrupted,
    print_rows,
    source_note,
    summarize,
)

WARMUPS = 2


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("gpumesh")
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self._path)


def _get(connection: http.client.HTTPConnection, headers: dict[str, str]) -> None:
    """One request on a new connection (no client library's own start-up in it)."""
    try:
        connection.request("GET", "/api/v1/peers", headers=headers)
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"GET /api/v1/peers: {response.status}")
    finally:
        connection.close()


def _init(home: Path, peers: int) -> None:
    from gpumesh.client.node import Node

    node = Node(home)
    node.init("bench")
    for index in range(peers):
        other = Node(home.parent / f"peer{index}")
        other.init(f"peer-{index}")
        node.pair(other.pairing_code())
        other.close()
    node.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--peers", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="5 runs, 5 peers: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.peers = 5, 5
    exit_cleanly_on_sigterm()
    ensure_bytecode()
    note = source_note()
    if note:
        print(note, file=sys.stderr)
    bindir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        _init(home, args.peers)
        port = free_port()
        env = dict(os.environ, GPUMESH_HOME=str(home), GPUMESH_API_ADDR=f"127.0.0.1:{port}")
        env.pop("GPUMESH_API_TOKEN", None)
        server = subprocess.Popen(
            [str(bindir / "gpumesh-control")], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            for line in server.stdout:
                if "OpenAPI" in line:
                    break
            token = (home / "api.token").read_text().strip()
            auth = {"authorization": f"Bearer {token}"}
            url = f"http://127.0.0.1:{port}/api/v1/peers"
            kept = httpx.Client(headers=auth)

            def cli() -> None:
                subprocess.run(
                    [str(bindir / "gpumesh"), "peers", "--json"],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    check=True,
                )

            def unix() -> None:
                connection = _UnixConnection(str(home / "control.sock"))
                _get(connection, {})

            def tcp() -> None:
                _get(http.client.HTTPConnection("127.0.0.1", port), auth)

            def keepalive() -> None:
                kept.get(url).raise_for_status()

            ways: list[tuple[str, Callable[[], None]]] = [
                ("gpumesh peers --json (new process)", cli),
                ("GET /api/v1/peers, unix socket", unix),
                ("GET /api/v1/peers, TCP + bearer", tcp),
                ("GET /api/v1/peers, kept-alive TCP", keepalive),
            ]
            samples: dict[str, list[float]] = {name: [] for name, _ in ways}
            for _ in range(WARMUPS):
                for _, way in ways:
                    way()
            for _ in range(args.runs):
                for name, way in ways:
                    started = time.perf_counter()
                    way()
                    samples[name].append((time.perf_counter() - started) * 1000)
            kept.close()
        except KeyboardInterrupt:
            return interrupted()
        finally:
            server.terminate()
            server.wait(timeout=30)
    base = summarize(samples[ways[0][0]]).p50
    rows = []
    for name, _ in ways:
        s = summarize(samples[name])
        rows.append([name, f"{s.p50:.1f}", f"{s.p90:.1f}", f"{s.p50 / base:.3f}x"])
    print(f"listing {args.peers} peers, {args.runs} runs each (ms)")
    print_rows(["way", "p50", "p90", "vs CLI"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
