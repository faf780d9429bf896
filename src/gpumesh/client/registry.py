"""Talking to a public registry (``gpumesh-registry``): publish, search, look up.

Everything a registry returns is checked here, never trusted: each listing's
signature is verified against the key inside it (a registry that forges or
edits one is caught and named), and an address record is accepted only when
it is signed by the key this node pinned when it paired with that peer.

A listing grants nothing: it is metadata for people to find each other, who
then pair as usual before anything runs.

HTTP is the standard library's (``urllib``), run in a thread from async code:
a few small requests a minute need no client library. Every failure ends as
one of the project's errors naming the registry: unreachable, refused (with
the registry's reason: rate limit, stale record), or an answer that does not
verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from gpumesh.errors import ConfigError, ProtocolError, RegistryError, UnreachableError
from gpumesh.identity.keys import Identity, NodeId
from gpumesh.protocol.listing import (
    AddressRecord,
    GpuListing,
    Listing,
    Record,
    SignedRecord,
    Withdrawal,
    open_record,
    sign_record,
)

__all__ = [
    "FoundListing",
    "RegistryClient",
    "SearchFilters",
    "SearchPage",
    "SequenceClock",
    "registry_url",
]

logger = logging.getLogger(__name__)

_MAX_REPLY = 4 << 20
NO_REGISTRY = (
    "no registry is configured: set one with "
    "`gpumesh config set rendezvous_url http://HOST:47080` (a gpumesh-registry)"
)


def registry_url(configured: str) -> str:
    """The configured ``rendezvous_url``, or a :class:`ConfigError` saying how to set one."""
    if not configured:
        raise ConfigError(NO_REGISTRY)
    return configured.rstrip("/")


class SequenceClock:
    """Sequence numbers for one node's records: microseconds, strictly increasing.

    Time-based so that separate processes of one node (``share``, ``sync``)
    need no shared counter; a clock that steps back still yields a higher
    number than this process's last one.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._last = 0

    def next(self) -> tuple[int, float]:
        now = self.clock()
        seq = max(int(now * 1_000_000), self._last + 1)
        self._last = seq
        return seq, now


@dataclass(frozen=True)
class SearchFilters:
    gpu: str = ""
    vram: int = 0
    vram_total: bool = False
    idle: bool = False
    region: str = ""
    limit: int = 20
    cursor: str = ""


@dataclass(frozen=True)
class FoundListing:
    """A listing whose signature this node checked itself."""

    listing: Listing

    @property
    def node_id(self) -> NodeId:
        return self.listing.node_id


@dataclass(frozen=True)
class SearchPage:
    listings: list[FoundListing]
    next: str
    """Pass as ``cursor`` for the next page; empty on the last one."""


class RegistryClient:
    """One registry, by its base URL; blocking calls, with ``a``-prefixed async twins."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    # --- publishing ---------------------------------------------------------------

    def publish(self, identity: Identity, record: Record) -> float:
        """Sign and publish ``record``; the seconds it lives without a refresh."""
        signed = sign_record(identity, record)
        reply = self._request("POST", "/v1/records", msgspec.json.encode(signed))
        return float(reply.get("expires_in", 0))

    async def apublish(self, identity: Identity, record: Record) -> float:
        return await asyncio.to_thread(self.publish, identity, record)

    # --- reading ------------------------------------------------------------------

    def search(self, filters: SearchFilters) -> SearchPage:
        """One page of listings matching ``filters``, each signature checked here."""
        params: dict[str, str] = {"limit": str(filters.limit)}
        if filters.gpu:
            params["gpu"] = filters.gpu
        if filters.vram:
            params["vram"] = str(filters.vram)
            params["vram_of"] = "total" if filters.vram_total else "free"
        if filters.idle:
            params["idle"] = "1"
        if filters.region:
            params["region"] = filters.region
        if filters.cursor:
            params["cursor"] = filters.cursor
        reply = self._request("GET", "/v1/listings?" + urllib.parse.urlencode(params))
        try:
            page = msgspec.convert(reply, _PageReply)
        except msgspec.ValidationError as exc:
            raise self._garbled(f"its search reply is malformed ({exc})") from None
        found: list[FoundListing] = []
        for signed in page.listings:
            record = self._open(signed)
            if not isinstance(record, Listing):
                raise self._forged(f"it returned a {type(record).__name__} as a listing")
            _check_matches(record, filters, self._forged)
            found.append(FoundListing(record))
        return SearchPage(found, page.next)

    def lookup_addresses(self, node_id: str, pinned_key: bytes) -> AddressRecord | None:
        """The address record of the peer ``node_id``, signed by ``pinned_key``; None if none."""
        path = "/v1/addresses/" + urllib.parse.quote(node_id, safe="")
        reply = self._call("GET", path, None, missing_ok=True)
        if reply is None:
            return None
        try:
            signed = msgspec.convert(reply, SignedRecord)
        except msgspec.ValidationError as exc:
            raise self._garbled(f"its address record is malformed ({exc})") from None
        record = self._open(signed)
        if not isinstance(record, AddressRecord):
            raise self._forged(f"it returned a {type(record).__name__} as an address record")
        if record.public_key != pinned_key:
            raise self._forged(
                f"the address record it returned for {node_id} is signed by another key "
                f"(node {record.node_id}), not the one paired with"
            )
        return record

    async def alookup_addresses(self, node_id: str, pinned_key: bytes) -> AddressRecord | None:
        return await asyncio.to_thread(self.lookup_addresses, node_id, pinned_key)

    # --- plumbing -----------------------------------------------------------------

    def _open(self, signed: SignedRecord) -> Record:
        try:
            return open_record(signed)
        except ProtocolError as exc:
            raise self._forged(exc.message) from None

    def _forged(self, why: str) -> RegistryError:
        return RegistryError(
            f"the registry at {self.url} sent a record that does not verify: {why}; "
            "do not trust this registry's results"
        )

    def _garbled(self, why: str) -> RegistryError:
        return RegistryError(
            f"{self.url} does not answer like a gpumesh-registry: {why}; check rendezvous_url"
        )

    def _request(self, method: str, path: str, body: bytes | None = None) -> dict[str, Any]:
        reply = self._call(method, path, body, missing_ok=False)
        assert reply is not None
        return reply

    def _call(
        self, method: str, path: str, body: bytes | None, *, missing_ok: bool
    ) -> dict[str, Any] | None:
        request = urllib.request.Request(
            self.url + path,
            data=body,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read(_MAX_REPLY + 1)
        except urllib.error.HTTPError as exc:
            if missing_ok and exc.code == 404:
                return None
            raise self._refusal(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UnreachableError(
                f"the registry at {self.url} is unreachable ({reason}); check rendezvous_url "
                "(`gpumesh config get rendezvous_url`) and that gpumesh-registry runs there"
            ) from None
        if len(raw) > _MAX_REPLY:
            raise self._garbled("its reply is over 4MiB")
        try:
            data = json.loads(raw)
        except ValueError:
            raise self._garbled("its reply is not JSON") from None
        if not isinstance(data, dict):
            raise self._garbled("its reply is not a JSON object")
        return data

    def _refusal(self, exc: urllib.error.HTTPError) -> RegistryError:
        message = ""
        with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
            data = json.loads(exc.read(65536))
            message = str(data["error"]["message"])[:300]
        if message:
            return RegistryError(f"the registry at {self.url} refused: {message}")
        return self._garbled(f"it answered HTTP {exc.code} {exc.reason}")


class _PageReply(msgspec.Struct):
    listings: list[SignedRecord]
    next: str = ""


def _check_matches(
    listing: Listing, filters: SearchFilters, forged: Callable[[str], RegistryError]
) -> None:
    """A registry may hide listings, but one it returns must match what was asked."""

    def gpu_fits(gpu: GpuListing) -> bool:
        memory = gpu.memory_total if filters.vram_total else gpu.memory_free
        return filters.gpu.lower() in gpu.name.lower() and memory >= filters.vram

    wrong = (
        (filters.idle and not listing.idle)
        or (filters.region and listing.region.lower() != filters.region.lower())
        or ((filters.gpu or filters.vram) and not any(gpu_fits(g) for g in listing.gpus))
    )
    if wrong:
        raise forged(f"listing of {listing.node_id} does not match the search")


def listing_of(
    identity: Identity,
    seq: tuple[int, float],
    *,
    name: str,
    gpus: list[GpuListing],
    idle: bool,
    region: str,
    contact: str,
    version: str,
    addresses: list[str] | None = None,
) -> Listing:
    """A listing of this node (``seq`` from :meth:`SequenceClock.next`)."""
    return Listing(
        public_key=identity.public_key,
        seq=seq[0],
        timestamp=seq[1],
        name=name,
        gpus=gpus,
        idle=idle,
        region=region,
        contact=contact,
        version=version,
        addresses=addresses or [],
    )


def withdrawal_of(identity: Identity, seq: tuple[int, float]) -> Withdrawal:
    return Withdrawal(public_key=identity.public_key, seq=seq[0], timestamp=seq[1])


def address_record_of(
    identity: Identity, seq: tuple[int, float], addresses: list[str], relay: str
) -> AddressRecord:
    return AddressRecord(
        public_key=identity.public_key,
        seq=seq[0],
        timestamp=seq[1],
        addresses=addresses[:16],
        relay=relay,
    )
