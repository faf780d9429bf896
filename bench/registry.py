"""The public registry under load: publish throughput, search latency, memory.

What is measured, against a real ``gpumesh-registry`` process (one process,
SQLite file or PostgreSQL, rate limits off) from separate load-generator
processes over HTTP on loopback:

* preload (``--preload N``, not timed as publishing): N signed listings, each
  from its own node key, signed in a process pool and written by the store's
  own bulk insert (``RegistryStore.bulk_insert``), NOT through the HTTP API,
  so that the issue's table sizes (100,000 on SQLite, 1,000,000 on
  PostgreSQL) load in minutes; how long signing and loading took is printed;
* publish: ``--listings`` more signed listings on top of the preloaded table,
  one per HTTP request (no batching), each from its own node key, signed
  before the clock starts, sent by ``--generators`` processes with
  ``--concurrency`` kept-alive HTTP/1.1 connections each. The generators
  write requests and parse replies by hand (status line and Content-Length),
  so that the client costs little of the two shared cores; the in-process
  rate of Ed25519 verification is printed next to it, the ceiling one core
  sets for the registry's signature check;
* search: ``--searches`` requests per filter, one at a time, timed at the
  HTTP client (p50/p95), next to ``GET /v1/health`` on the same connection,
  the floor of one HTTP round trip through this server and client; on
  PostgreSQL ``--explain`` prints EXPLAIN ANALYZE of each filter's statement;
* where the publish time goes: the registry process's CPU time per listing
  (from /proc) and the generators', next to the wall time per listing;
* memory: the registry process's resident and peak resident memory after the
  load (VmRSS, VmHWM).

The issue's sizes: ``--preload 100000`` (SQLite), ``--preload 1000000 --db
postgresql://...`` (PostgreSQL; its tables are dropped before and after).
The generators share the cores with the registry, so the publish figure is a
floor.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

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
CHUNK = 2000
"""Listings one signing task makes, and one bulk insert writes."""


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


def _sign_chunk(seed: int, count: int = CHUNK) -> list[bytes]:
    """``count`` signed listings as JSON bodies, each from a new key (a pool task)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        identity, listing = _listing(rng)
        bodies.append(msgspec.json.encode(sign_record(identity, listing)))
    return bodies


def _sign(pool: ProcessPoolExecutor, count: int, seed: int) -> list[bytes]:
    sizes = [CHUNK] * (count // CHUNK) + ([count % CHUNK] if count % CHUNK else [])
    bodies: list[bytes] = []
    for chunk in pool.map(_sign_chunk, range(seed, seed + len(sizes)), sizes):
        bodies += chunk
    return bodies


# --- the load generator: raw HTTP/1.1 on kept-alive connections -------------


async def _connection(port: int, requests: list[bytes], start: Any, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await start
    for request in requests:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await reader.readexactly(length)
        counts[0 if head[9:12] == b"200" else 1] += 1
    writer.close()


def _generator(
    port: int, bodies: list[bytes], concurrency: int, ready: Any, go: Any, results: Any
) -> None:
    """One generator process: its share of bodies over ``concurrency`` connections."""
    requests = [
        b"POST /v1/records HTTP/1.1\r\nHost: registry\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
        for body in bodies
    ]
    counts = [0, 0]

    async def run() -> None:
        start = asyncio.get_running_loop().create_future()
        tasks = [
            asyncio.create_task(_connection(port, requests[i::concurrency], start, counts))
            for i in range(concurrency)
        ]
        await asyncio.sleep(0.2)  # connections open before the clock starts
        ready.set()
        await asyncio.to_thread(go.wait)
        start.set_result(None)
        await asyncio.gather(*tasks)

    asyncio.run(run())
    results.put((counts[0], counts[1], time.process_time()))


def _publish(
    port: int, bodies: list[bytes], generators: int, concurrency: int
) -> tuple[float, int, float]:
    """Send every body; (seconds, refused, generators' CPU seconds while sending)."""
    context = multiprocessing.get_context("spawn")
    ready = [context.Event() for _ in range(generators)]
    go = context.Event()
    results = context.Queue()
    processes = [
        context.Process(
            target=_generator,
            args=(port, bodies[i::generators], concurrency, ready[i], go, results),
        )
        for i in range(generators)
    ]
    for process in processes:
        process.start()
    for event in ready:
        event.wait(120)
    started = time.perf_counter()
    go.set()
    replies = [results.get(timeout=3600) for _ in processes]
    seconds = time.perf_counter() - started
    for process in processes:
        process.join(30)
    refused = sum(r[1] for r in replies)
    return seconds, refused, sum(r[2] for r in replies)


# --- search latency ----------------------------------------------------------


def _p95(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=20, method="inclusive")[18]


def _query(params: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in params.items() if k != "page"}


def _search_latencies(url: str, searches: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    samples: dict[str, list[float]] = {name: [] for name in [*FILTERS, "GET /v1/health"]}
    with httpx.Client(base_url=url, timeout=60) as client:
        cursors: dict[str, str] = {}
        for name, params in FILTERS.items():  # page-5 cursors, walked once untimed
            if "page" in params:
                cursor = ""
                for _ in range(int(params["page"]) - 1):
                    reply = client.get("/v1/listings", params={**_query(params), "cursor": cursor})
                    cursor = reply.json()["next"]
                cursors[name] = cursor
        for _ in range(2):  # warm-up
            for params in FILTERS.values():
                client.get("/v1/listings", params=_query(params))
        for _ in range(searches):  # round-robin, so noise hits each alike
            for name, params in FILTERS.items():
                query = _query(params)
                if name in cursors:
                    query["cursor"] = cursors[name]
                started = time.perf_counter()
                reply = client.get("/v1/listings", params=query)
                samples[name].append((time.perf_counter() - started) * 1000)
                assert reply.status_code == 200, reply.text
            started = time.perf_counter()
            client.get("/v1/health")
            samples["GET /v1/health"].append((time.perf_counter() - started) * 1000)
    return samples, cursors


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


# --- the store, directly: preload, EXPLAIN, drop ----------------------------


def _store(db: str) -> Any:
    from gpumesh.registry.config import database_url
    from gpumesh.registry.store import RegistryStore

    return RegistryStore(database_url(db))


def _preload(db: str, pool: ProcessPoolExecutor, count: int) -> tuple[float, float]:
    """Bulk-insert ``count`` signed listings; (seconds waiting for signing, seconds in all).

    Each is signed by its own new key (a node id is a key, so one row per key)
    in the process pool; the rows are decoded here without verifying (this
    process made them), which the HTTP path does for every publish.
    """

    async def load() -> float:
        store = _store(db)
        await store.open()
        signing = 0.0
        sizes = [CHUNK] * (count // CHUNK) + ([count % CHUNK] if count % CHUNK else [])
        futures = iter(pool.map(_sign_chunk, range(1000, 1000 + len(sizes)), sizes))
        now = time.time()
        done = 0
        while True:
            started = time.perf_counter()
            bodies = await asyncio.to_thread(next, futures, None)
            signing += time.perf_counter() - started
            if bodies is None:
                break
            signed = [msgspec.json.decode(body, type=SignedRecord) for body in bodies]
            records = [(msgspec.msgpack.decode(s.record, type=Listing), s) for s in signed]
            await store.bulk_insert(records, now, 86400)
            done += len(bodies)
            if done % 100_000 < CHUNK:
                print(f"  preloaded {done:,}", flush=True)
        await store.analyze()
        await store.close()
        return signing

    started = time.perf_counter()
    waiting = asyncio.run(load())
    return waiting, time.perf_counter() - started


def _explain(db: str, cursors: dict[str, str]) -> None:
    from gpumesh.registry.store import SearchQuery
    from gpumesh.units import parse_size

    async def plans() -> None:
        store = _store(db)
        for name, params in FILTERS.items():
            query = SearchQuery(
                gpu=params.get("gpu", ""),
                vram=parse_size(params["vram"]) if "vram" in params else 0,
                vram_total=params.get("vram_of") == "total",
                idle="idle" in params,
                region=params.get("region", ""),
                cursor=cursors.get(name, ""),
            )
            print(f"EXPLAIN ANALYZE: {name}")
            print(await store.explain(query, time.time()))
            print()
        await store.close()

    asyncio.run(plans())


def _drop(db: str) -> None:
    async def drop() -> None:
        store = _store(db)
        await store.drop_all()
        await store.close()

    asyncio.run(drop())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default="", help="postgresql://... (default: a temporary SQLite)")
    parser.add_argument("--preload", type=int, default=0, help="Listings bulk-inserted first.")
    parser.add_argument("--listings", type=int, default=10000, help="Listings published.")
    parser.add_argument("--searches", type=int, default=200, help="Timed searches per filter.")
    parser.add_argument("--generators", type=int, default=1, help="Load-generator processes.")
    parser.add_argument("--concurrency", type=int, default=32, help="Connections per generator.")
    parser.add_argument("--explain", action="store_true", help="EXPLAIN ANALYZE (PostgreSQL).")
    args = parser.parse_args()
    exit_cleanly_on_sigterm()
    if note := source_note():
        print(note)
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        db = args.db or str(Path(tmp) / "registry.db")
        postgres = db.startswith("postgres")
        if postgres:
            _drop(db)
        try:
            return _bench(args, db, pool)
        except KeyboardInterrupt:
            return interrupted()
        finally:
            if postgres:
                _drop(db)


def _bench(args: argparse.Namespace, db: str, pool: ProcessPoolExecutor) -> int:
    kind = "PostgreSQL" if db.startswith("postgres") else "SQLite"
    load = ""
    if args.preload:
        print(f"preloading {args.preload:,} listings (bulk insert, not HTTP)", flush=True)
        waiting, seconds = _preload(db, pool, args.preload)
        load = (
            f"preload of {args.preload:,}: {seconds:.0f}s, of which {waiting:.0f}s waiting "
            "for the signing pool"
        )
        print(load, flush=True)
    started = time.perf_counter()
    bodies = _sign(pool, args.listings, 1)
    signing = time.perf_counter() - started
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
            # every simulated node publishes from loopback, one network
            "--listings-per-net",
            "0",
            "--page-per-net",
            "0",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        _wait_up(url, registry)
        print(
            f"gpumesh-registry on {kind}, one process ({_server_parts()}); "
            f"{args.preload:,} preloaded, "
            f"{args.listings:,} published over HTTP by {args.generators} generator process(es) "
            f"x {args.concurrency} connections; {os.cpu_count()} CPUs shared by all",
            flush=True,
        )
        cpu_before = _cpu_seconds(registry.pid)
        seconds, refused, generator_cpu = _publish(port, bodies, args.generators, args.concurrency)
        registry_cpu = _cpu_seconds(registry.pid) - cpu_before
        rss_after_load, hwm_after_load = _memory(registry.pid)
        samples, cursors = _search_latencies(url, args.searches)
        rss, hwm = _memory(registry.pid)
    finally:
        registry.terminate()
        registry.wait(30)
    verify = _verify_rate()
    n = args.listings
    print()
    print_rows(
        ["publish", "figure"],
        [
            ["listings accepted per second (one per request)", f"{(n - refused) / seconds:,.0f}"],
            ["refused", f"{refused}"],
            ["wall time per listing, ms", f"{seconds / n * 1000:.3f}"],
            ["registry process CPU per listing, ms", f"{registry_cpu / n * 1000:.3f}"],
            [
                "load generators' CPU per listing (HTTP client), ms",
                f"{generator_cpu / n * 1000:.3f}",
            ],
            ["Ed25519 verifications per second, one core, no I/O", f"{verify:,.0f}"],
            ["signing per listing, before the clock (pool), ms", f"{signing / n * 1000:.3f}"],
        ],
    )
    print()
    floor = statistics.median(samples["GET /v1/health"])
    rows = []
    for name, values in samples.items():
        p50 = statistics.median(values)
        rows.append([name, f"{p50:.2f}", f"{_p95(values):.2f}", f"{p50 / floor:.1f}x"])
    print_rows(
        [
            f"search at {args.preload + n:,} listings (HTTP client)",
            "p50 ms",
            "p95 ms",
            "p50 vs health",
        ],
        rows,
    )
    print()
    print_rows(
        ["registry memory", "resident", "peak"],
        [["after publishing", rss_after_load, hwm_after_load], ["after the searches", rss, hwm]],
    )
    if load:
        print(load)
    if args.explain and db.startswith("postgres"):
        print()
        _explain(db, cursors)
    return 0


def _server_parts() -> str:
    """What uvicorn serves with here: uvloop and httptools when installed."""
    parts = []
    for module, fallback in (("uvloop", "asyncio loop"), ("httptools", "h11")):
        try:
            __import__(module)
            parts.append(module)
        except ImportError:
            parts.append(fallback)
    return ", ".join(parts)


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


if __name__ == "__main__":
    sys.exit(main())
