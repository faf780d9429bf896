"""The registry's database: SQLAlchemy Core, one code path for SQLite and PostgreSQL.

Every decision that must hold across several registry processes is one
statement the database makes atomic: a record is stored by an upsert that
only replaces a row with a *lower* sequence number (a stale or replayed
record changes nothing and is refused), and a rate-limit window is counted
by an upsert that returns the new count. Nothing is kept in memory between
requests.

A withdrawn or expired listing keeps its row (with its sequence number) until
it is older than any record the registry would still accept as fresh, so a
replay of an earlier listing is refused by one check or the other.

One network cannot fill the results: a listing is stored only while fewer than
``listings_per_net`` live listings of other nodes came from its publisher's
/24 (IPv4) or /64 (IPv6), counted in the transaction that stores it (on
PostgreSQL under an advisory lock per network, so that processes agree). The
first ``page_per_net`` of a network's listings are stored in tier 0 and the
rest in tier 1, which sorts after every tier-0 listing; a page of results also
ends before it would hold more than ``page_per_net`` of one network.

Schema versions are applied at start by the registry itself (the table
``registry_schema``), as ``store/db.py`` does for a node: three tables do not
need Alembic's environment, and a console script has no ``alembic.ini`` to
find. On PostgreSQL an advisory lock keeps processes that start together
from migrating twice.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from gpumesh.protocol.listing import (
    CLOCK_SKEW,
    MAX_AGE,
    AddressRecord,
    GpuListing,
    Listing,
    Record,
    SignedRecord,
)

__all__ = [
    "SCHEMA_VERSION",
    "NetCap",
    "Page",
    "Put",
    "RateLimit",
    "RegistryStore",
    "SearchQuery",
]

T = TypeVar("T")

SCHEMA_VERSION: Final = 3
MAX_BATCH: Final = 500
"""Most writes committed in one transaction."""
_MIGRATION_LOCK: Final = 0x67706D72  # "gpmr": the advisory lock id on PostgreSQL

metadata = sa.MetaData()

schema_table = sa.Table(
    "registry_schema",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True),
)

listings = sa.Table(
    "listings",
    metadata,
    sa.Column("node_id", sa.String(26), primary_key=True),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("timestamp", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("withdrawn", sa.Boolean, nullable=False),
    sa.Column("idle", sa.Boolean, nullable=False),
    sa.Column("region", sa.String(64), nullable=False),
    sa.Column("best_free", sa.BigInteger, nullable=False),
    sa.Column("record", sa.LargeBinary, nullable=False),
    sa.Column("signature", sa.LargeBinary, nullable=False),
    # schema 3: the publisher's /24 or /64 ("" for rows loaded in bulk) and the
    # listing's tier in it (0: among the network's first page_per_net)
    sa.Column("source_net", sa.String(64), nullable=False, server_default=""),
    sa.Column("tier", sa.SmallInteger, nullable=False, server_default="0"),
    # the search's sort: tier, then best_free descending, node_id ascending
    # (version 1's "listings_order" ran both ascending, which PostgreSQL cannot
    # walk for this mixed order without sorting every row of one best_free;
    # version 2's had no tier)
    sa.Index("listings_by_free", "tier", sa.desc("best_free"), "node_id"),
    sa.Index("listings_by_net", "source_net"),
    sa.Index("listings_expiry", "expires_at"),
)

listing_gpus = sa.Table(
    "listing_gpus",
    metadata,
    sa.Column(
        "node_id",
        sa.String(26),
        sa.ForeignKey("listings.node_id", ondelete="CASCADE"),
        primary_key=True,
    ),
    sa.Column("idx", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(96), nullable=False),
    sa.Column("memory_total", sa.BigInteger, nullable=False),
    sa.Column("memory_free", sa.BigInteger, nullable=False),
    sa.Index("listing_gpus_free", "memory_free"),
)

address_records = sa.Table(
    "address_records",
    metadata,
    sa.Column("node_id", sa.String(26), primary_key=True),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("record", sa.LargeBinary, nullable=False),
    sa.Column("signature", sa.LargeBinary, nullable=False),
)

rate_windows = sa.Table(
    "rate_windows",
    metadata,
    sa.Column("bucket", sa.String(120), primary_key=True),
    sa.Column("window", sa.BigInteger, nullable=False),
    sa.Column("count", sa.Integer, nullable=False),
)


@dataclass(frozen=True)
class SearchQuery:
    """Filters of a search; every one is optional."""

    gpu: str = ""
    """Part of a GPU model name, any case (``4090`` matches ``NVIDIA GeForce RTX 4090``)."""
    vram: int = 0
    """Bytes a GPU of the listing must have (free, or total with ``vram_total``)."""
    vram_total: bool = False
    idle: bool = False
    region: str = ""
    """Exact region, any case."""
    limit: int = 20
    cursor: str = ""
    """Where the previous page ended (its ``next``)."""


@dataclass(frozen=True)
class RateLimit:
    """One hit to count in ``bucket`` for time window ``window``, of ``allowed`` per window."""

    bucket: str
    window: int
    allowed: int


@dataclass(frozen=True)
class NetCap:
    """The publisher's network of a listing, and what it may hold."""

    net: str
    """Its /24 or /64 (:func:`gpumesh.registry.config.source_network`)."""
    live: int
    """Live listings of other nodes from ``net`` above which this one is refused (0: no cap)."""
    first: int
    """Listings of ``net`` in tier 0; the rest sort after every tier-0 one (0: all tier 0)."""


@dataclass(frozen=True)
class Put:
    stored: bool
    """False: over the rate limit (``hits`` above what it allows), the network's cap
    (``crowded``), or a record with this sequence number or a higher one is stored
    (stale)."""
    hits: int
    """The rate limit's count in its window, this hit included (0 without one)."""
    crowded: int = 0
    """Refused by the network's cap: the live listings of other nodes from it (else 0)."""


@dataclass(frozen=True)
class Page:
    records: list[SignedRecord]
    next: str
    """The cursor of the next page, empty on the last one."""


def _cursor(tier: int, best_free: int, node_id: str) -> str:
    text = f"{tier}:{best_free}:{node_id}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _parse_cursor(text: str) -> tuple[int, int, str]:
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        parts = raw.split(":")
        if len(parts) == 2:  # given out before schema 3: tier 0
            parts.insert(0, "0")
        tier, free, node_id = parts
        return int(tier), int(free), node_id
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the cursor is not one this registry gave out") from None


class RegistryStore:
    """The database of one registry process (several may share one PostgreSQL).

    Every operation is one function of a SQLAlchemy ``Connection``, the same
    for both databases; only how it runs differs. PostgreSQL: through asyncpg
    in the event loop (``run_sync``). SQLite: in a worker thread on the
    standard library's driver, one thread hop per operation, where the async
    driver took one per statement and cursor call (about a dozen per publish,
    most of the registry's time).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        parsed = sa.engine.make_url(url)
        self.dialect = parsed.get_backend_name()
        self.engine: AsyncEngine | None = None
        self._sync: sa.Engine | None = None
        if self.dialect == "sqlite":
            self._sync = sa.create_engine(parsed.set(drivername="sqlite"))
            sa.event.listen(self._sync, "connect", _sqlite_pragmas)
        else:
            self.engine = create_async_engine(
                url, pool_size=10, max_overflow=10, pool_pre_ping=True
            )
        # Every write of this process goes through one queue: what gathers while
        # a transaction commits is committed together in the next one, and each
        # caller is answered after the commit that holds its write. SQLite has one
        # writer anyway (two pooled connections upgrading from a read to a write
        # fail at once with "database is locked"), and one commit per batch instead
        # of per request is most of the registry's publish rate on both databases.
        self._statements = _Statements(self.dialect)
        self._pending: list[_Write] = []
        self.commits = 0
        """Write transactions committed by this store (batches; for tests and the bench)."""
        self._writer: asyncio.Task[None] | None = None

    async def _write(self, operation: Callable[..., T], *args: Any) -> T:
        """Run ``operation(connection, *args)`` in a transaction, perhaps with others.

        Returns once that transaction has committed. If a batch fails, each of
        its writes is retried in a transaction of its own, so one bad write
        fails only its own caller.
        """
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append(_Write(operation, args, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain())
        result: T = await future
        return result

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            try:
                results = await self._transaction(_run_batch, batch)
                self.commits += 1
            except Exception as exc:
                if len(batch) == 1:
                    _settle(batch[0].future, exc=exc)
                    continue
                for write in batch:  # alone, so that only the bad one fails
                    try:
                        _settle(write.future, (await self._transaction(_run_batch, [write]))[0])
                        self.commits += 1
                    except Exception as alone:
                        _settle(write.future, exc=alone)
                continue
            for write, result in zip(batch, results, strict=True):
                _settle(write.future, result)

    async def _transaction(self, operation: Callable[..., T], *args: Any) -> T:
        return await self._run(True, operation, *args)

    async def _read(self, operation: Callable[..., T], *args: Any) -> T:
        return await self._run(False, operation, *args)

    async def _run(self, write: bool, operation: Callable[..., T], *args: Any) -> T:
        """``operation(connection, *args)``, in a transaction that commits when ``write``."""
        if self._sync is not None:
            return await asyncio.to_thread(self._sync_run, write, operation, *args)
        assert self.engine is not None
        async with self.engine.begin() if write else self.engine.connect() as conn:
            return await conn.run_sync(operation, *args)

    def _sync_run(self, write: bool, operation: Callable[..., T], *args: Any) -> T:
        assert self._sync is not None
        with self._sync.begin() if write else self._sync.connect() as conn:
            return operation(conn, *args)

    async def open(self) -> None:
        """Create or upgrade the schema."""
        await self._write(self._migrate)

    def _migrate(self, conn: sa.Connection) -> None:
        if self.dialect == "postgresql":
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_MIGRATION_LOCK)))
        metadata.create_all(conn)
        version = conn.execute(sa.select(sa.func.max(schema_table.c.version))).scalar()
        if version is None:
            conn.execute(sa.insert(schema_table).values(version=SCHEMA_VERSION))
        elif version > SCHEMA_VERSION:
            raise RuntimeError(
                f"the database has registry schema {version}, newer than this "
                f"gpumesh-registry ({SCHEMA_VERSION}); upgrade gpumesh"
            )
        elif version < SCHEMA_VERSION:
            if version < 2:  # 1 -> 2: the sort's index in the sort's own order
                conn.execute(sa.text("DROP INDEX IF EXISTS listings_order"))
            # 2 -> 3: the publisher's network and the tier, first in the sort's index
            columns = {c["name"] for c in sa.inspect(conn).get_columns("listings")}
            if "source_net" not in columns:
                conn.execute(
                    sa.text(
                        "ALTER TABLE listings ADD COLUMN source_net VARCHAR(64) NOT NULL DEFAULT ''"
                    )
                )
            if "tier" not in columns:
                conn.execute(
                    sa.text("ALTER TABLE listings ADD COLUMN tier SMALLINT NOT NULL DEFAULT 0")
                )
            conn.execute(sa.text("DROP INDEX IF EXISTS listings_by_free"))
            for index in listings.indexes:
                if index.name in ("listings_by_free", "listings_by_net"):
                    index.create(conn, checkfirst=True)
            conn.execute(sa.update(schema_table).values(version=SCHEMA_VERSION))

    async def drop_all(self) -> None:
        """Remove every registry table (tests and benchmarks start from nothing)."""
        await self._write(metadata.drop_all)

    async def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer
        if self.engine is not None:
            await self.engine.dispose()
        if self._sync is not None:
            self._sync.dispose()

    async def count_hit(self, bucket: str, window: int) -> int:
        """Count one hit in ``bucket`` for the time window ``window``; the count so far."""
        return await self._write(self._count_hit, bucket, window)

    def _count_hit(self, conn: sa.Connection, bucket: str, window: int) -> int:
        return _scalar_int(conn, self._statements.count_hit, {"bucket": bucket, "window": window})

    async def put(
        self,
        record: Record,
        signed: SignedRecord,
        now: float,
        ttl: float,
        limit: RateLimit | None = None,
        net: NetCap | None = None,
    ) -> Put:
        """Store ``record`` if its seq is above the stored one.

        With ``limit``, first count one hit in its bucket, in the same
        transaction, and store nothing when that is over what it allows. With
        ``net``, a listing is stored only within its network's cap, in its tier.
        """
        return await self._write(self._limited_put, record, signed, now, ttl, limit, net)

    def _limited_put(
        self,
        conn: sa.Connection,
        record: Record,
        signed: SignedRecord,
        now: float,
        ttl: float,
        limit: RateLimit | None,
        net: NetCap | None,
    ) -> Put:
        hits = 0
        if limit is not None:
            hits = self._count_hit(conn, limit.bucket, limit.window)
            if hits > limit.allowed:
                return Put(False, hits)
        tier = 0
        if net is not None and (net.live or net.first) and isinstance(record, Listing):
            others, first = self._neighbours(conn, net.net, str(record.node_id), now)
            if net.live and others >= net.live:
                return Put(False, hits, crowded=others)
            tier = 1 if net.first and first >= net.first else 0
        return Put(self._put(conn, record, signed, now, ttl, net.net if net else "", tier), hits)

    def _neighbours(
        self, conn: sa.Connection, net: str, node_id: str, now: float
    ) -> tuple[int, int]:
        """Live listings of other nodes from ``net``: all of them, and those in tier 0."""
        if self.dialect == "postgresql":  # one publisher of a network at a time
            key = int.from_bytes(hashlib.sha256(net.encode()).digest()[:8], "big", signed=True)
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(key)))
        row = conn.execute(
            sa.select(
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(sa.case((listings.c.tier == 0, 1), else_=0)), 0),
            ).where(
                listings.c.source_net == net,
                listings.c.node_id != node_id,
                listings.c.expires_at > now,
                listings.c.withdrawn.is_(False),
            )
        ).one()
        return int(row[0]), int(row[1])

    def _put(
        self,
        conn: sa.Connection,
        record: Record,
        signed: SignedRecord,
        now: float,
        ttl: float,
        net: str = "",
        tier: int = 0,
    ) -> bool:
        node_id = str(record.node_id)
        if isinstance(record, AddressRecord):
            return self._upsert(
                conn,
                address_records,
                {
                    "node_id": node_id,
                    "seq": record.seq,
                    "expires_at": now + ttl,
                    "record": signed.record,
                    "signature": signed.signature,
                },
            )
        if isinstance(record, Listing):
            row = _listing_row(record, signed, now, ttl, node_id, net, tier)
        else:  # a withdrawal: the row stays, as a tombstone with its seq
            row = {
                "node_id": node_id,
                "seq": record.seq,
                "timestamp": record.timestamp,
                "expires_at": now,
                "withdrawn": True,
                "idle": False,
                "region": "",
                "best_free": 0,
                "record": signed.record,
                "signature": signed.signature,
                "source_net": "",
                "tier": 0,
            }
        if not self._upsert(conn, listings, row):
            return False
        gpus = []
        if isinstance(record, Listing):
            gpus = [_gpu_row(node_id, index, gpu) for index, gpu in enumerate(record.gpus)]
        deferred: dict[str, list[dict[str, Any]]] | None = conn.info.get(_GPU_ROWS)
        if deferred is not None:  # in a batch: one DELETE and one INSERT at its end
            deferred[node_id] = gpus
        else:
            _replace_gpus(conn, {node_id: gpus})
        return True

    def _upsert(self, conn: sa.Connection, table: sa.Table, row: dict[str, Any]) -> bool:
        return conn.execute(self._statements.upsert[table.name], row).first() is not None

    async def search(self, query: SearchQuery, now: float, per_net: int = 0) -> Page:
        """One page of ``query``; with ``per_net``, a page ends before it would hold
        more than that many listings of one network (the next page starts there)."""
        rows = await self._read(_all_rows, search_statement(query, now))
        page: list[Any] = []
        seen: dict[str, int] = {}
        for row in rows[: query.limit]:
            if per_net and row.source_net and seen.get(row.source_net, 0) >= per_net:
                break
            seen[row.source_net] = seen.get(row.source_net, 0) + 1
            page.append(row)
        following = ""
        if len(page) < len(rows):
            last = page[-1]
            following = _cursor(last.tier, last.best_free, last.node_id)
        return Page([SignedRecord(bytes(r.record), bytes(r.signature)) for r in page], following)

    async def bulk_insert(
        self, records: list[tuple[Listing, SignedRecord]], now: float, ttl: float
    ) -> None:
        """Insert listings of nodes not yet listed, in one transaction, without the
        per-record sequence check: the benchmark's preload, not a way in for a peer."""
        rows = [_listing_row(record, signed, now, ttl) for record, signed in records]
        gpus = [
            _gpu_row(str(record.node_id), index, gpu)
            for record, _ in records
            for index, gpu in enumerate(record.gpus)
        ]
        await self._write(_insert_many, rows, gpus)

    async def explain(self, query: SearchQuery, now: float) -> str:
        """PostgreSQL's plan of ``query``'s statement, run (EXPLAIN ANALYZE)."""
        assert self.engine is not None, "EXPLAIN ANALYZE is PostgreSQL's"
        stmt = search_statement(query, now).compile(
            dialect=self.engine.dialect, compile_kwargs={"literal_binds": True}
        )
        text = sa.text(f"EXPLAIN (ANALYZE, BUFFERS) {stmt}")
        rows = await self._read(_all_rows, text)
        return "\n".join(str(row[0]) for row in rows)

    async def analyze(self) -> None:
        """Refresh PostgreSQL's statistics (after a bulk load)."""
        if self.dialect == "postgresql":
            await self._write(_execute, sa.text("ANALYZE"))

    async def addresses(self, node_id: str, now: float) -> SignedRecord | None:
        stmt = sa.select(address_records.c.record, address_records.c.signature).where(
            address_records.c.node_id == node_id, address_records.c.expires_at > now
        )
        rows = await self._read(_all_rows, stmt)
        return SignedRecord(bytes(rows[0].record), bytes(rows[0].signature)) if rows else None

    async def purge(self, now: float, window: int) -> int:
        """Delete what expired before any record it could refuse would still be fresh."""
        return await self._write(_purge, now - MAX_AGE - CLOCK_SKEW, window)

    async def ping(self) -> None:
        """One round trip to the database (what ``/v1/health`` checks)."""
        await self._read(_scalar_int, sa.select(1))


_DELETE_GPUS: Final = sa.delete(listing_gpus).where(
    listing_gpus.c.node_id.in_(sa.bindparam("nodes", expanding=True))
)
_INSERT_GPUS: Final = sa.insert(listing_gpus)


class _Statements:
    """The writes of a publish, built once per store: SQLAlchemy then reuses their
    compiled form, where a statement built per request cost more than the
    database's own work (it was most of a publish's time)."""

    def __init__(self, dialect: str) -> None:
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        self.upsert: dict[str, Any] = {}
        for table in (listings, address_records):
            stmt = insert(table).values({c.name: sa.bindparam(c.name) for c in table.columns})
            self.upsert[table.name] = stmt.on_conflict_do_update(
                index_elements=[table.c.node_id],
                set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name != "node_id"},
                where=table.c.seq < stmt.excluded.seq,
            ).returning(table.c.node_id)
        hit = insert(rate_windows).values(
            bucket=sa.bindparam("bucket"), window=sa.bindparam("window"), count=1
        )
        existing = rate_windows.c
        self.count_hit = hit.on_conflict_do_update(
            index_elements=[existing.bucket],
            set_={
                "count": sa.case(
                    (existing.window == hit.excluded.window, existing.count + 1), else_=1
                ),
                "window": hit.excluded.window,
            },
        ).returning(existing.count)


@dataclass(frozen=True)
class _Write:
    operation: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]


_GPU_ROWS: Final = "gpumesh-registry-gpu-rows"
"""Key in ``Connection.info`` of the GPU rows a batch's upserts replace, by node id."""


def _run_batch(conn: sa.Connection, batch: list[_Write]) -> list[Any]:
    """Every write of ``batch`` in order, then the GPU rows of the listings it stored
    (the last stored record's, per node) in one DELETE and one INSERT."""
    deferred: dict[str, list[dict[str, Any]]] = {}
    conn.info[_GPU_ROWS] = deferred
    try:
        results = [write.operation(conn, *write.args) for write in batch]
    finally:
        del conn.info[_GPU_ROWS]
    _replace_gpus(conn, deferred)
    return results


def _replace_gpus(conn: sa.Connection, rows: dict[str, list[dict[str, Any]]]) -> None:
    if not rows:
        return
    conn.execute(_DELETE_GPUS, {"nodes": list(rows)})
    inserted = [row for gpus in rows.values() for row in gpus]
    if inserted:
        conn.execute(_INSERT_GPUS, inserted)


def _settle(future: asyncio.Future[Any], result: Any = None, exc: Exception | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def search_statement(query: SearchQuery, now: float) -> sa.Select[Any]:
    """The SELECT of one page of ``query``, sorted by best free memory then node id."""
    conditions: list[sa.ColumnElement[bool]] = [
        listings.c.expires_at > now,
        listings.c.withdrawn.is_(False),
    ]
    if query.idle:
        conditions.append(listings.c.idle.is_(True))
    if query.region:
        conditions.append(listings.c.region == query.region.lower())
    if query.gpu or query.vram:
        gpu_conditions: list[sa.ColumnElement[bool]] = [
            listing_gpus.c.node_id == listings.c.node_id
        ]
        if query.gpu:
            pattern = "%" + _escape_like(query.gpu.lower()) + "%"
            gpu_conditions.append(listing_gpus.c.name.like(pattern, escape="\\"))
        if query.vram:
            column = listing_gpus.c.memory_total if query.vram_total else listing_gpus.c.memory_free
            gpu_conditions.append(column >= query.vram)
        conditions.append(sa.exists().where(*gpu_conditions))
    if query.cursor:
        tier, free, node_id = _parse_cursor(query.cursor)
        conditions.append(listings.c.tier >= tier)  # where the index scan starts
        conditions.append(
            sa.or_(
                listings.c.tier > tier,
                sa.and_(
                    listings.c.tier == tier,
                    sa.or_(
                        listings.c.best_free < free,
                        sa.and_(listings.c.best_free == free, listings.c.node_id > node_id),
                    ),
                ),
            )
        )
    columns = listings.c
    return (
        sa.select(
            columns.record,
            columns.signature,
            columns.tier,
            columns.best_free,
            columns.node_id,
            columns.source_net,
        )
        .where(*conditions)
        .order_by(columns.tier, columns.best_free.desc(), columns.node_id)
        .limit(query.limit + 1)
    )


def _listing_row(
    record: Listing,
    signed: SignedRecord,
    now: float,
    ttl: float,
    node_id: str = "",
    net: str = "",
    tier: int = 0,
) -> dict[str, Any]:
    return {
        "node_id": node_id or str(record.node_id),
        "seq": record.seq,
        "timestamp": record.timestamp,
        "expires_at": now + ttl,
        "withdrawn": False,
        "idle": record.idle,
        "region": record.region.lower(),
        "best_free": max((g.memory_free for g in record.gpus), default=0),
        "record": signed.record,
        "signature": signed.signature,
        "source_net": net,
        "tier": tier,
    }


def _gpu_row(node_id: str, index: int, gpu: GpuListing) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "idx": index,
        "name": gpu.name.lower(),
        "memory_total": gpu.memory_total,
        "memory_free": gpu.memory_free,
    }


def _insert_many(
    conn: sa.Connection, rows: list[dict[str, Any]], gpus: list[dict[str, Any]]
) -> None:
    if rows:
        conn.execute(sa.insert(listings), rows)
    if gpus:
        conn.execute(sa.insert(listing_gpus), gpus)


def _execute(conn: sa.Connection, stmt: Any) -> None:
    conn.execute(stmt)


def _scalar_int(conn: sa.Connection, stmt: Any, params: dict[str, Any] | None = None) -> int:
    return int(conn.execute(stmt, params).scalar_one())


def _all_rows(conn: sa.Connection, stmt: Any) -> list[Any]:
    return list(conn.execute(stmt).all())


def _purge(conn: sa.Connection, horizon: float, window: int) -> int:
    gone = conn.execute(sa.delete(listings).where(listings.c.expires_at < horizon)).rowcount
    conn.execute(
        sa.delete(listing_gpus).where(
            ~sa.exists().where(listings.c.node_id == listing_gpus.c.node_id)
        )
    )
    gone += conn.execute(
        sa.delete(address_records).where(address_records.c.expires_at < horizon)
    ).rowcount
    conn.execute(sa.delete(rate_windows).where(rate_windows.c.window < window))
    return int(gone)


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
