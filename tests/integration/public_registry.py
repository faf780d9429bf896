"""A real ``gpumesh-registry`` app on loopback for tests, on SQLite or PostgreSQL.

The app is served by uvicorn on a real TCP socket in a thread of its own,
with a clock the test moves (expiry and freshness are decided by it, so no
test sleeps). PostgreSQL is the one ``scripts/ensure-postgres.sh`` starts:
its URL comes from ``GPUMESH_TEST_POSTGRES_URL`` (``scripts/test.sh`` exports
it), or the script is run here when we are root. Each use starts from empty
tables.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from gpumesh.registry.app import create_app
from gpumesh.registry.config import RegistryConfig, database_url
from gpumesh.registry.store import RegistryStore

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    """The registry's clock: real time at first, moved by the test."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class RunningRegistry:
    url: str
    clock: Clock
    db: str


DATABASES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
"""The databases a registry test runs on; the PostgreSQL case is marked ``postgres``."""


def postgres_url() -> str:
    """The test PostgreSQL's URL; skips the test where there is none (never in CI)."""
    url = os.environ.get("GPUMESH_TEST_POSTGRES_URL", "")
    if url:
        return url
    ci = os.environ.get("CI", "") not in ("", "0", "false", "no")
    if os.environ.get("GPUMESH_TEST_NO_POSTGRES") == "1" and not ci:
        pytest.skip("GPUMESH_TEST_NO_POSTGRES=1")
    done = subprocess.run(
        [str(ROOT / "scripts" / "ensure-postgres.sh")],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    if done.returncode != 0:
        if ci:
            pytest.fail(f"PostgreSQL is needed in CI: {done.stderr.strip()}")
        pytest.skip(f"no PostgreSQL here: {done.stderr.strip()}")
    lines = done.stdout.strip().splitlines()
    url = lines[-1] if lines else ""
    os.environ["GPUMESH_TEST_POSTGRES_URL"] = url
    return url


def empty_database(kind: str, tmp_path: Path) -> str:
    """A ``--db`` value for ``kind`` (sqlite or postgresql) with no registry tables."""
    if kind == "sqlite":
        return str(tmp_path / "registry.db")
    url = postgres_url()

    async def drop() -> None:
        store = RegistryStore(database_url(url))
        await store.drop_all()
        await store.close()

    asyncio.run(drop())
    return url


@contextmanager
def serve_registry(db: str, config: RegistryConfig | None = None) -> Iterator[RunningRegistry]:
    """Serve a registry on 127.0.0.1 (a free port) for the ``with`` block."""
    clock = Clock()
    config = dataclasses.replace(config or RegistryConfig(), db=db)
    app = create_app(config.check(), RegistryStore(database_url(db)), clock=clock)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test registry did not start")
        time.sleep(0.02)
    try:
        yield RunningRegistry(f"http://127.0.0.1:{port}", clock, db)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
