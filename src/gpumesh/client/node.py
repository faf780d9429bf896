"""One node's operations: init, pairing, the allowlist, and talking to peers.

:class:`Node` is the Python API and what the CLI and the dashboard call.
Remote operations are coroutines; local ones are plain methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from gpumesh.client.discovery import refresh_peer
from gpumesh.client.jobrefresh import SilentProviders
from gpumesh.client.owner import OpenSessions, open_sessions
from gpumesh.client.pool import PROBE_TIMEOUT
from gpumesh.client.registry import RegistryClient
from gpumesh.client.views.peers import PairState
from gpumesh.errors import (
    ConfigError,
    ConnectionLostError,
    GPUMeshError,
    NotPairedError,
    PeerError,
    PeerKeyChangedError,
    RelayError,
    UnreachableError,
)
from gpumesh.gpu.inventory import detect_inventory
from gpumesh.identity.codes import make_code, verify_code
from gpumesh.identity.keys import Identity, NodeId, check_node_name
from gpumesh.protocol.addresses import parse_address
from gpumesh.protocol.messages import (
    Ping,
    Pong,
    StatusReply,
    StatusRequest,
    ThroughputReply,
    ThroughputRequest,
)
from gpumesh.protocol.states import FINAL_STATES, JobRole
from gpumesh.settings import ENV_NODE_NAME, env
from gpumesh.store.home import AgentInfo, Home
from gpumesh.store.peers import Peer
from gpumesh.store.shares import Pause
from gpumesh.store.trust import check_home
from gpumesh.transport.netinfo import local_addresses
from gpumesh.transport.reach import unreachable
from gpumesh.transport.relaytcp import tcp_route
from gpumesh.transport.session import (
    RelayHint,
    open_session,
    went_through_relay,
)

if TYPE_CHECKING:
    from gpumesh.client.moves import JobKeeper
    from gpumesh.client.outputs import OutputsReceivers
    from gpumesh.client.pool import SessionPool
    from gpumesh.gpu.inventory import GpuInfo
    from gpumesh.protocol.addresses import Address
    from gpumesh.store.jobs import JobRecord
    from gpumesh.transport.session import Session

__all__ = [
    "ConnectResult",
    "Node",
    "NodeInfo",
    "NodeStatus",
    "PairCheck",
    "ThroughputResult",
    "default_node_name",
]

PUNCH_WAIT = 3.0
"""Seconds `connect` lets hole punching finish before it reports the path."""
PAIR_CHECK_TIMEOUT = 3.0
"""Seconds ``pair`` spends finding out whether the new peer paired back."""
PEER_RELAYS_RACED = 4
"""Peers that relay for their peers a dial races at most (each one raced is one
registration the node process keeps)."""

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class NodeInfo:
    name: str
    node_id: NodeId
    home: Path


@dataclass(frozen=True)
class NodeStatus:
    name: str
    node_id: NodeId
    home: Path
    agent: AgentInfo | None
    """The running `gpumesh share`, or None."""
    listen: str
    relay: str
    """The relay this node uses (config or $GPUMESH_RELAY), or empty."""
    peers: int
    allowed: int
    gpus: list[GpuInfo]
    gpu_source: str
    """``nvml``, ``nvidia-smi``, ``simulated`` (tests only) or ``none``."""
    running_hosted: int
    """Unfinished jobs this node runs for peers."""
    running_submitted: int
    """Jobs this node submitted that were not seen finishing (and that their
    providers still know)."""
    sessions: OpenSessions
    """The shells, desktops and CUDA sessions the running `gpumesh share` has open."""
    paused: Pause | None = None
    """The owner paused sharing (`gpumesh pause`), until `gpumesh resume`."""
    waiting: list[JobRecord] = field(default_factory=list)
    """Submitted jobs no provider holds now: waiting in the queue, or moving."""


@dataclass(frozen=True)
class PairCheck:
    """Whether a peer just paired with has paired this node too."""

    state: PairState
    detail: str = ""
    """The reason, in the words ``connect`` uses, unless ``ready`` or ``not_paired``."""


@dataclass(frozen=True)
class ConnectResult:
    peer: Peer
    address: str
    """The ``host:port`` that answered."""
    path: str
    """``lan``, ``direct``, ``direct (hole-punched) ADDR`` or ``relayed via RELAY``."""
    rtt_ms: float
    """Median of several authenticated pings, in milliseconds."""
    punch_ms: float | None
    """For a relayed session: milliseconds hole punching took to open a direct path."""
    connect_ms: float
    """Dial + TLS + identity proof, in milliseconds (of the warm session's own dial,
    when ``warm``)."""
    remote: StatusReply
    warm: bool = False
    """The pool lent a session an earlier request had dialled: nothing was dialled
    now, and the round trips were measured on it."""


@dataclass(frozen=True)
class ThroughputResult:
    peer: Peer
    bytes: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds else 0.0


class Node:
    """A GPUMesh node: its home folder and everything it can do."""

    def __init__(self, home: str | Path | Home | None = None) -> None:
        self.home = home if isinstance(home, Home) else Home(home)
        self.home.secure()  # every start re-asserts the home's modes, not only `init`
        self.pool: SessionPool | None = None
        """Warm sessions to reuse (a long-running process's); None: each dials."""
        self.outputs: OutputsReceivers | None = None
        """Receives submitted jobs' outputs (a long-running process's, which resumes
        them when it starts again); None: they wait for one."""
        self.keeper: JobKeeper | None = None
        """Keeps the jobs that may move or wait in the queue (a long-running
        process's, which takes them up again when it starts); None: they wait for one."""

    @functools.cached_property
    def silent_providers(self) -> SilentProviders:
        """The providers that did not say where their jobs stand when last asked
        (a job listing does not wait on them again)."""

        return SilentProviders()

    def close(self) -> None:
        self.home.close()

    # --- identity -------------------------------------------------------------------

    def init(self, name: str | None = None, *, force: bool = False) -> NodeInfo:
        """Create this node's identity and config; refuse to replace one unless forced."""
        name = name or default_node_name()
        check_node_name(name)
        if self.home.initialized and not force:
            info = self.info()
            raise ConfigError(
                f"{self.home.path} already holds node {info.name} ({info.node_id.short}); "
                "re-running init never replaces an identity: use --force to make a new one "
                "(peers will have to pair again)"
            )
        self.home.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_home(self.home.path)  # made just now by someone else, it is refused
        self.home.logs_dir.mkdir(exist_ok=True, mode=0o700)
        Identity.generate().save(self.home.key_path)
        self.home.__dict__.pop("identity", None)
        config = self.home.reload_config()
        config.set("node_name", name)
        config.save()
        _ = self.home.store  # create the database now, not on first use
        self.home.secure()  # a folder that existed before keeps no wider mode
        return self.info()

    def info(self) -> NodeInfo:
        identity = self.home.identity
        return NodeInfo(self.home.config.node_name, identity.node_id, self.home.path)

    def status(self) -> NodeStatus:
        info = self.info()
        config = self.home.config
        peers = self.home.store.peers()
        agent = self.home.agent_info()
        listen = (
            f"{agent.host}:{agent.port}" if agent else f"{config.listen_host}:{config.listen_port}"
        )

        inventory = detect_inventory()
        store = self.home.store
        submitted = [
            j
            for j in store.jobs(limit=1000, role=JobRole.SUBMITTED)
            if j.state not in FINAL_STATES and not j.provider_forgot
        ]
        return NodeStatus(
            name=info.name,
            node_id=info.node_id,
            home=info.home,
            agent=agent,
            listen=listen,
            relay=agent.relay if agent and agent.relay else config.relay,
            peers=len(peers),
            allowed=sum(p.allowed for p in peers),
            gpus=inventory.gpus(),
            gpu_source=inventory.source,
            running_hosted=len(store.unfinished_hosted_jobs()),
            running_submitted=sum(1 for j in submitted if j.peer_id),
            sessions=open_sessions(agent),
            paused=store.paused(),
            waiting=[j for j in submitted if not j.peer_id],
        )

    # --- pairing and the allowlist ------------------------------------------------------

    def advertised_addresses(self) -> list[str]:
        """``host:port`` hints peers should dial, best first."""

        config = self.home.config
        agent = self.home.agent_info()
        # A running agent knows where it really listens (`share --host/--port`).
        host, port = (agent.host, agent.port) if agent else (config.listen_host, config.listen_port)
        return local_addresses(host, port)

    def pairing_code(self, *, clock: Callable[[], float] = time.time) -> str:
        """A signed code for a peer to paste into `gpumesh pair`, valid one hour."""
        config = self.home.config
        return make_code(
            self.home.identity,
            config.node_name,
            self.advertised_addresses(),
            config.relay,
            clock=clock,
        )

    def pair(
        self, code: str, *, rekey: bool = False, clock: Callable[[], float] = time.time
    ) -> Peer:
        """Verify a peer's code, store the peer and allow it, unless it is denied.

        A code pairs once: this node spends its nonce until it expires, and a
        second use raises :class:`PairingCodeError`. Pairing never lifts a
        denial: a denied peer's fresh code refreshes its name, addresses and
        relay (the code is signed by the same key) and the peer stays denied,
        as does a new key that replaces a denied one (``rekey``); the returned
        peer's ``allowed`` says which. Only :meth:`allow` re-allows.
        """
        offer = verify_code(code, clock=clock)
        store = self.home.store
        if offer.public_key == self.home.identity.public_key:
            raise PeerError(
                "that is this node's own pairing code: paste it into `gpumesh pair` on the "
                "other machine, and paste the other machine's code here"
            )
        replaces = None
        same_name = store.peer_by_name(offer.name)
        if same_name is not None and same_name.public_key != offer.public_key:
            if not rekey:
                raise PeerKeyChangedError(
                    f"{offer.name} is already paired with a different key "
                    f"({same_name.node_id.short}, now {offer.node_id.short}); if that machine "
                    "was reinstalled, confirm with `gpumesh pair --rekey '<code>'`"
                )
            replaces = same_name.node_id
        return store.pair_peer(
            offer.public_key,
            offer.name,
            offer.addresses,
            offer.relay,
            nonce=offer.nonce,
            expires=offer.expires,
            replaces=replaces,
            now=clock(),
        )

    def peers(self) -> list[Peer]:
        return self.home.store.peers()

    def peer(self, query: str) -> Peer:
        return self.home.store.find_peer(query)

    def allow(self, query: str) -> Peer:
        peer = self.peer(query)
        self.home.store.set_allowed(peer.node_id, True)
        return self.home.store.peer_by_id(peer.node_id)

    def deny(self, query: str) -> Peer:
        """Revoke a peer's access at once: the running agent closes its open
        connections (its shells, copies and follows) and cancels its jobs."""
        peer = self.peer(query)
        self.home.store.set_allowed(peer.node_id, False)
        self.home.agent_changed()
        return self.home.store.peer_by_id(peer.node_id)

    # --- talking to peers -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def session(
        self, query: str, *, timeout: float | None = None, fresh: bool = False
    ) -> AsyncIterator[Session]:
        """An authenticated session with a paired peer, closed on exit (or lent
        from ``pool``, and left open there, when this node keeps warm sessions,
        unless ``fresh``: then one is dialled now for this alone).

        Requests may start at once: the identity proof leaves with the first of
        them, and the peer's Welcome, or its refusal (raised by every request
        then), comes back with the first reply (``session.established()`` waits
        for it alone). Direct addresses are dialled first; with a relay (the peer's hint from
        pairing, else ours) the relay is tried too, and hole punching moves a
        relayed session to a direct path when the NATs allow it.
        """
        peer = self.peer(query)
        if self.pool is not None and not fresh:
            async with self.pool.lend(peer, lambda: self._dial(peer, timeout)) as warm:
                yield warm
            return
        session = await self._dial(peer, timeout)
        try:
            yield session
        except ConnectionLostError:
            # The peer refused under the first request (a limit's close may cross it
            # on the wire): say why, as the pool does for the sessions it lends.
            reason = await session.refusal()
            if reason is not None:
                raise reason from None
            raise
        finally:
            if session.through_relay:
                # What punching found is worth keeping for the next dial.
                self._remember(peer, session)
            session.close()

    @contextlib.asynccontextmanager
    async def session_for(
        self,
        query: str,
        first: Callable[[Session], Awaitable[T]],
        *,
        timeout: float | None = None,
    ) -> AsyncIterator[tuple[Session, T]]:
        """:meth:`session`, with ``first`` (a request safe to send twice) run on it
        before it is yielded with its result; on a warm session that dies under
        ``first``, it is sent once more on a new one (see
        :meth:`~gpumesh.client.pool.SessionPool.lend_for`)."""
        peer = self.peer(query)
        if self.pool is not None:
            async with self.pool.lend_for(peer, lambda: self._dial(peer, timeout), first) as lent:
                yield lent
            return
        async with self.session(query, timeout=timeout) as session:
            yield session, await first(session)

    @contextlib.asynccontextmanager
    async def live_session(
        self,
        query: str,
        *,
        timeout: float | None = None,
        before: Callable[[Session], None] | None = None,
    ) -> AsyncIterator[Session]:
        """:meth:`session` for what is more than one request safe to send twice (a
        follow, a copy, a sync): a warm session lent again is pinged first, and
        should it have died while it waited (its peer was killed and restarted, or
        closed it), a new one is dialled before anything is sent (see
        :meth:`~gpumesh.client.pool.SessionPool.lend_for`). A session dialled now
        proves itself with its first answer. ``before``: a notice that is safe to
        send twice and waits for no answer, sent ahead of the ping (and again on a
        new session), so the peer starts on it meanwhile."""

        async def check(session: Session) -> None:
            if before is not None:
                before(session)
            await _answers_if_warm(session)

        async with self.session_for(query, check, timeout=timeout) as (session, _):
            yield session

    async def on_session(
        self,
        query: str,
        request: Callable[[Session], Awaitable[T]],
        *,
        timeout: float | None = None,
    ) -> T:
        """``request`` (safe to send twice) on a session with the peer: what it returns.
        Sent once more on a new session should a warm one die under it."""
        async with self.session_for(query, request, timeout=timeout) as (_session, result):
            return result

    async def _dial(self, peer: Peer, timeout: float | None) -> Session:
        addresses = []
        for text in peer.dial_addresses():
            with contextlib.suppress(ValueError):
                addresses.append(parse_address(text))
        # Heard on the LAN lately: that address first (the stored ones may be stale).
        lan = None if self.pool is None else self.pool.lan_address(str(peer.node_id))
        if lan is not None:
            addresses = [lan, *(a for a in addresses if a != lan)]
        config = self.home.config
        relay_text = config.relay or peer.relay
        relays = []
        if relay_text:
            setting = config.relay_tcp if relay_text == config.relay else ""
            tcp = tcp_route(relay_text, setting, udp_retry=config.relay_udp_retry)
            relays.append(RelayHint(relay_text, config.relay_token, tcp))
        relays += self._peers_that_relay(peer)
        via = None if self.pool is None else self.pool.outgoing
        # Dialled first: where punching got through last time, from the same socket.
        punched = None if via is None or self.pool is None else self.pool.punched(str(peer.node_id))
        # Reached through the relay last time: try it at once, beside the addresses.
        # The pool remembers its own sessions. An in-process command (a socket of its
        # own, where the direct attempt races the relay rather than stopping for it)
        # reads the path of the last session with the peer from the store.
        if self.pool is not None:
            relay_first = self.pool.relay_first(str(peer.node_id))
        else:
            relay_first = went_through_relay(peer.last_path)
        dial = functools.partial(
            open_session,
            self.home.identity,
            config.node_name,
            server_key=peer.public_key,
            timeout=timeout or config.connect_timeout,
            peer_label=peer.name,
            relays=relays,
            via=via,
            punched=punched,
            relay_first=relay_first,
        )
        try:
            session = await dial(addresses)
        except UnreachableError:
            # The peer may have moved: its signed address record in the registry.
            moved = await self._look_up_moved(peer)
            if moved is None:
                raise
            session = await dial(moved)
        if lan is not None and session.relayed is None and session.address == lan:
            session.lan = True
        logger.info("session with %s: %s (dial: %s)", peer.name, session.path, session.dial_record)
        self._remember(peer, session)
        if "silent_providers" in self.__dict__:  # it answers again: listings ask it again
            self.silent_providers.heard(str(peer.node_id), None)
        return session

    def _peers_that_relay(self, peer: Peer) -> list[RelayHint]:
        """The paired, allowed peers (but ``peer``) whose Welcome said they relay for
        their peers, at the address each was last reached: relays to race beside the
        configured one (``relay_for_peers`` on their side), the
        :data:`PEER_RELAYS_RACED` seen most recently."""
        relaying = [
            (other.last_seen or 0.0, addresses[0], other.name)
            for other in self.home.store.peers()
            if other.relays
            and other.allowed
            and other.node_id != peer.node_id
            and (addresses := other.dial_addresses())
        ]
        relaying.sort(key=lambda found: found[0], reverse=True)
        return [RelayHint(address, peer=name) for _, address, name in relaying[:PEER_RELAYS_RACED]]

    async def _look_up_moved(self, peer: Peer) -> list[Address] | None:
        """New addresses of ``peer`` from the registry (signed by its pinned key), stored;
        None without a registry, a record, or anything new."""

        url = str(self.home.config.get("rendezvous_url"))
        if not url:
            return None
        found = await refresh_peer(
            self, peer, RegistryClient(url, timeout=5.0), timeout=0, dial=False
        )
        if not found.moved:
            return None
        addresses = []
        for text in found.addresses:
            with contextlib.suppress(ValueError):
                addresses.append(parse_address(text))
        logger.info("%s moved to %s (its signed address record)", peer.name, found.addresses)
        return addresses or None

    def _remember(self, peer: Peer, session: Session) -> None:
        """Record the path that worked (and a punched address to dial first next time)."""
        address = session.dialable_address()
        text = None if address is None else f"{address[0]}:{address[1]}"
        self.home.store.touch_peer(peer.node_id, address=text, path=session.path)

        def heard_welcome(welcome: asyncio.Future[None]) -> None:
            # Whether it relays for its peers: said in its Welcome, which a request
            # need not wait for.
            if not welcome.cancelled() and welcome.exception() is None:
                self.home.store.touch_peer(peer.node_id, relays=session.peer_relays)

        session.read_welcome().add_done_callback(heard_welcome)

    async def connect(
        self, query: str, *, pings: int = 5, timeout: float | None = None, fresh: bool = False
    ) -> ConnectResult:
        """Dial a peer, prove identities both ways, and measure the round trip: on
        the warm session to it when this node keeps one, unless ``fresh`` (a new
        dial, timed whole, and closed after; the warm one stays as it was)."""

        peer = self.peer(query)

        started = time.perf_counter()
        opened = (
            self.session(query, timeout=timeout, fresh=True)
            if fresh
            else self.live_session(query, timeout=timeout)
        )
        async with opened as session:
            # Lent warm: the pool had it before this command (it lends a session it
            # dials now once, to us). Whether it was welcomed yet says nothing: a
            # dial's Welcome can land before this line runs on a busy machine.
            kept = self.pool.warm(str(peer.node_id), session) if self.pool and not fresh else None
            warm = kept is not None and kept.uses > 1
            # The status request leaves with the identity proof and its reply comes
            # right behind the provider's Welcome: no round trip of its own.
            status = asyncio.ensure_future(session.request(StatusRequest()))
            try:
                await session.established()
                connect_ms = (time.perf_counter() - started) * 1000
                if warm and kept is not None and kept.connect_ms is not None:
                    connect_ms = kept.connect_ms
                remote = await status
            finally:
                status.cancel()
                status.add_done_callback(lambda done: done.cancelled() or done.exception())
            await session.wait_for_punching(PUNCH_WAIT)
            if session.punched_after is not None:
                # The path it reports is the one `peers` shows next (a punch that
                # came after the dial's record is otherwise written only when the
                # session ends).
                self._remember(peer, session)
            if not isinstance(remote, StatusReply):
                raise UnreachableError(f"{peer.name} answered status with {type(remote).__name__}")
            rtts = []
            for _ in range(max(1, pings)):
                sent = time.perf_counter()
                reply = await session.request(Ping(sent=sent))
                if isinstance(reply, Pong):
                    rtts.append((time.perf_counter() - sent) * 1000)
            host, port = session.address
            path = session.path
            punched = session.punched_after
        return ConnectResult(
            peer=self.peer(peer.node_id),
            address=f"{host}:{port}",
            path=path,
            rtt_ms=statistics.median(rtts),
            punch_ms=None if punched is None else punched * 1000,
            connect_ms=connect_ms,
            remote=remote,
            warm=warm,
        )

    async def check_paired_back(
        self, query: str, *, timeout: float = PAIR_CHECK_TIMEOUT
    ) -> PairCheck:
        """One short dial to a peer: does it know this node yet? Never raises for the
        peer's sake; the whole attempt takes at most ``timeout`` seconds."""

        peer = self.peer(query)
        try:
            async with asyncio.timeout(timeout):
                async with self.session(peer.node_id, timeout=timeout) as session:
                    await session.request(StatusRequest(), timeout=timeout)
        except TimeoutError:
            where = ", ".join(peer.dial_addresses()) or f"{peer.name}'s relay"
            return PairCheck(PairState.UNREACHABLE, unreachable(where, waited=timeout).message)
        except NotPairedError:
            return PairCheck(PairState.NOT_PAIRED)
        except (UnreachableError, RelayError, ConnectionLostError) as exc:
            # Not the peer's answer: no path to it (a relay's refusal included).
            return PairCheck(PairState.UNREACHABLE, exc.message)
        except GPUMeshError as exc:
            return PairCheck(PairState.REFUSED, exc.message)
        return PairCheck(PairState.READY)

    async def throughput(self, query: str, size: int) -> ThroughputResult:
        """Push ``size`` bytes to a peer over one authenticated stream and time it."""
        peer = self.peer(query)
        chunk = bytes(1024 * 1024)
        async with self.session(query) as session:
            stream = session.open_stream()
            started = time.perf_counter()
            stream.send_message(ThroughputRequest(size=size))
            remaining = size
            while remaining:
                part = chunk[: min(remaining, len(chunk))]
                await stream.send_data(part)
                remaining -= len(part)
            stream.end_data()
            stream.finish()
            reply = await stream.expect(ThroughputReply)
            seconds = time.perf_counter() - started
        if reply.received != size:
            raise UnreachableError(f"{peer.name} received {reply.received} of {size} bytes")
        return ThroughputResult(peer=peer, bytes=size, seconds=seconds)


async def _answers_if_warm(session: Session) -> None:
    """A ping on a session welcomed before this request (lent warm); nothing on one
    dialled for it."""
    if session.welcomed:
        await session.request(Ping(sent=time.perf_counter()), timeout=PROBE_TIMEOUT)


def default_node_name() -> str:
    """The name ``init`` gives a node when none is asked for: $GPUMESH_NODE_NAME, or the host's."""
    if name := env(ENV_NODE_NAME):
        return name
    host = socket.gethostname().split(".")[0] or "gpumesh-node"
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in host)[:63]
    return cleaned if cleaned[:1].isalnum() else f"node-{cleaned}"[:63]
