"""The registry's schema upgrade, on SQLite and a real PostgreSQL: a database
made by schema 1 (the sort's index both ascending) gets schema 2's index in the
search's own order, and keeps its listings."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import open_record
from gpumesh.registry.config import database_url
from gpumesh.registry.store import SCHEMA_VERSION, RegistryStore, SearchQuery, schema_table
from tests.integration.public_registry import DATABASES, empty_database
from tests.integration.test_registry_batching import listed_names, signed_listing


@pytest.fixture(params=DATABASES)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_database(request.param, tmp_path)


def _index_names(conn: sa.Connection) -> set[str]:
    return {str(index["name"]) for index in sa.inspect(conn).get_indexes("listings")}


def _make_schema_1(conn: sa.Connection) -> None:
    conn.execute(sa.text("DROP INDEX listings_by_free"))
    conn.execute(sa.text("CREATE INDEX listings_order ON listings (best_free, node_id)"))
    conn.execute(sa.update(schema_table).values(version=1))


def test_schema_1_is_upgraded_in_place(db: str) -> None:
    async def scenario() -> None:
        now = time.time()
        alice = Identity.generate()
        signed = signed_listing(alice, 10, now, "alice-pc")
        old = RegistryStore(database_url(db))
        await old.open()
        await old.put(open_record(signed), signed, now, 900)
        await old._write(_make_schema_1)
        assert "listings_order" in await old._read(_index_names)
        await old.close()

        store = RegistryStore(database_url(db))
        await store.open()
        try:
            indexes = await store._read(_index_names)
            assert "listings_by_free" in indexes and "listings_order" not in indexes
            version = await store._read(
                lambda conn: conn.execute(sa.select(schema_table.c.version)).scalar_one()
            )
            assert version == SCHEMA_VERSION == 3
            page = await store.search(SearchQuery(), now)
            assert listed_names(page.records) == {"alice-pc"}
        finally:
            await store.close()

    asyncio.run(scenario())
