"""Warm sessions: authenticated sessions to recently used peers, kept open between
requests by a long-running process (the node process) so that the next command
to the same peer skips the dial, the TLS handshake and the identity proof.

A session is lent to any number of requests at once (QUIC carries each on its
own stream). :meth:`SessionPool.maintain` keeps them honest: it pings each one
every :data:`KEEPALIVE` seconds (a dead one is dropped and the next request
dials again), closes one unused for :data:`IDLE` seconds, and closes at once
the sessions of a peer that was denied, unpaired or whose key changed (read
from the store, so a `gpumesh deny` in another process counts too). Time is
injected (``clock``) so expiry is decided without sleeping.

A session that hole punching moved off the relay leaves its punched address
behind when it ends (:meth:`SessionPool.punched`): the next dial to that peer
tries it first, directly from the same shared socket, whose NAT mapping the
peer's NAT still lets in for a while, and so reaches a restarted or
reconnecting peer in one round trip rather than through the relay and a new
round of punching. A deny, unpair or key change forgets it with the session.

The pool also remembers which peers its last session reached through the relay
(punched or not) (:meth:`SessionPool.relay_first`): their direct addresses did
not answer then, so the next dial starts the relay at once rather than after
:data:`~gpumesh.transport.session.RELAY_DELAY`, with no direct attempt from the
shared socket (punching still finds a direct path). A session that
comes up direct, or a deny, unpair or key change, forgets it.

A warm session can die under a request: its peer was killed and started again
within :data:`PROBE_AFTER` seconds of the last answer (so it was lent without a
ping), or it closed the link. :meth:`SessionPool.lend_for` runs a command's
first request, one that is safe to send twice (a job query, a cancel, a
``JobSubmit``, whose consumer-chosen job id makes the provider accept a
resubmission without starting a second copy), and sends it once more on a
session dialled afresh when a session lent again closed under it or went
:data:`PROBE_TIMEOUT` seconds without an answer while a ping went unanswered too.

Peers heard on the LAN (:mod:`gpumesh.client.lan`) leave their announced address
here (:meth:`SessionPool.note_lan`): the next dial tries it first, and a direct
session to it has the path ``lan``. A session that LAN discovery dialled replaces
the warm one to that peer (:meth:`SessionPool.adopt`): a relayed one closes as soon
as no request uses it.

Every dial of a pool goes out from one shared socket (``outgoing``): one UDP port
and one relay registration per relay for all its links (see
:mod:`gpumesh.transport.outgoing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from gpumesh.errors import ConnectionLostError, GPUMeshError
from gpumesh.protocol.messages import Ping

if TYPE_CHECKING:
    from gpumesh.protocol.addresses import Address
    from gpumesh.store.db import Store
    from gpumesh.store.peers import Peer
    from gpumesh.transport.outgoing import OutgoingSocket
    from gpumesh.transport.session import Session

__all__ = ["IDLE", "KEEPALIVE", "PUNCHED_KEEP", "SessionPool", "Warm"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE = 300.0
"""Seconds a warm session stays open without a request."""
KEEPALIVE = 15.0
"""Seconds between keep-alive pings of a warm session."""
CHECK = 0.25
"""Seconds between looks at the store (deny, unpair, key change) and the clocks."""
PUNCHED_KEEP = 25.0
"""Seconds after its session ended that a punched address is still dialled first:
under the 30 s that Linux's conntrack and many home routers keep an idle UDP
mapping open."""
PROBE_AFTER = 5.0
"""Seconds without an answer on a warm session after which it is pinged before it is
lent: a peer that was killed and restarted never closed it, and its new process
drops the old connection's packets without a word, so a request on it would hang
until the keep-alive gave up."""
PROBE_TIMEOUT = 2.0
"""Seconds that ping may take; past them the session is dropped and dialled again."""
LAN_KEEP = 300.0
"""Seconds an address a peer announced on the LAN is dialled first."""


@dataclass
class Warm:
    """One warm session and what decides its life."""

    peer_id: str
    peer_name: str
    public_key: bytes
    session: Session
    last_used: float
    last_ping: float
    last_ok: float = 0.0
    """When a request or keep-alive on it last got its answer."""
    users: int = 0
    uses: int = 0
    connect_ms: float | None = None
    """Milliseconds its dial took, up to the peer's Welcome (dial, TLS, identity
    proof); None until the Welcome came."""


class SessionPool:
    """Warm sessions by peer id."""

    def __init__(
        self,
        *,
        idle: float = IDLE,
        keepalive: float = KEEPALIVE,
        clock: Callable[[], float] = time.monotonic,
        outgoing: OutgoingSocket | None = None,
    ) -> None:
        self.idle = idle
        self.outgoing = outgoing
        """The one UDP socket (and relay registrations) every dial of the pool goes out
        from; None: each dial opens its own."""
        self.keepalive = keepalive
        self._clock = clock
        self._warm: dict[str, Warm] = {}
        self._dialling: dict[str, asyncio.Lock] = {}
        self._punched: dict[str, tuple[Address, float]] = {}
        """By peer id: the punched address of its last session, and when that session
        was last seen open."""
        self._through_relay: set[str] = set()
        """Peer ids whose last session was set up through the relay."""
        self._lan: dict[str, tuple[Address, float]] = {}
        """By peer id: the address it last announced on the LAN, and when."""
        self._retired: list[Warm] = []
        """Sessions a LAN session replaced, closed once no request uses them."""
        self.on_silent: Callable[[str, str], None] | None = None
        """Told (peer id, why) of a peer whose warm session stopped answering its
        keep-alive: a job listing then does not wait on it (see
        :class:`~gpumesh.client.jobrefresh.SilentProviders`)."""

    def relay_first(self, peer_id: str) -> bool:
        """Whether the last session to ``peer_id`` was set up through the relay (its
        direct addresses did not answer): the next dial tries the relay at once."""
        return peer_id in self._through_relay

    def punched(self, peer_id: str) -> Address | None:
        """The hole-punched address the last session to ``peer_id`` used, if that
        session was open less than :data:`PUNCHED_KEEP` seconds ago."""
        warm = self._warm.get(peer_id)
        if warm is not None:
            self._note_punched(warm)
        found = self._punched.get(peer_id)
        if found is None or self._clock() - found[1] > PUNCHED_KEEP:
            return None
        return found[0]

    def _note_punched(self, warm: Warm) -> None:
        address = warm.session.punched_address
        if address is not None and not warm.session.link.is_closed:
            self._punched[warm.peer_id] = (address, self._clock())

    def note_lan(self, peer_id: str, address: Address) -> None:
        """``peer_id`` announced ``address`` on the LAN (authenticated by a dial only)."""
        self._lan[peer_id] = (address, self._clock())

    def lan_address(self, peer_id: str) -> Address | None:
        """The address ``peer_id`` announced on the LAN in the last :data:`LAN_KEEP`
        seconds, if any."""
        found = self._lan.get(peer_id)
        if found is None or self._clock() - found[1] > LAN_KEEP:
            return None
        return found[0]

    def current(self, peer_id: str) -> Warm | None:
        """The open warm session to ``peer_id``, if any."""
        warm = self._warm.get(peer_id)
        return None if warm is None or warm.session.link.is_closed else warm

    async def adopt(self, peer: Peer, session: Session) -> None:
        """Make ``session`` (authenticated, dialled by LAN discovery) the warm session
        to ``peer``; the one it replaces closes once no request uses it."""
        key = str(peer.node_id)
        async with self._dialling.setdefault(key, asyncio.Lock()):
            now = self._clock()
            old = self._warm.get(key)
            self._warm[key] = Warm(key, peer.name, peer.public_key, session, now, now, now)
            self._punched.pop(key, None)
            self._through_relay.discard(key)
            if old is not None:
                logger.info("warm session to %s replaced by one on the LAN", peer.name)
                self._retired.append(old)
                self._close_retired()

    def _close_retired(self) -> None:
        for warm in list(self._retired):
            if warm.users == 0 or warm.session.link.is_closed:
                self._retired.remove(warm)
                warm.session.close()

    def sessions(self) -> list[Warm]:
        return [w for w in self._warm.values() if not w.session.link.is_closed]

    def warm(self, peer_id: str, session: Session) -> Warm | None:
        """The warm session ``session`` to ``peer_id`` as the pool keeps it (None once
        it was dropped)."""
        warm = self._warm.get(peer_id)
        return warm if warm is not None and warm.session is session else None

    @contextlib.asynccontextmanager
    async def lend(
        self, peer: Peer, dial: Callable[[], Awaitable[Session]]
    ) -> AsyncIterator[Session]:
        """The warm session to ``peer``, dialled (with ``dial``) when there is none,
        it died, or the peer's key is not the one it was opened with."""
        key = str(peer.node_id)
        lock = self._dialling.setdefault(key, asyncio.Lock())
        async with lock:
            warm = self._warm.get(key)
            if warm is not None and (
                warm.session.link.is_closed or warm.public_key != peer.public_key
            ):
                self.drop(key, "closed or rekeyed", forget_path=warm.public_key != peer.public_key)
                warm = None
            if warm is not None and not await self._answers(warm):
                self.drop(key, f"no answer within {PROBE_TIMEOUT:g} s (the peer restarted?)")
                warm = None
            if warm is None:
                dialled = time.perf_counter()
                session = await dial()
                now = self._clock()
                warm = Warm(key, peer.name, peer.public_key, session, now, now, now)
                self._warm[key] = warm
                _time_welcome(warm, dialled)
                # What this session punches (now or later) replaces what the last found.
                self._punched.pop(key, None)
                if session.through_relay:
                    self._through_relay.add(key)
                else:
                    self._through_relay.discard(key)
                self._note_punched(warm)
        warm.users += 1
        warm.uses += 1
        try:
            yield warm.session
            warm.last_ok = self._clock()
        except ConnectionLostError:
            # The peer closed the session under this request (a deny's close may
            # cross the request on the wire): say why it closed, as a fresh dial
            # would have been told, rather than that it closed.
            reason = await warm.session.refusal()
            if reason is not None:
                raise reason from None
            raise
        finally:
            warm.users -= 1
            warm.last_used = self._clock()

    @contextlib.asynccontextmanager
    async def lend_for(
        self,
        peer: Peer,
        dial: Callable[[], Awaitable[Session]],
        first: Callable[[Session], Awaitable[T]],
    ) -> AsyncIterator[tuple[Session, T]]:
        """:meth:`lend`, with ``first`` (a request safe to send twice) run on the
        session before it is yielded with its result. When the session was lent
        before and dies under ``first`` (it closed, or ``first`` and a ping both
        went unanswered for :data:`PROBE_TIMEOUT` seconds), it is dropped and
        ``first`` sent once more on a session dialled afresh."""
        key = str(peer.node_id)
        async with contextlib.AsyncExitStack() as lent:
            session = await lent.enter_async_context(self.lend(peer, dial))
            warm = self._warm.get(key)
            if warm is None or warm.session is not session or warm.uses < 2:
                yield session, await first(session)  # dialled for it: nothing to retry
                return
            try:
                result = await self._watched(session, first)
            except ConnectionLostError as exc:
                reason = await session.refusal() if session.link.is_closed else None
                if reason is not None:
                    raise reason from None  # refused (denied, unpaired): no second try
                if self._warm.get(key) is warm:
                    self.drop(key, f"it died under a request ({exc.message})")
                await lent.aclose()
                logger.info("sending a request to %s again on a new session", peer.name)
                session = await lent.enter_async_context(self.lend(peer, dial))
                result = await first(session)
            yield session, result

    async def _watched(self, session: Session, first: Callable[[Session], Awaitable[T]]) -> T:
        """``first(session)``; should it take :data:`PROBE_TIMEOUT` seconds, a ping
        checks the peer still answers (``ConnectionLostError`` when it does not)."""
        work = asyncio.ensure_future(first(session))
        try:
            done, _ = await asyncio.wait([work], timeout=PROBE_TIMEOUT)
            if not done:
                try:
                    await session.request(Ping(sent=time.perf_counter()), timeout=PROBE_TIMEOUT)
                except ConnectionLostError:
                    if not work.done():
                        raise
            return await work
        finally:
            work.cancel()

    async def _answers(self, warm: Warm) -> bool:
        """Whether a warm session silent for :data:`PROBE_AFTER` seconds still answers."""
        if self._clock() - warm.last_ok < PROBE_AFTER:
            return True
        try:
            await warm.session.request(Ping(sent=time.perf_counter()), timeout=PROBE_TIMEOUT)
        except GPUMeshError:
            return False
        warm.last_ok = self._clock()
        return True

    def drop(self, peer_id: str, reason: str, *, forget_path: bool = False) -> None:
        """Close and forget the warm session to ``peer_id`` (if any); keep its punched
        address (and whether it came through the relay) for the next dial unless
        ``forget_path``."""
        warm = self._warm.pop(peer_id, None)
        if forget_path:
            self._punched.pop(peer_id, None)
            self._through_relay.discard(peer_id)
            self._lan.pop(peer_id, None)
        elif warm is not None:
            self._note_punched(warm)  # while its link is still open
        if warm is not None:
            logger.info("warm session to %s closed: %s", warm.peer_name, reason)
            warm.session.close()

    def close(self) -> None:
        for peer_id in list(self._warm):
            self.drop(peer_id, "shutting down")
        for warm in self._retired:
            warm.session.close()
        self._retired.clear()
        if self.outgoing is not None:
            self.outgoing.close()

    def sweep(self, store: Store) -> list[Warm]:
        """Drop what must go now (denied, unpaired, rekeyed, dead, idle); the
        sessions due a keep-alive ping."""
        now = self._clock()
        due: list[Warm] = []
        self._close_retired()
        if not self._warm:
            return due
        # One read of the peers per look, not one per session: a node holding
        # sessions to hundreds of peers looks four times a second.
        peers = {str(peer.node_id): peer for peer in store.peers()}
        for peer_id, warm in list(self._warm.items()):
            peer = peers.get(peer_id)
            if peer is None:
                self.drop(peer_id, "unpaired", forget_path=True)
            elif not peer.allowed:
                self.drop(peer_id, "denied", forget_path=True)
            elif peer.public_key != warm.public_key:
                self.drop(peer_id, "its key changed", forget_path=True)
            elif warm.session.link.is_closed:
                self.drop(peer_id, "the link closed")
            elif warm.users == 0 and now - warm.last_used >= self.idle:
                self.drop(peer_id, f"unused for {self.idle:g} s")
            elif now - warm.last_ping >= self.keepalive:
                warm.last_ping = now
                due.append(warm)
            else:
                self._note_punched(warm)
        return due

    async def maintain(self, store: Store) -> None:
        """Run :meth:`sweep` and the keep-alive pings until cancelled."""
        pings: set[asyncio.Task[None]] = set()
        try:
            while True:
                for warm in self.sweep(store):
                    task = asyncio.ensure_future(self._ping(warm))
                    pings.add(task)
                    task.add_done_callback(pings.discard)
                await asyncio.sleep(CHECK)
        finally:
            for task in pings:
                task.cancel()
            self.close()

    async def _ping(self, warm: Warm) -> None:
        try:
            await warm.session.request(Ping(sent=time.perf_counter()), timeout=self.keepalive)
        except GPUMeshError as exc:
            if self._warm.get(warm.peer_id) is warm:
                self.drop(warm.peer_id, f"keep-alive failed: {exc.message}")
                if self.on_silent is not None:
                    self.on_silent(warm.peer_id, f"its keep-alive got no answer ({exc.message})")
        else:
            warm.last_ok = self._clock()


def _time_welcome(warm: Warm, dialled: float) -> None:
    """Set ``warm.connect_ms`` when the peer's Welcome comes (``dialled``: the
    ``perf_counter`` when its dial began)."""

    def welcomed(done: asyncio.Future[None]) -> None:
        if not done.cancelled() and done.exception() is None:
            warm.connect_ms = (time.perf_counter() - dialled) * 1000

    warm.session.read_welcome().add_done_callback(welcomed)
