"""The registry's HTTP API (Starlette): publish signed records, search, look up.

Routes (JSON; every refusal is ``{"error": {"code", "message"}}`` with a status)::

    POST /v1/records                 one SignedRecord {"record": b64, "signature": b64}
    GET  /v1/listings?gpu=&vram=&vram_of=free|total&idle=1&region=&limit=&cursor=
    GET  /v1/addresses/{node_id}     the node's address record, if fresh
    GET  /v1/health

Order of checks on a publish, cheapest first and so that nobody can spend
another node's budget: body size, the source address's rate, the signature
and fields, freshness by timestamp, then the key's rate (only a verified key
is counted), then the cap on live listings of the publisher's network and the
sequence number (in the store's one upsert). The key's count, the network's
count and the upsert are one write; the store commits the writes of
concurrent requests together (one transaction per batch), and a request is
answered only after the commit that holds its write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gpumesh.errors import ConfigError, ProtocolError
from gpumesh.protocol.listing import SignedRecord, check_fresh, open_record, record_kind
from gpumesh.registry.config import RegistryConfig, rate_source, source_network
from gpumesh.registry.store import NetCap, RateLimit, RegistryStore, SearchQuery
from gpumesh.units import parse_size
from gpumesh.version import __version__

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

RATE_WINDOW = 60


class _Refused(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(body), status, headers=headers, media_type="application/json"
    )


def create_app(
    config: RegistryConfig,
    store: RegistryStore,
    *,
    clock: Callable[[], float] = time.time,
    open_store: bool = True,
) -> Starlette:
    """The ASGI app; unless ``open_store`` is False it opens ``store`` at start and
    closes it at the end (the console script opens it first, to report a bad --db)."""

    def over(allowed: int, what: str, now: float) -> _Refused:
        wait = max(1, int(RATE_WINDOW - now % RATE_WINDOW) + 1)
        return _Refused(
            429,
            "rate_limited",
            f"rate limit: at most {allowed} {what} per minute; retry in {wait}s",
            wait,
        )

    async def limit(bucket: str, allowed: int, what: str) -> None:
        if not allowed:
            return
        now = clock()
        if await store.count_hit(bucket, int(now // RATE_WINDOW)) > allowed:
            raise over(allowed, what, now)

    async def publish(request: Request) -> Response:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body:
            raise _Refused(413, "too_large", f"a record is at most {config.max_body} bytes of JSON")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > config.max_body:
                raise _Refused(
                    413, "too_large", f"a record is at most {config.max_body} bytes of JSON"
                )
        source = request.client.host if request.client else "unknown"
        await limit(
            f"pub-ip:{rate_source(source)}", config.publish_per_ip, "records from one address"
        )
        try:
            signed = msgspec.json.decode(bytes(body), type=SignedRecord)
        except msgspec.DecodeError as exc:
            raise _Refused(400, "bad_record", f"not a signed record ({exc})") from None
        try:  # Ed25519 verification releases the GIL: another core does it
            record = await asyncio.to_thread(open_record, signed)
        except ProtocolError as exc:
            raise _Refused(400, "bad_record", exc.message) from None
        now = clock()
        try:
            check_fresh(record, now)
        except ProtocolError as exc:
            raise _Refused(409, "stale", exc.message) from None
        node_id = str(record.node_id)
        per_key = config.publish_per_key
        # the key's hit is counted in the transaction that stores the record
        key_limit = (
            RateLimit(f"pub-key:{node_id}", int(now // RATE_WINDOW), per_key) if per_key else None
        )
        net = source_network(source)
        cap = NetCap(net, config.listings_per_net, config.page_per_net)
        put = await store.put(record, signed, now, config.ttl, key_limit, cap)
        if key_limit is not None and put.hits > per_key:
            raise over(per_key, "records from one node", now)
        if put.crowded:
            raise _Refused(
                429,
                "network_full",
                f"at most {config.listings_per_net} live listings may come from one network, "
                f"and {put.crowded} are listed from {net}; withdraw one of them, or wait "
                f"until one expires (a listing lasts {config.ttl:.0f}s without a refresh)",
                int(config.ttl),
            )
        if not put.stored:
            raise _Refused(
                409,
                "stale",
                f"stale record: sequence number {record.seq} is not above the last "
                f"{record_kind(record)} record accepted from node {node_id} "
                "(a replay, or an older copy)",
            )
        logger.info("accepted %s seq %d from %s", type(record).__name__, record.seq, node_id)
        return _json({"node_id": node_id, "seq": record.seq, "expires_in": config.ttl})

    async def search(request: Request) -> Response:
        source = request.client.host if request.client else "unknown"
        await limit(
            f"search-ip:{rate_source(source)}", config.search_per_ip, "searches from one address"
        )
        params = request.query_params
        try:
            vram = parse_size(params["vram"]) if params.get("vram") else 0
            limit_n = int(params.get("limit", "20"))
        except (ConfigError, ValueError):
            raise _Refused(400, "bad_query", "vram is a size (8GB) and limit a number") from None
        vram_of = params.get("vram_of", "free")
        if vram_of not in ("free", "total"):
            raise _Refused(400, "bad_query", "vram_of is free or total")
        query = SearchQuery(
            gpu=params.get("gpu", "")[:96],
            vram=vram,
            vram_total=vram_of == "total",
            idle=params.get("idle", "") in ("1", "true", "yes"),
            region=params.get("region", "")[:64],
            limit=max(1, min(limit_n, config.page_max)),
            cursor=params.get("cursor", "")[:200],
        )
        try:
            page = await store.search(query, clock(), config.page_per_net)
        except ValueError as exc:
            raise _Refused(400, "bad_query", str(exc)) from None
        return _json({"listings": page.records, "next": page.next})

    async def addresses(request: Request) -> Response:
        source = request.client.host if request.client else "unknown"
        await limit(
            f"search-ip:{rate_source(source)}", config.search_per_ip, "searches from one address"
        )
        node_id = request.path_params["node_id"][:26]
        found = await store.addresses(node_id, clock())
        if found is None:
            raise _Refused(404, "not_found", f"no fresh address record for node {node_id}")
        return _json(found)

    async def health(_request: Request) -> Response:
        await store.ping()  # a health check that fails when the database does
        return _json({"ok": True, "version": __version__})

    def refusing(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def wrapped(request: Request) -> Response:
            try:
                response: Response = await handler(request)
                return response
            except _Refused as refusal:
                headers = {"Retry-After": str(refusal.retry_after)} if refusal.retry_after else None
                return _json(
                    {"error": {"code": refusal.code, "message": refusal.message}},
                    refusal.status,
                    headers,
                )

        return wrapped

    async def purge_loop() -> None:
        while True:
            await asyncio.sleep(config.purge_every)
            try:
                now = clock()
                await store.purge(now, int(now // RATE_WINDOW) - 1)
            except Exception:  # the next round tries again; searches filter by expiry anyway
                logger.exception("purging expired records failed")

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        if open_store:
            await store.open()
        task = asyncio.create_task(purge_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if open_store:
                await store.close()

    return Starlette(
        routes=[
            Route("/v1/records", refusing(publish), methods=["POST"]),
            Route("/v1/listings", refusing(search), methods=["GET"]),
            Route("/v1/addresses/{node_id}", refusing(addresses), methods=["GET"]),
            Route("/v1/health", refusing(health), methods=["GET"]),
        ],
        lifespan=lifespan,
    )
