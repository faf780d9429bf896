"""The public registry under load: publish throughput, search latency, memory.

What is measured, against a real ``gpumesh-registry`` process (one process,
SQLite file or PostgreSQL, rate limits off) from this separate process over
HTTP on loopback:

* publish: ``--listings`` signed listings, one per request (no batching), each
  from its own node key, ``--concurrency`` requests in flight on kept-alive
  connections. Records are signed before each batch is sent and signing is
  not counted: the figure is what the registry accepts (verify, check
  freshness, one upsert, GPU rows) per second. The in-process rate of
  Ed25519 verification alone is printed next to it, as the ceiling one core
  sets for the signature check;
* search: ``--searches`` requests per filter, one at a time, timed at the
  HTTP client (p50/p95), next to ``GET /v1/health`` on the same connection,
  the floor of one HTTP round trip through this server and client;
* where the publish time goes: the registry process's CPU time per listing
  (from /proc) and this generator's, next to the wall time per listing;
* memory: the registry process's resident and peak resident memory after the
  load (VmRSS, VmHWM).

Defaults fit a shared 2-core machine in a few minutes (5,000 listings on
SQLite); the issue's sizes are ``--listings 100000`` (SQLite) and
``--listings 1000000 --db postgresql://...`` (PostgreSQL; about an hour of
load on such a machine). The load generator shares the cores with the
registry, so the publish figure is a floor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

from _benchlib import exit_cleanly_on_sigterm, free_port, interrupted, print_rows, source_note
from gpumesh.identity.keys import Identity, verify_signature
from gpumesh.protocol.listing import DOMAIN, GpuListing, Listing, SignedRecord, sign_record

GIB = 1 << 30
GPUS = [
    ("NVIDIA GeForce RTX 4090", 24),
    ("NVIDIA GeForce RTX 4080", 16),
    ("NVIDIA GeForce RTX 3090", 24),
    ("NVIDIA GeForce RTX 3060", 12),
    ("NVIDIA A100-SXM4-80GB", 80),
    ("NVIDIA H100 80GB HBM3", 80),
]
REGIONS = ["us-west", "us-east", "eu-west", "eu-central", "ap-south", "ap-east", "sa-east", "af"]
FILTERS = {
    "gpu=4090 vram=8GB idle": {"gpu": "4090", "vram": "8GB", "idle": "1"},
    "region=us-west idle": {"region": "us-west", "idle": "1"},
    "vram=40GB (total)": {"vram": "40GB", "vram_of": "total"},
    "no filter": {},
    "gpu=4090 vram=8GB idle, page 5": {"gpu": "4090", "vram": "8GB", "idle": "1", "page": "5"},
}
BATCH = 5000


def _listing(rng: random.Random) -> tuple[Identity, Listing]:
    identity = Identity.generate()
    gpus = []
    for _ in range(rng.choice([1, 1, 1, 2, 4])):
        name, total = rng.choice(GPUS)
        gpus.append(GpuListing(name, total * GIB, rng.randint(0, total) * GIB))
    now = time.time()
    return identity, Listing(
        public_key=identity.public_key,
        seq=int(now * 1e6),
        timestamp=now,
        name=f"node-{rng.getrandbits(32):08x}",
        gpus=gpus,
        idle=rng.random() < 0.7,
        region=rng.choice(REGIONS),
        contact="matrix:@someone:example.org",
        version="0.1.0",
    )


def _sign_batch(rng: random.Random, count: int) -> list[bytes]:
    bodies = []
    for _ in range(count):
        identity, listing = _listing(rng)
        bodies.append(msgspec.json.encode(sign_record(identity, listing)))
    return bodies


async def _publish(url: str, bodies: list[bytes], concurrency: int) -> tuple[float, int]:
    """Send every body, ``concurrency`` at a time; (seconds, refused)."""
    refused = 0
    queue = iter(bodies)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:

        async def worker() -> None:
            nonlocal refused
            for body in queue:
                reply = await client.post("/v1/records", content=body)
                if reply.status_code != 200:
                    refused += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, refused


def _p95(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=20, method="inclusive")[18]


def _search_latencies(url: str, searches: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in [*FILTERS, "GET /v1/health"]}
    with httpx.Client(base_url=url, timeout=60) as client:
        cursors: dict[str, str] = {}
        for name, params in FILTERS.items():  # page-5 cursors, walked once untimed
            if "page" in params:
                query = {k: v for k, v in params.items() if k != "page"}
                cursor = ""
                for _ in range(int(params["page"]) - 1):
                    cursor = client.get("/v1/listings", params={**query, "cursor": cursor}).json()[
                        "next"
                    ]
                cursors[name] = cursor
        for _ in range(2):  # warm-up
            for params in FILTERS.values():
                client.get("/v1/listings", params=params)
        for _ in range(searches):  # round-robin, so noise hits each alike
            for name, params in FILTERS.items():
                query = {k: v for k, v in params.items() if k != "page"}
                if name in cursors:
                    query["cursor"] = cursors[name]
                started = time.perf_counter()
                reply = client.get("/v1/listings", params=query)
                samples[name].append((time.perf_counter() - started) * 1000)
                assert reply.status_code == 200, reply.text
            started = time.perf_counter()
            client.get("/v1/health")
            samples["GET /v1/health"].append((time.perf_counter() - started) * 1000)
    return samples


def _verify_rate(seconds: float = 1.0) -> float:
    identity = Identity.generate()
    _, listing = _listing(random.Random(1))
    listing = msgspec.structs.replace(listing, public_key=identity.public_key)
    signed: SignedRecord = sign_record(identity, listing)
    count = 0
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        verify_signature(listing.public_key, signed.signature, DOMAIN + signed.record)
        count += 1
    return count / (time.perf_counter() - started)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _memory(pid: int) -> tuple[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields.get("VmRSS", "?"), fields.get("VmHWM", "?")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default="", help="postgresql://... (default: a temporary SQLite)")
    parser.add_argument("--listings", type=int, default=5000)
    parser.add_argument("--searches", type=int, default=200, help="Timed searches per filter.")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or str(Path(tmp) / "registry.db")
        if db.startswith("postgres"):
            _reset_postgres(db)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        registry = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpumesh.registry.main",
                "--listen",
                f"127.0.0.1:{port}",
                "--db",
                db,
                "--publish-per-key",
                "0",
                "--publish-per-ip",
                "0",
                "--search-per-ip",
                "0",
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            _wait_up(url, registry)
            return _run(args, url, registry, db)
        except KeyboardInterrupt:
            return interrupted()
        finally:
            registry.terminate()
            registry.wait(30)


def _run(args: argparse.Namespace, url: str, registry: subprocess.Popen[bytes], db: str) -> int:
    kind = "PostgreSQL" if db.startswith("postgres") else "SQLite"
    print(
        f"gpumesh-registry on {kind}, one process; {args.listings:,} listings published from "
        f"this process, {args.concurrency} in flight; {os.cpu_count()} CPUs shared by both"
    )
    rng = random.Random(17)
    sending = 0.0
    signing = 0.0
    registry_cpu = 0.0
    own_cpu = 0.0
    refused = 0
    done = 0
    while done < args.listings:
        count = min(BATCH, args.listings - done)
        started = time.perf_counter()
        bodies = _sign_batch(rng, count)
        signing += time.perf_counter() - started
        cpu_before, own_before = _cpu_seconds(registry.pid), time.process_time()
        seconds, bad = asyncio.run(_publish(url, bodies, args.concurrency))
        registry_cpu += _cpu_seconds(registry.pid) - cpu_before
        own_cpu += time.process_time() - own_before
        sending += seconds
        refused += bad
        done += count
        print(f"  published {done:,} ({count / seconds:,.0f}/s this batch)", flush=True)
    rss_after_load, hwm_after_load = _memory(registry.pid)
    samples = _search_latencies(url, args.searches)
    rss, hwm = _memory(registry.pid)
    verify = _verify_rate()
    print()
    print_rows(
        ["publish", "figure"],
        [
            ["listings accepted per second (one per request)", f"{args.listings / sending:,.0f}"],
            ["refused", f"{refused}"],
            [
                "registry process CPU per listing, ms",
                f"{registry_cpu / args.listings * 1000:.2f}",
            ],
            [
                "load generator CPU per listing (HTTP client), ms",
                f"{own_cpu / args.listings * 1000:.2f}",
            ],
            ["Ed25519 verifications per second, one core, no I/O", f"{verify:,.0f}"],
            [
                "signing per listing in this generator (not counted), ms",
                f"{signing / args.listings * 1000:.3f}",
            ],
        ],
    )
    print()
    floor = statistics.median(samples["GET /v1/health"])
    rows = []
    for name, values in samples.items():
        p50 = statistics.median(values)
        rows.append([name, f"{p50:.2f}", f"{_p95(values):.2f}", f"{p50 / floor:.1f}x"])
    print_rows(["search (HTTP client)", "p50 ms", "p95 ms", "p50 vs health"], rows)
    print()
    print_rows(
        ["registry memory", "resident", "peak"],
        [["after the load", rss_after_load, hwm_after_load], ["after the searches", rss, hwm]],
    )
    return 0


def _wait_up(url: str, registry: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if registry.poll() is not None:
            raise SystemExit(f"gpumesh-registry exited with {registry.returncode}")
        try:
            if httpx.get(url + "/v1/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("gpumesh-registry did not answer within 60s")


def _reset_postgres(db: str) -> None:
    from gpumesh.registry.config import database_url
    from gpumesh.registry.store import RegistryStore

    async def drop() -> None:
        store = RegistryStore(database_url(db))
        await store.drop_all()
        await store.close()

    asyncio.run(drop())


if __name__ == "__main__":
    sys.exit(main())
