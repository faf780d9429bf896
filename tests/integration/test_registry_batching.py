"""The registry's write queue: concurrent publishes share one commit, each is
answered after it, and a bad one fails alone. On SQLite and a real PostgreSQL.

The store tests queue their writes in one event-loop turn, so they are in one
batch by construction (no timing); the HTTP test sends publishes from many
threads at once and checks each one's own answer against the database.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa

from gpumesh.client.registry import (
    RegistryClient,
    SearchFilters,
    SequenceClock,
    address_record_of,
    listing_of,
)
from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import GpuListing, Listing, SignedRecord, open_record, sign_record
from gpumesh.registry.config import RegistryConfig, database_url
from gpumesh.registry.store import RegistryStore, SearchQuery
from tests.integration.public_registry import (
    DATABASES,
    RunningRegistry,
    empty_database,
    serve_registry,
)

GIB = 1 << 30
OPEN = RegistryConfig(
    publish_per_key=0, publish_per_ip=0, search_per_ip=0, listings_per_net=0, page_per_net=0
)
TTL = 900.0


@pytest.fixture(params=DATABASES)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_database(request.param, tmp_path)


@pytest.fixture
def registry(db: str) -> Iterator[RunningRegistry]:
    with serve_registry(db, OPEN) as running:
        yield running


def signed_listing(
    identity: Identity, seq: int, now: float, name: str, gpu: str = "NVIDIA GeForce RTX 4090"
) -> SignedRecord:
    listing = listing_of(
        identity,
        (seq, now),
        name=name,
        gpus=[GpuListing(gpu, 24 * GIB, 20 * GIB)],
        idle=True,
        region="us-west",
        contact="matrix:@alice:example.org",
        version="0.1.0",
    )
    return sign_record(identity, listing)


def listed_names(page_records: list[SignedRecord]) -> set[str]:
    names = set()
    for signed in page_records:
        record = open_record(signed)
        assert isinstance(record, Listing)
        names.add(record.name)
    return names


def _broken_write(conn: sa.Connection) -> None:
    conn.execute(sa.text("SELECT * FROM no_such_table"))  # a real error from the database


def test_concurrent_puts_share_one_commit_and_each_gets_its_own_answer(db: str) -> None:
    async def scenario() -> None:
        store = RegistryStore(database_url(db))
        await store.open()
        try:
            now = time.time()
            nodes = [Identity.generate() for _ in range(40)]
            fresh = [signed_listing(node, 10, now, f"node-{i}") for i, node in enumerate(nodes)]
            replay = signed_listing(nodes[0], 5, now, "node-0-older")  # below seq 10
            before = store.commits
            outcomes = await asyncio.gather(
                *(store.put(open_record(s), s, now, TTL) for s in [*fresh, replay])
            )
            assert store.commits == before + 1  # forty-one writes, one transaction
            assert [o.stored for o in outcomes] == [True] * 40 + [False]
            page = await store.search(SearchQuery(limit=100), now)
            assert listed_names(page.records) == {f"node-{i}" for i in range(40)}
        finally:
            await store.close()

    asyncio.run(scenario())


def test_one_batch_keeps_the_gpus_of_the_newest_stored_listing(db: str) -> None:
    async def scenario() -> None:
        store = RegistryStore(database_url(db))
        await store.open()
        try:
            now = time.time()
            alice = Identity.generate()
            versions = [(10, "RTX 4090"), (12, "A100"), (11, "RTX 3090")]  # 11 comes late
            signed = [signed_listing(alice, seq, now, "alice-pc", gpu) for seq, gpu in versions]
            outcomes = await asyncio.gather(
                *(store.put(open_record(s), s, now, TTL) for s in signed)
            )
            assert [o.stored for o in outcomes] == [True, True, False]
            for gpu, found in (("a100", True), ("4090", False), ("3090", False)):
                page = await store.search(SearchQuery(gpu=gpu), now)
                assert bool(page.records) is found, gpu
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_write_that_fails_in_a_batch_fails_alone(db: str) -> None:
    async def scenario() -> None:
        store = RegistryStore(database_url(db))
        await store.open()
        try:
            now = time.time()
            alice, bob = Identity.generate(), Identity.generate()
            first = signed_listing(alice, 10, now, "alice-pc")
            second = signed_listing(bob, 10, now, "bob-pc")
            outcomes = await asyncio.gather(
                store.put(open_record(first), first, now, TTL),
                store._write(_broken_write),
                store.put(open_record(second), second, now, TTL),
                return_exceptions=True,
            )
            assert isinstance(outcomes[1], sa.exc.DBAPIError)
            assert "no_such_table" in str(outcomes[1])
            assert [getattr(o, "stored", None) for o in (outcomes[0], outcomes[2])] == [True, True]
            page = await store.search(SearchQuery(), now)
            assert listed_names(page.records) == {"alice-pc", "bob-pc"}
            # the queue goes on after a failed batch
            later = signed_listing(alice, 11, now, "alice-pc-2")
            assert (await store.put(open_record(later), later, now, TTL)).stored
        finally:
            await store.close()

    asyncio.run(scenario())


def _post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url + "/v1/records", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_each_concurrent_publish_is_stored_when_answered(registry: RunningRegistry) -> None:
    """Many publishes at once: each 200 is followed at once by a lookup that finds
    it (answered after its commit), and the tampered one is refused alone."""
    client = RegistryClient(registry.url)
    nodes = [Identity.generate() for _ in range(48)]
    seqs = SequenceClock(registry.clock)

    def publish_then_look_up(node: Identity) -> bool:
        address = f"203.0.113.{nodes.index(node) + 1}:47001"
        record = address_record_of(node, seqs.next(), [address], "")
        status, reply = _post(registry.url, msgspec.json.encode(sign_record(node, record)))
        assert status == 200, reply
        found = client.lookup_addresses(str(node.node_id), node.public_key)
        return found is not None and found.addresses == [address]

    def publish_listing(index: int) -> int:
        node = nodes[index]
        signed = sign_record(
            node,
            listing_of(
                node,
                seqs.next(),
                name=f"node-{index}",
                gpus=[GpuListing("NVIDIA GeForce RTX 4090", 24 * GIB, 20 * GIB)],
                idle=True,
                region="us-west",
                contact="",
                version="0.1.0",
            ),
        )
        if index == 7:  # tampered after signing: refused, alone
            signed = SignedRecord(signed.record.replace(b"node-7", b"node-X"), signed.signature)
        return _post(registry.url, msgspec.json.encode(signed))[0]

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(publish_then_look_up, nodes))
        statuses = list(pool.map(publish_listing, range(len(nodes))))
    assert statuses[7] == 400
    assert statuses[:7] + statuses[8:] == [200] * (len(nodes) - 1)
    found = client.search(SearchFilters(limit=100)).listings
    assert {f.listing.name for f in found} == {f"node-{i}" for i in range(48) if i != 7}
