"""The public registry over real HTTP, on SQLite and on a real PostgreSQL.

Records are signed by real node keys and sent by the client layer (or by
hand, for what a hostile publisher sends). The registry's clock is moved by
the test, so expiry and freshness are checked without sleeping.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpumesh.client.registry import (
    RegistryClient,
    SearchFilters,
    SequenceClock,
    address_record_of,
    listing_of,
    withdrawal_of,
)
from gpumesh.errors import RegistryError, UnreachableError
from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import (
    DOMAIN,
    GpuListing,
    Listing,
    SignedRecord,
    sign_record,
)
from gpumesh.registry.config import RegistryConfig
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


@pytest.fixture(params=DATABASES)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_database(request.param, tmp_path)


@pytest.fixture
def registry(db: str) -> Iterator[RunningRegistry]:
    with serve_registry(db, OPEN) as running:
        yield running


def make_listing(
    identity: Identity,
    seqs: SequenceClock,
    *,
    name: str = "alice-pc",
    gpus: list[tuple[str, int, int]] | None = None,
    idle: bool = True,
    region: str = "us-west",
) -> Listing:
    gpu_list = [
        GpuListing(n, total * GIB, free * GIB)
        for n, total, free in (gpus or [("NVIDIA GeForce RTX 4090", 24, 20)])
    ]
    return listing_of(
        identity,
        seqs.next(),
        name=name,
        gpus=gpu_list,
        idle=idle,
        region=region,
        contact="matrix:@alice:example.org",
        version="0.1.0",
    )


def post_raw(url: str, signed: SignedRecord) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url + "/v1/records", data=msgspec.json.encode(signed), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def names(client: RegistryClient, **filters: Any) -> list[str]:
    return [f.listing.name for f in client.search(SearchFilters(**filters)).listings]


def test_published_listing_is_found_with_its_fields(registry: RunningRegistry) -> None:
    alice = Identity.generate()
    client = RegistryClient(registry.url)
    listing = make_listing(alice, SequenceClock(registry.clock))
    assert client.publish(alice, listing) == OPEN.ttl
    page = client.search(SearchFilters())
    assert [f.listing for f in page.listings] == [listing]
    assert page.listings[0].node_id == alice.node_id
    assert page.next == ""


def test_tampered_listing_is_refused(registry: RunningRegistry) -> None:
    alice = Identity.generate()
    signed = sign_record(alice, make_listing(alice, SequenceClock(registry.clock)))
    raw = msgspec.msgpack.decode(signed.record)
    raw["gpus"][0]["memory_free"] = 24 * GIB
    status, body = post_raw(
        registry.url, SignedRecord(msgspec.msgpack.encode(raw), signed.signature)
    )
    assert status == 400
    assert "does not verify" in body["error"]["message"]
    assert RegistryClient(registry.url).search(SearchFilters()).listings == []


def test_replayed_and_stale_sequence_refused(registry: RunningRegistry) -> None:
    alice = Identity.generate()
    seqs = SequenceClock(registry.clock)
    client = RegistryClient(registry.url)
    first = sign_record(alice, make_listing(alice, seqs, name="first"))
    second = make_listing(alice, seqs, name="second")
    assert post_raw(registry.url, first)[0] == 200
    client.publish(alice, second)
    status, body = post_raw(registry.url, first)  # the older one again
    assert status == 409
    assert "sequence number" in body["error"]["message"]
    with pytest.raises(RegistryError, match=r"refused: stale record: sequence number"):
        client.publish(alice, second)  # the same one again: a replay
    assert names(client) == ["second"]


def test_old_timestamp_refused_as_stale(registry: RunningRegistry) -> None:
    alice = Identity.generate()
    old = SequenceClock(lambda: registry.clock.now - 3600)
    with pytest.raises(RegistryError, match="stale record: made 3600s ago"):
        RegistryClient(registry.url).publish(alice, make_listing(alice, old))


def test_listing_expires_without_refresh(registry: RunningRegistry) -> None:
    alice, bob = Identity.generate(), Identity.generate()
    client = RegistryClient(registry.url)
    client.publish(alice, make_listing(alice, SequenceClock(registry.clock), name="alice"))
    registry.clock.advance(OPEN.ttl / 2)
    client.publish(bob, make_listing(bob, SequenceClock(registry.clock), name="bob"))
    assert sorted(names(client)) == ["alice", "bob"]
    registry.clock.advance(OPEN.ttl / 2 + 1)
    assert names(client) == ["bob"]
    # A refresh brings it back.
    client.publish(alice, make_listing(alice, SequenceClock(registry.clock), name="alice"))
    assert sorted(names(client)) == ["alice", "bob"]


def test_withdrawal_removes_listing_and_old_listing_cannot_come_back(
    registry: RunningRegistry,
) -> None:
    alice = Identity.generate()
    seqs = SequenceClock(registry.clock)
    client = RegistryClient(registry.url)
    listed = sign_record(alice, make_listing(alice, seqs))
    assert post_raw(registry.url, listed)[0] == 200
    client.publish(alice, withdrawal_of(alice, seqs.next()))
    assert names(client) == []
    status, body = post_raw(registry.url, listed)
    assert status == 409 and "stale record" in body["error"]["message"]
    assert names(client) == []


def test_every_filter(registry: RunningRegistry) -> None:
    client = RegistryClient(registry.url)
    nodes = {
        "a4090-idle-west": ([("NVIDIA GeForce RTX 4090", 24, 20)], True, "us-west"),
        "b4090-busy-west": ([("NVIDIA GeForce RTX 4090", 24, 2)], False, "us-west"),
        "c3090-idle-east": ([("NVIDIA GeForce RTX 3090", 24, 24)], True, "eu-east"),
        "d-mixed-idle-east": (
            [("NVIDIA GeForce RTX 4090", 24, 4), ("NVIDIA H100 80GB HBM3", 80, 70)],
            True,
            "EU-East",
        ),
    }
    for name, (gpus, idle, region) in nodes.items():
        identity = Identity.generate()
        client.publish(
            identity,
            make_listing(
                identity,
                SequenceClock(registry.clock),
                name=name,
                gpus=gpus,
                idle=idle,
                region=region,
            ),
        )
    assert sorted(names(client, gpu="4090")) == [
        "a4090-idle-west",
        "b4090-busy-west",
        "d-mixed-idle-east",
    ]
    assert sorted(names(client, gpu="rtx 40")) == [
        "a4090-idle-west",
        "b4090-busy-west",
        "d-mixed-idle-east",
    ]
    assert names(client, gpu="4090", vram=8 * GIB) == ["a4090-idle-west"]
    # The VRAM must be on a GPU of that model: d's free 70 GiB are on its H100.
    assert sorted(names(client, gpu="4090", vram=20 * GIB, vram_total=True)) == [
        "a4090-idle-west",
        "b4090-busy-west",
        "d-mixed-idle-east",
    ]
    assert names(client, vram=30 * GIB) == ["d-mixed-idle-east"]
    assert sorted(names(client, idle=True)) == [
        "a4090-idle-west",
        "c3090-idle-east",
        "d-mixed-idle-east",
    ]
    assert sorted(names(client, region="eu-east")) == ["c3090-idle-east", "d-mixed-idle-east"]
    assert names(client, gpu="4090", vram=8 * GIB, idle=True, region="us-west") == [
        "a4090-idle-west"
    ]
    assert names(client, gpu="5090") == []
    assert names(client, gpu="%") == []  # a LIKE wildcard is a plain character
    # Sorted by the most free memory on one GPU, best first.
    assert names(client) == [
        "d-mixed-idle-east",
        "c3090-idle-east",
        "a4090-idle-west",
        "b4090-busy-west",
    ]


def test_pagination_visits_each_listing_once_in_order(registry: RunningRegistry) -> None:
    client = RegistryClient(registry.url)
    expected = []
    for index in range(7):
        identity = Identity.generate()
        free = 10 if index < 4 else index  # ties are ordered by node id
        client.publish(
            identity,
            make_listing(
                identity, SequenceClock(registry.clock), name=f"n{index}", gpus=[("GPU", 24, free)]
            ),
        )
        expected.append((-free, str(identity.node_id)))
    seen: list[str] = []
    cursor = ""
    pages = 0
    while True:
        page = client.search(SearchFilters(limit=3, cursor=cursor))
        seen += [str(f.node_id) for f in page.listings]
        pages += 1
        if not page.next:
            break
        cursor = page.next
    assert pages == 3
    assert seen == [node_id for _, node_id in sorted(expected)]


def test_rate_limits_per_key_and_per_address(db: str) -> None:
    config = RegistryConfig(publish_per_key=3, publish_per_ip=5, search_per_ip=2)
    with serve_registry(db, config) as registry:
        client = RegistryClient(registry.url)
        alice, bob = Identity.generate(), Identity.generate()
        alice_seqs, bob_seqs = SequenceClock(registry.clock), SequenceClock(registry.clock)
        for _ in range(3):
            client.publish(alice, make_listing(alice, alice_seqs))
        with pytest.raises(
            RegistryError, match=r"rate limit: at most 3 records from one node per minute; retry in"
        ):
            client.publish(alice, make_listing(alice, alice_seqs))
        # Another key from the same address still gets through, up to the address's limit.
        client.publish(bob, make_listing(bob, bob_seqs))
        with pytest.raises(RegistryError, match="at most 5 records from one address per minute"):
            client.publish(bob, make_listing(bob, bob_seqs))
        client.search(SearchFilters())
        client.search(SearchFilters())
        with pytest.raises(RegistryError, match="at most 2 searches from one address per minute"):
            client.search(SearchFilters())
        # A new window: all allowed again.
        registry.clock.advance(60)
        client.publish(alice, make_listing(alice, alice_seqs))
        assert len(client.search(SearchFilters()).listings) == 2


def test_forged_signature_cannot_spend_another_keys_budget(db: str) -> None:
    with serve_registry(db, RegistryConfig(publish_per_key=2, publish_per_ip=0)) as registry:
        alice = Identity.generate()
        seqs = SequenceClock(registry.clock)
        forged = sign_record(alice, make_listing(alice, seqs))
        for _ in range(5):
            bad = SignedRecord(forged.record, bytes(64))
            assert post_raw(registry.url, bad)[0] == 400
        client = RegistryClient(registry.url)
        client.publish(alice, make_listing(alice, seqs))
        client.publish(alice, make_listing(alice, seqs))


def test_address_record_lookup_accepts_only_the_pinned_key(registry: RunningRegistry) -> None:
    alice, mallory = Identity.generate(), Identity.generate()
    client = RegistryClient(registry.url)
    seqs = SequenceClock(registry.clock)
    client.publish(alice, address_record_of(alice, seqs.next(), ["203.0.113.7:47001"], ""))
    found = client.lookup_addresses(str(alice.node_id), alice.public_key)
    assert found is not None and found.addresses == ["203.0.113.7:47001"]
    with pytest.raises(RegistryError, match="signed by another key"):
        client.lookup_addresses(str(alice.node_id), mallory.public_key)
    assert client.lookup_addresses(str(mallory.node_id), mallory.public_key) is None
    registry.clock.advance(OPEN.ttl + 1)
    assert client.lookup_addresses(str(alice.node_id), alice.public_key) is None


def test_oversized_body_refused(registry: RunningRegistry) -> None:
    request = urllib.request.Request(
        registry.url + "/v1/records", data=b"x" * (OPEN.max_body + 1), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 413
    assert "at most 16384 bytes" in json.loads(caught.value.read())["error"]["message"]


def test_unreachable_registry_is_one_clear_error() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(UnreachableError, match=r"registry at http://127.0.0.1:\d+ is unreachable"):
        RegistryClient(f"http://127.0.0.1:{port}", timeout=5).search(SearchFilters())


def test_unsigned_bytes_never_pass_for_a_listing() -> None:
    # What the registry relays is checked against DOMAIN + bytes: a record signed
    # without the domain prefix (a signature made for something else) fails.
    alice = Identity.generate()
    signed = sign_record(alice, make_listing(alice, SequenceClock()))
    assert signed.signature != alice.sign(signed.record)
    assert signed.signature == alice.sign(DOMAIN + signed.record)


class _ForgingRegistry:
    """A hostile registry on loopback: answers every GET with ``reply``."""

    def __init__(self, reply: dict[str, Any]) -> None:
        import http.server
        import threading

        body = json.dumps(reply).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _ForgingRegistry:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _wire(signed: SignedRecord) -> dict[str, Any]:
    return json.loads(msgspec.json.encode(signed))


def test_client_catches_a_registry_that_forges_a_listing() -> None:
    alice = Identity.generate()
    genuine = sign_record(alice, make_listing(alice, SequenceClock(), idle=False))
    raw = msgspec.msgpack.decode(genuine.record)
    raw["idle"] = True  # the registry makes a busy node look idle
    forged = SignedRecord(msgspec.msgpack.encode(raw), genuine.signature)
    with (
        _ForgingRegistry({"listings": [_wire(forged)], "next": ""}) as fake,
        pytest.raises(RegistryError, match="sent a record that does not verify"),
    ):
        RegistryClient(fake.url).search(SearchFilters())
    # A genuine listing that does not match what was asked is caught too.
    with _ForgingRegistry({"listings": [_wire(genuine)], "next": ""}) as fake:
        with pytest.raises(RegistryError, match="does not match the search"):
            RegistryClient(fake.url).search(SearchFilters(idle=True))
        assert len(RegistryClient(fake.url).search(SearchFilters()).listings) == 1


def test_client_rejects_an_address_record_signed_by_another_key() -> None:
    alice, mallory = Identity.generate(), Identity.generate()
    theirs = sign_record(
        mallory, address_record_of(mallory, SequenceClock().next(), ["198.51.100.9:47000"], "")
    )
    with (
        _ForgingRegistry(_wire(theirs)) as fake,
        pytest.raises(RegistryError, match="signed by another key"),
    ):
        RegistryClient(fake.url).lookup_addresses(str(alice.node_id), alice.public_key)


def test_publisher_refreshes_on_request_and_withdraws(registry: RunningRegistry) -> None:
    import asyncio

    from gpumesh.client.publishing import Publisher, Snapshot

    alice = Identity.generate()
    client = RegistryClient(registry.url)
    states = iter([True, False])

    async def snapshot() -> Snapshot:
        return Snapshot([GpuListing("NVIDIA GeForce RTX 4090", 24 * GIB, 20 * GIB)], next(states))

    async def scenario() -> None:
        publisher = Publisher(
            client=client,
            identity=alice,
            name="alice-pc",
            snapshot=snapshot,
            addresses=lambda: ["203.0.113.7:47000"],
            region="us-west",
            contact="alice@example.org",
            clock=registry.clock,
        )
        task = asyncio.create_task(publisher.run(first_wait=3600))
        assert await publisher.publish_once() == OPEN.ttl  # listing + address record
        assert names(client, idle=True) == ["alice-pc"]
        publisher.refresh_now()  # what `gpumesh sync` asks the node process for
        async with asyncio.timeout(30):
            # Polled: the publisher has no event for a test to wait on.
            while publisher.published < 4:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        task.cancel()
        assert publisher.last_error is None
        assert names(client, idle=True) == []  # the refresh carried the new state
        assert names(client) == ["alice-pc"]
        await publisher.withdraw()
        assert names(client) == []
        found = client.lookup_addresses(str(alice.node_id), alice.public_key)
        assert found is not None and found.addresses == ["203.0.113.7:47000"]

    asyncio.run(scenario())
