"""What one HTTP client may cost a server: connections, time and body bytes.

uvicorn reads a request's head with no deadline of its own (every byte resets
its keep-alive timer), has no bound on the head's size with httptools, and
applies ``limit_concurrency`` only once a head is complete: a client that
opens connections and sends nothing, or a byte now and then, holds a
descriptor each for as long as it likes. This module is the one guard that
the three HTTP servers (the node process's control API, which
``gpumesh-control`` is, and ``gpumesh-registry``) put in front of uvicorn:

* :class:`ConnectionTable` (no I/O, clock injected) decides: caps on open
  connections per client address and in total; to make room, the oldest
  connection still waiting for its request is closed first (a busy one, an
  event stream, never); and a deadline for a complete request, head and body,
  from the moment a connection waits for one;
* :func:`http_protocol` makes the uvicorn protocol class that asks the table
  at every connection, closes what it says to close, and wraps the app so each
  route's body is bounded (413 beyond, without reading the rest);
* :func:`raise_descriptor_limit` lifts the soft ``RLIMIT_NOFILE`` to the hard
  one, and :meth:`Limits.fitted` keeps descriptors in reserve for the rest of
  the process (peers' links, files, the database).

Every refusal is one line that names the limit and its number. This module
never imports a server's app: each server hands it its limits.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, ClassVar, cast

import msgspec
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from gpumesh.errors import ConfigError, LimitError
from gpumesh.settings import (
    ENV_HTTP_CONNECTIONS,
    ENV_HTTP_DEADLINE,
    ENV_HTTP_PER_CLIENT,
    env,
)

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "KIB",
    "MIB",
    "UNIX_PEER",
    "Admitted",
    "ConnectionTable",
    "Eviction",
    "Guard",
    "Limits",
    "Refused",
    "http_protocol",
    "raise_descriptor_limit",
]

logger = logging.getLogger(__name__)

KIB = 1024
MIB = 1024 * KIB
UNIX_PEER = "the unix socket"
"""The key of every unix-socket connection: its peers passed the socket's file
mode (the owner's), so only the total cap applies to them."""


def _names_a_client(key: str) -> bool:
    """Whether ``key`` tells one client from another. A loopback address does not:
    every local user may use any of 127.0.0.0/8, and a cap per address would only
    let one of them crowd the owner's own connections out. Loopback peers share
    the total cap; the owner's way in that nobody else has is the unix socket."""
    if key == UNIX_PEER:
        return False
    try:
        address = ipaddress.ip_address(key)
    except ValueError:
        return True
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not address.is_loopback


@dataclass(frozen=True)
class Limits:
    """How much one server lets its clients hold. Durations are settings, so tests
    shorten them to seconds."""

    connections: int = 1024
    """Open connections in all, every listener of the process together."""
    per_client: int = 64
    """Open connections from one client address (not a loopback one: those share
    the total)."""
    deadline: float = 10.0
    """Seconds from the moment a connection waits for a request (it opened, or
    its last response ended) until that request's head and body are in."""
    head: int = 1 * MIB
    """Bytes a connection may send before its request's head is complete (the
    head and whatever part of the body comes with it)."""
    body: int = 1 * MIB
    """Bytes of a request body on a route that ``bodies`` does not name."""
    bodies: Mapping[str, int] = field(default_factory=dict)
    """Bytes of the body of the routes named ``"METHOD /path"``."""
    reserve: int = 256
    """Descriptors kept free of client connections for the rest of the process."""
    exempt: frozenset[str] = frozenset()
    """Addresses without a per-address cap (trusted proxies carry many clients)."""

    @classmethod
    def from_env(cls, **given: Any) -> Limits:
        """``given`` over the defaults, and ``$GPUMESH_HTTP_*`` over both."""
        found = {
            "deadline": _number(ENV_HTTP_DEADLINE, float),
            "connections": _number(ENV_HTTP_CONNECTIONS, int),
            "per_client": _number(ENV_HTTP_PER_CLIENT, int),
        }
        return replace(cls(**given), **{k: v for k, v in found.items() if v is not None})

    def body_limit(self, method: str, path: str) -> int:
        return self.bodies.get(f"{method} {path}", self.body)

    def fitted(self, descriptors: int) -> Limits:
        """These limits with the total cap lowered so that ``descriptors`` (the
        process's soft limit) keep :attr:`reserve` free, or half of them when
        they are few."""
        room = max(1, descriptors - min(self.reserve, descriptors // 2))
        return replace(self, connections=min(self.connections, room))


def _number(name: str, kind: type[float] | type[int]) -> Any:
    """``$name`` as a positive ``kind``, or None when unset."""
    text = env(name)
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: give a number, such as 10") from None
    if value <= 0:
        raise ConfigError(f"{name} must be more than 0")
    return value


def raise_descriptor_limit() -> int:
    """Lift this process's soft ``RLIMIT_NOFILE`` to its hard limit; the soft limit
    now (a large number where the system has no such limit)."""
    try:
        # Linux's; Windows has no such limit (and the node process runs there too).
        import resource
    except ImportError:
        return 1 << 20

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard not in (resource.RLIM_INFINITY, soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            logger.warning("cannot raise the descriptor limit from %s to %s", soft, hard)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


# --- the rules (no I/O) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Refused:
    """A connection (or its request) turned away: an HTTP status and one line."""

    status: int
    message: str


@dataclass(frozen=True)
class Eviction:
    """An open connection to close to make room, and the line it is told."""

    conn: int
    refusal: Refused


@dataclass(frozen=True)
class Admitted:
    conn: int
    evict: tuple[Eviction, ...] = ()


@dataclass
class _Conn:
    key: str
    waiting_since: float | None
    """When it began to wait for a request; None while the app has one."""
    headed: bool = False
    """The head of the request it waits for is in (only its body may still come)."""


class ConnectionTable:
    """The open connections of one process's HTTP servers and what they may hold.

    A connection is *waiting* from the moment it opens (or its last response
    ends) until its request's head and body are in; then it is *busy* until
    the app is done with it. Only waiting connections are closed for the
    deadline, and only those whose head is not in yet to make room: a client
    that sends its request at once is safe from the moment its head arrives,
    however fast another at its address opens connections."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._conns: dict[int, _Conn] = {}
        self._per_key: Counter[str] = Counter()
        self._next = 0

    def __len__(self) -> int:
        return len(self._conns)

    def count(self, key: str) -> int:
        return self._per_key[key]

    def open(self, key: str) -> Admitted | Refused:
        """A new connection from ``key`` (an address, or :data:`UNIX_PEER`)."""
        limits = self.limits
        evict: list[Eviction] = []
        capped = key not in limits.exempt and _names_a_client(key)
        if capped and self._per_key[key] >= limits.per_client:
            victim = self._oldest_waiting(key)
            if victim is None:
                return Refused(
                    429,
                    f"{self._per_key[key]} connections from {key} are busy and the limit per "
                    f"address is {limits.per_client}: close some, then retry",
                )
            why = f"{key} holds {limits.per_client} connections, the limit per address"
            evict.append(self._evict(victim, why))
        if len(self._conns) >= limits.connections:
            victim = self._oldest_waiting(self._most_waiting())
            if victim is None:
                return Refused(
                    503,
                    f"this server holds {len(self._conns)} busy connections, its limit is "
                    f"{limits.connections}: retry in a moment",
                )
            why = f"this server holds {limits.connections} connections, its limit"
            evict.append(self._evict(victim, why))
        conn = self._next
        self._next += 1
        self._conns[conn] = _Conn(key, self._clock())
        self._per_key[key] += 1
        return Admitted(conn, tuple(evict))

    def _evict(self, victim: int, why: str) -> Eviction:
        """Close ``victim`` to make room; what it is told."""
        self.close(victim)
        message = f"closed to make room: {why}, and this one waited longest for its request"
        return Eviction(victim, Refused(503, message))

    def headed(self, conn: int) -> None:
        """``conn``'s request head is in: it is no longer closed to make room."""
        if conn in self._conns:
            self._conns[conn].headed = True

    def busy(self, conn: int) -> None:
        """``conn``'s request is in: no deadline while the app answers it."""
        if conn in self._conns:
            self._conns[conn].waiting_since = None

    def waiting(self, conn: int) -> None:
        """``conn`` was answered and waits for its next request: the deadline runs."""
        if conn in self._conns:
            self._conns[conn].waiting_since = self._clock()
            self._conns[conn].headed = False

    def close(self, conn: int) -> None:
        found = self._conns.pop(conn, None)
        if found is not None:
            self._per_key[found.key] -= 1
            if not self._per_key[found.key]:
                del self._per_key[found.key]

    def left(self, conn: int) -> float | None:
        """Seconds until ``conn``'s deadline (0 or less: past it); None when busy or gone."""
        found = self._conns.get(conn)
        if found is None or found.waiting_since is None:
            return None
        return found.waiting_since + self.limits.deadline - self._clock()

    def overdue(self, conn: int) -> Refused | None:
        """The refusal ``conn`` gets when it is past its deadline, else None."""
        left = self.left(conn)
        if left is None or left > 0:
            return None
        return Refused(
            408,
            f"the request was not complete within {self.limits.deadline:g} s, the request "
            "deadline: send the whole request at once",
        )

    def _oldest_waiting(self, key: str | None) -> int | None:
        since = {
            conn: found.waiting_since
            for conn, found in self._conns.items()
            if found.waiting_since is not None and not found.headed and key in (None, found.key)
        }
        return min(since, key=since.__getitem__, default=None)

    def _most_waiting(self) -> str | None:
        """The key holding the most waiting connections: room is made at its cost
        rather than at another client's."""
        waiting = Counter(
            c.key for c in self._conns.values() if c.waiting_since is not None and not c.headed
        )
        return waiting.most_common(1)[0][0] if waiting else None


# --- the uvicorn adapter --------------------------------------------------------------------


def _response(refusal: Refused) -> bytes:
    """A whole HTTP/1.1 response that closes the connection."""
    body = msgspec.json.encode({"code": LimitError.code, "message": refusal.message})
    head = (
        f"HTTP/1.1 {refusal.status} {HTTPStatus(refusal.status).phrase}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class Guard:
    """One process's :class:`ConnectionTable` and the connections it admitted."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = ConnectionTable(limits, clock)
        self.live: dict[int, _GuardedProtocol] = {}


def http_protocol(guard: Guard) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: uvicorn's own, behind
    ``guard``. Several servers of one process given one guard share its caps."""
    return type("GuardedProtocol", (_GuardedProtocol,), {"guard": guard})


class _GuardedProtocol(asyncio.Protocol):
    """uvicorn's protocol for one connection, admitted, timed and bounded."""

    guard: ClassVar[Guard]

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        # Any: uvicorn names its protocol classes only as asyncio.Protocol.
        protocol: Any = AutoHTTPProtocol
        self._inner: Any = protocol(
            config=config, server_state=server_state, app_state=app_state, _loop=_loop
        )
        self._loop = _loop or asyncio.get_event_loop()
        self._app: ASGIApp = self._inner.app
        # The app uvicorn calls for each request of this connection is ours.
        self._inner.app = self._request
        self._conn: int | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._unparsed = 0
        """Bytes received since the connection began to wait for a request's head."""
        self._in_app = False
        self._responding = False
        self._ended: str | None = None
        """Why the guard closed this connection, once it did."""

    # asyncio.Protocol, handed to uvicorn's protocol once admitted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not isinstance: uvloop's transports do not derive from asyncio's.
        self._transport = cast("asyncio.Transport", transport)
        peer = transport.get_extra_info("peername")
        key = str(peer[0]) if isinstance(peer, tuple) and peer else UNIX_PEER
        verdict = self.guard.table.open(key)
        if isinstance(verdict, Refused):
            logger.info("HTTP connection from %s refused: %s", key, verdict.message)
            self._transport.write(_response(verdict))
            self._transport.close()
            return
        for eviction in verdict.evict:
            evicted = self.guard.live.pop(eviction.conn, None)
            if evicted is not None:
                evicted._end(eviction.refusal)
        self._conn = verdict.conn
        self.guard.live[verdict.conn] = self
        self._inner.connection_made(self._transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is None:
            return
        self.guard.table.close(self._conn)
        self.guard.live.pop(self._conn, None)
        if self._timer is not None:
            self._timer.cancel()
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_app and self._ended is None:
            self._unparsed += len(data)
            limit = self.guard.table.limits.head
            if self._unparsed > limit:
                self._end(
                    Refused(431, f"the request head is over {limit} bytes, the limit"),
                )
                return
        cycle = self._inner.cycle
        self._inner.data_received(data)
        # uvicorn makes a request's cycle as soon as its head is parsed, in this call.
        if self._inner.cycle is not cycle and self._conn is not None:
            self.guard.table.headed(self._conn)

    def eof_received(self) -> bool | None:
        result: bool | None = self._inner.eof_received()
        return result

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # the deadline

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        left = None if self._conn is None else self.guard.table.left(self._conn)
        if left is not None:
            self._timer = self._loop.call_later(max(0.0, left), self._check)

    def _check(self) -> None:
        self._timer = None
        if self._conn is None:
            return
        refusal = self.guard.table.overdue(self._conn)
        if refusal is not None:
            logger.info("HTTP connection closed: %s", refusal.message)
            self._end(refusal)
        else:
            self._arm()

    def _end(self, refusal: Refused) -> None:
        """Tell the client why (unless a response is under way) and close."""
        if self._ended is not None or self._transport is None:
            return
        self._ended = refusal.message
        if self._conn is not None:
            self.guard.table.close(self._conn)
            self.guard.live.pop(self._conn, None)
        if not self._transport.is_closing():
            if not self._responding:
                self._transport.write(_response(refusal))
            self._transport.close()

    def _busy(self) -> None:
        if self._conn is not None:
            self.guard.table.busy(self._conn)
        self._arm()

    # the app, for each request

    async def _request(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        self._in_app = True
        self._unparsed = 0
        limit = self.guard.table.limits.body_limit(scope["method"], scope["path"])
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        got = 0

        async def refuse(refusal: Refused) -> None:
            """A 413 in place of the app's answer; the connection then closes."""
            self._ended = refusal.message
            if not self._responding:
                body = _response(refusal).partition(b"\r\n\r\n")[2]
                await send(
                    {
                        "type": "http.response.start",
                        "status": refusal.status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body, "more_body": False})
            elif self._transport is not None:
                self._transport.close()

        def too_large() -> Refused:
            return Refused(413, f"the request body is over {limit} bytes, this route's limit")

        async def bounded_receive() -> Message:
            nonlocal got
            message = await receive()
            if self._ended is not None:
                raise LimitError(self._ended)
            if message["type"] == "http.request":
                got += len(message.get("body", b""))
                if got > limit:
                    await refuse(too_large())
                    raise LimitError(too_large().message)
                if not message.get("more_body", False):
                    self._busy()
            return message

        async def guarded_send(message: Message) -> None:
            if self._ended is not None:
                return  # the guard answered this request itself
            if message["type"] == "http.response.start":
                self._responding = True
            await send(message)

        try:
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                self._busy()
                await refuse(too_large())
                return
            if not chunked and not (declared and int(declared)):
                self._busy()  # no body: the head was the whole request
            await self._app(scope, bounded_receive, guarded_send)
        except Exception:
            if self._ended is None:
                raise
            # The guard closed the connection under the app: its error is that.
        finally:
            self._in_app = False
            self._responding = False
            if self._ended is None and self._conn is not None:
                self.guard.table.waiting(self._conn)
                self._arm()
