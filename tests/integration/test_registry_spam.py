"""The public registry against one spammer, over real HTTP on SQLite and PostgreSQL.

Publishers speak from distinct loopback addresses (127.0.N.M: N names the /24),
bound as the source of each real TCP connection, so the registry sees each
network as it would on the Internet. Keys are free, so every spam listing has a
key of its own: only limits on the source and its network hold.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.parse
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
from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import GpuListing, Record, sign_record
from gpumesh.registry.config import RegistryConfig
from tests.integration.public_registry import (
    DATABASES,
    RunningRegistry,
    empty_database,
    serve_registry,
)

GIB = 1 << 30


@pytest.fixture(params=DATABASES)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_database(request.param, tmp_path)


@pytest.fixture
def registry(db: str) -> Iterator[RunningRegistry]:
    """The registry as it ships: every default in force."""
    with serve_registry(db, RegistryConfig()) as running:
        yield running


def post_from(
    url: str,
    source: str,
    identity: Identity,
    record: Record,
    headers: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Publish ``record`` over a connection from ``source``; the status and the message."""
    parsed = urllib.parse.urlsplit(url)
    assert parsed.hostname is not None
    conn = http.client.HTTPConnection(
        parsed.hostname, parsed.port, timeout=30, source_address=(source, 0)
    )
    try:
        body = msgspec.json.encode(sign_record(identity, record))
        conn.request(
            "POST", "/v1/records", body, {"content-type": "application/json", **(headers or {})}
        )
        response = conn.getresponse()
        reply: dict[str, Any] = json.loads(response.read())
    finally:
        conn.close()
    return response.status, str(reply.get("error", {}).get("message", ""))


def listing(identity: Identity, seqs: SequenceClock, name: str, free_gib: int) -> Any:
    return listing_of(
        identity,
        seqs.next(),
        name=name,
        gpus=[GpuListing("NVIDIA GeForce RTX 4090", 24 * GIB, free_gib * GIB)],
        idle=True,
        region="",
        contact="",
        version="0.1.0",
    )


def every_page(client: RegistryClient, gpu: str = "", limit: int = 20) -> list[list[str]]:
    """The names on each page of a search, following its cursors to the end."""
    pages: list[list[str]] = []
    cursor = ""
    while True:
        page = client.search(SearchFilters(gpu=gpu, limit=limit, cursor=cursor))
        pages.append([f.listing.name for f in page.listings])
        if not page.next:
            return pages
        cursor = page.next


def test_one_address_publishes_at_most_30_records_a_minute(registry: RunningRegistry) -> None:
    # Address records are not capped per network: only the address's rate limit holds.
    for n in range(30):
        key = Identity.generate()
        record = address_record_of(key, SequenceClock(registry.clock).next(), ["192.0.2.1:1"], "")
        assert post_from(registry.url, "127.0.9.1", key, record)[0] == 200, n
    key = Identity.generate()
    record = address_record_of(key, SequenceClock(registry.clock).next(), ["192.0.2.1:1"], "")
    status, message = post_from(registry.url, "127.0.9.1", key, record)
    assert status == 429
    assert message.startswith("rate limit: at most 30 records from one address per minute")
    # Another address of the same network has its own budget.
    assert post_from(registry.url, "127.0.9.2", key, record)[0] == 200


def test_a_network_holds_at_most_3_live_listings(registry: RunningRegistry) -> None:
    keys = [Identity.generate() for _ in range(5)]
    seqs = [SequenceClock(registry.clock) for _ in keys]
    for n in range(3):  # three addresses of one /24
        made = listing(keys[n], seqs[n], f"spam-{n}", 20)
        assert post_from(registry.url, f"127.0.7.{n + 1}", keys[n], made)[0] == 200
    status, message = post_from(
        registry.url, "127.0.7.9", keys[3], listing(keys[3], seqs[3], "spam-3", 20)
    )
    assert status == 429
    assert message == (
        "at most 3 live listings may come from one network, and 3 are listed from "
        "127.0.7.0/24; withdraw one of them, or wait until one expires (a listing lasts "
        "900s without a refresh)"
    )
    # A listed node refreshes its own listing; another network is not counted.
    refresh = listing(keys[0], seqs[0], "spam-0", 20)
    assert post_from(registry.url, "127.0.7.1", keys[0], refresh)[0] == 200
    assert (
        post_from(registry.url, "127.0.8.1", keys[4], listing(keys[4], seqs[4], "other", 20))[0]
        == 200
    )
    # A withdrawal makes room.
    assert (
        post_from(registry.url, "127.0.7.2", keys[1], withdrawal_of(keys[1], seqs[1].next()))[0]
        == 200
    )
    assert (
        post_from(registry.url, "127.0.7.9", keys[3], listing(keys[3], seqs[3], "spam-3", 20))[0]
        == 200
    )
    pages = every_page(RegistryClient(registry.url), limit=50)
    assert sorted(name for page in pages for name in page) == [
        "other",
        "spam-0",
        "spam-2",
        "spam-3",
    ]
    assert all(sum(name.startswith("spam-") for name in page) <= 2 for page in pages)


def test_spam_cannot_take_the_first_page_of_a_search(registry: RunningRegistry) -> None:
    spammer = [Identity.generate() for _ in range(25)]
    refused = 0
    for n, key in enumerate(spammer):  # one address, the most memory a GPU may list
        made = listing(key, SequenceClock(registry.clock), f"spam-{n}", 24)
        refused += post_from(registry.url, "127.0.5.5", key, made)[0] == 429
    assert refused == 22
    for n in range(18):  # honest nodes, each on a network of its own, with less free
        key = Identity.generate()
        made = listing(key, SequenceClock(registry.clock), f"honest-{n}", 8)
        assert post_from(registry.url, f"127.0.{20 + n}.1", key, made)[0] == 200
    pages = every_page(RegistryClient(registry.url), gpu="4090")
    assert len(pages[0]) == 20
    assert sum(name.startswith("spam-") for name in pages[0]) == 2
    # The network's third listing comes later, and every listing comes once.
    seen = [name for page in pages for name in page]
    assert len(seen) == len(set(seen)) == 21


def test_no_page_holds_more_than_2_listings_of_one_network(registry: RunningRegistry) -> None:
    keys = [Identity.generate() for _ in range(5)]
    for n, key in enumerate(keys[:3]):  # one network, all at the top of the sort
        made = listing(key, SequenceClock(registry.clock), f"net-a-{n}", 20 - n)
        assert post_from(registry.url, f"127.0.3.{n + 1}", key, made)[0] == 200
    for n, key in enumerate(keys[3:]):
        made = listing(key, SequenceClock(registry.clock), f"net-b-{n}", 10 - n)
        assert post_from(registry.url, f"127.0.4.{n + 1}", key, made)[0] == 200
    pages = every_page(RegistryClient(registry.url), limit=3)
    for names in pages:
        for net in ("net-a-", "net-b-"):
            assert sum(name.startswith(net) for name in names) <= 2, pages
    assert sorted(name for names in pages for name in names) == sorted(
        [f"net-a-{n}" for n in range(3)] + [f"net-b-{n}" for n in range(2)]
    )
    assert pages[0] == ["net-a-0", "net-a-1", "net-b-0"]


def test_only_a_named_proxy_may_say_who_the_client_is(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "gpumesh.registry.main", "--listen", "127.0.0.1:0"]
    argv += ["--db", str(tmp_path / "r.db"), "--forwarded-allow-ips", "127.0.0.1"]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("gpumesh-registry listening on "), line + server.stderr.read()
        url = line.split(" on ", 1)[1].split(" (", 1)[0]

        def publish(source: str, client: str) -> tuple[int, str]:
            key = Identity.generate()
            made = listing(key, SequenceClock(time.time), "n", 20)
            return post_from(url, source, key, made, {"x-forwarded-for": client})

        # Through the proxy, each client counts as itself: one network fills up...
        for n in range(3):
            assert publish("127.0.0.1", f"198.51.100.{n + 1}")[0] == 200
        status, message = publish("127.0.0.1", "198.51.100.77")
        assert status == 429 and "3 are listed from 198.51.100.0/24" in message
        # ...and another does not.
        assert publish("127.0.0.1", "192.0.2.1")[0] == 200
        # Anyone else who sends the header still counts as its own address.
        for n in range(3):
            assert publish(f"127.0.2.{n + 1}", f"203.0.113.{n + 1}")[0] == 200
        status, message = publish("127.0.2.9", "203.0.113.99")
        assert status == 429 and "3 are listed from 127.0.2.0/24" in message
    finally:
        server.terminate()
        server.communicate(timeout=30)


def test_forwarded_allow_ips_any_is_refused_in_one_line(tmp_path: Path) -> None:
    for value, refusal in (
        (
            "*",
            "--forwarded-allow-ips '*' would let every client choose the address its rate "
            "limits count: name your proxies' addresses (e.g. 127.0.0.1)",
        ),
        ("127.0.0.1,*", "--forwarded-allow-ips '*' would let every client choose"),
        ("proxy.example", "--forwarded-allow-ips 'proxy.example' is not an IP address"),
    ):
        argv = [sys.executable, "-m", "gpumesh.registry.main", "--listen", "127.0.0.1:0"]
        argv += ["--db", str(tmp_path / "r.db"), "--forwarded-allow-ips", value]
        try:
            ran = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail(f"gpumesh-registry --forwarded-allow-ips {value!r} started serving")
        assert ran.returncode == 2, ran.stderr
        lines = ran.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), ran.stderr
        assert refusal in lines[0]
