"""The provider agent behind ``gpumesh share``.

Owns the listening QUIC endpoint, the identity proof of each new connection,
the access check of every request, and request dispatch. It builds the
services (jobs, files, apps, shells) from the narrow things each one uses
(:mod:`gpumesh.agent.deps`), with the GPU allocator and the container settings
they share, and each service registers a typed handler per request message;
the agent answers ``Ping``, ``StatusRequest`` and ``ThroughputRequest`` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from gpumesh.agent.addresses import AddressService
from gpumesh.agent.apps import AppService
from gpumesh.agent.containers import Containers
from gpumesh.agent.cuda import CudaService
from gpumesh.agent.deps import Handlers, Provider, RequestContext
from gpumesh.agent.desktop import DesktopService
from gpumesh.agent.exec import ExecService
from gpumesh.agent.files import FileService
from gpumesh.agent.gpus import GpuAllocator
from gpumesh.agent.jobs import JobService, uploaded_workdirs
from gpumesh.agent.limits import return_free_memory
from gpumesh.agent.outputs import OutputsService
from gpumesh.agent.peerrelay import FriendRegistrations, PeerRelay, peer_rules
from gpumesh.agent.ratelimit import ConnectionLimiter, Outcome, RefusalTally, Slot
from gpumesh.agent.reclaimer import GpuReclaimer
from gpumesh.blocking import in_thread
from gpumesh.errors import (
    AccessDeniedError,
    AgentError,
    GPUMeshError,
    InUseError,
    LimitError,
    NotPairedError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.gpu.inventory import GpuInventory, detect_inventory
from gpumesh.protocol.admission import Admission, DropReason
from gpumesh.protocol.messages import (
    Ping,
    Pong,
    StatusReply,
    StatusRequest,
    ThroughputReply,
    ThroughputRequest,
)
from gpumesh.runtime.base import JobRuntime
from gpumesh.store.home import AgentInfo, Home, RelayState
from gpumesh.store.limits import ShareLimits, machine_size
from gpumesh.store.peerrecords import PeerRecords
from gpumesh.store.shares import Pause
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.netinfo import local_addresses
from gpumesh.transport.quic import QuicLink
from gpumesh.transport.relayclient import RelayClient
from gpumesh.transport.relaytcp import tcp_route
from gpumesh.transport.routes import Routes
from gpumesh.transport.session import accept_session, resolve_relay
from gpumesh.transport.stream import Stream
from gpumesh.transport.udp import Address, format_address
from gpumesh.units import format_size, parse_size
from gpumesh.version import __version__

__all__ = ["Agent", "Paused", "RequestContext"]

logger = logging.getLogger(__name__)

RETURN_MEMORY_AFTER = 3.5
"""Seconds after a link closed before freed memory goes back to the system (the
endpoint keeps a closed link 3 s to retransmit its close)."""
REQUEST_TIMEOUT = 30.0
REFUSALS_EVERY = 10.0
"""Seconds between summary lines about refused packets (never a line per packet)."""
RELAYING_EVERY = 5.0
"""Seconds between looks at which peers relay for this node (and at the bounds)."""
PAUSE_SESSIONS_WAIT = 10.0
"""Seconds a pause waits, past its grace, for guest shells to be gone."""


@dataclass(frozen=True)
class Paused:
    """What ``gpumesh pause`` did."""

    pause: Pause
    jobs: list[str]
    """The guest jobs preempted (their ids)."""
    sessions: int
    """Guest shells and CUDA sessions ended."""


class Agent:
    """Serves allowed peers until stopped."""

    def __init__(
        self,
        home: Home,
        *,
        host: str | None = None,
        port: int | None = None,
        limiter: ConnectionLimiter | None = None,
        runtime: JobRuntime | None = None,
        inventory: GpuInventory | None = None,
        max_vram: int | None = None,
    ) -> None:
        self.home = home
        self.identity = home.identity
        self.store = home.store
        self.name = home.config.node_name
        self.host = host if host is not None else home.config.listen_host
        self.port = port if port is not None else home.config.listen_port
        self.limiter = limiter or ConnectionLimiter()
        self.refusals = RefusalTally(interval=REFUSALS_EVERY)
        self.started = time.time()
        self.endpoint: QuicEndpoint | None = None
        self.relay: RelayClient | None = None
        """The registration with the configured relay, if any."""
        self.routes = Routes()
        """The share socket's relay clients (the configured relay, the peers that relay
        for this node) and the relay it serves its peers (``relay_for_peers``)."""
        self.peer_relay: PeerRelay | None = None
        self._friends: FriendRegistrations | None = None
        self._relay_text = home.config.relay
        self._relay_state = (RelayState.NONE, "")
        self._links: dict[QuicLink, bytes] = {}
        self._link_names: dict[QuicLink, str] = {}
        self._requests: dict[QuicLink, set[asyncio.Task[Any]]] = {}
        """The requests each link has open now (max_requests_per_link)."""
        self._returning_memory: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()
        self._changed = asyncio.Event()
        """Set when the owner changed this home's state (a deny, a cancel: :meth:`changed`)."""
        self.machine = machine_size()
        config = home.config
        jobs_dir = home.jobs_dir
        provider = Provider(self.name, str(self.identity.node_id), self.host)
        if max_vram is None:
            configured_cap = str(config.get("max_vram") or "")
            max_vram = parse_size(configured_cap) if configured_cap else 0
        self.gpus = GpuAllocator(
            lambda: inventory if inventory is not None else detect_inventory(),
            max_vram=max_vram,
            provider=self.name,
        )
        """Which GPU memory is promised to whom (jobs now)."""
        self.files = FileService(
            provider,
            config,
            self.identity,
            root=home.files_dir,
            # What a peer's jobs write in their uploaded workdirs counts in its quota.
            job_dirs=functools.partial(uploaded_workdirs, self.store, jobs_dir),
        )
        self.containers = Containers(
            provider, config, self.store, self.share_limits, self.files, runtime=runtime
        )
        self.jobs = JobService(
            provider,
            config,
            self.store,
            containers=self.containers,
            gpus=self.gpus,
            files=self.files,
            share_limits=self.share_limits,
            jobs_dir=jobs_dir,
        )
        self.apps = AppService(provider, self.files, self.jobs, index_root=home.apps_dir)
        self.outputs = OutputsService(provider, self.store, self.jobs, self.jobs.runner.outputs)
        self.shells = ExecService(provider, self.containers, self.jobs.admission, self.gpus)
        self.cuda = CudaService(
            provider,
            self.store,
            self.gpus,
            self.jobs.admission,
            config,
        )
        self.handlers = Handlers()
        """Request message type -> the handler that serves it."""
        self.handlers.add(Ping, _handle_ping)
        self.handlers.add(StatusRequest, self._handle_status)
        self.handlers.add(ThroughputRequest, _handle_throughput)
        self.desktop = DesktopService(provider, self.store, channels=self.files.channels)
        """The desktop share: the owner's one local port, for its own allowlist."""
        services = (self.jobs, self.files, self.apps, self.outputs, self.shells, self.desktop)
        for service in (*services, self.cuda):
            service.register(self.handlers)
        self.addresses = AddressService(
            self.identity,
            config,
            self.store,
            PeerRecords(home.path),
            lambda: local_addresses(self.host, self.address[1]),
        )
        """Where this node and its findable peers are now (``gpumesh sync`` asks)."""
        self.addresses.register(self.handlers)
        self.reclaimer = GpuReclaimer(
            provider,
            config,
            self.gpus,
            self.containers,
            self.jobs.runner,
            workers=lambda: [session.process.pid for session in self.cuda.sessions()],
            jobs=self.store.unfinished_hosted_jobs,
        )
        """Takes a GPU back while its owner uses it (``reclaim_on_gpu_use``)."""

    def share_limits(self) -> ShareLimits:
        """The sharing limits in force (config, ``auto`` worked out for this machine)."""
        return ShareLimits.from_config(self.home.config, self.machine)

    @property
    def node_id(self) -> str:
        return str(self.identity.node_id)

    @property
    def address(self) -> Address:
        assert self.endpoint is not None
        return self.endpoint.local_address

    async def start(self) -> Address:
        """Bind the share port and start serving; returns the bound address.

        Refuses (ConfigError) a ``job_network`` whose rules cannot be installed
        here, before anything is bound: jobs never run unfiltered."""
        self.home.secure()
        try:
            await in_thread(self.containers.start_network)
            self.jobs.no_gpu_runtime = await in_thread(self._docker_lacks_gpus)
        except GPUMeshError:
            self.containers.close()  # the engine client it opened: nothing else runs
            raise
        try:
            self.endpoint = QuicEndpoint.listen(
                self.identity,
                self.host,
                self.port,
                on_link=self._on_link,
                accept=self._accept,
                on_drop=self._dropped,
            )
        except OSError as exc:
            self.containers.close()
            raise InUseError(
                f"cannot listen on UDP {self.host}:{self.port}: {exc.strerror or exc}; is "
                "another `gpumesh share` running? pick another port with "
                "`gpumesh config set listen_port PORT`"
            ) from exc
        host, port = self.address
        self._friends = FriendRegistrations(
            self.endpoint,
            self.routes,
            self.identity,
            lambda: local_addresses(self.host, port),
            self._relay_authorize,
        )
        if self._relay_text:
            await self._start_relay(self._relay_text)
        self._sync_relaying()
        self._spawn(self._keep_relaying())
        self.home.attach_agent(self)
        self._spawn(self._watch_changes())
        self._spawn(self._summarize_refusals())
        self._spawn(self.jobs.runner.recover())
        self._spawn(self._keep_paused())
        if await in_thread(lambda: bool(self.gpus.inventory.gpus())):
            self._spawn(self.reclaimer.run())
        logger.info("sharing on udp %s:%d as %s", host, port, self.name)
        logger.info("limits: %s", self.share_limits().describe())
        logger.info("job network: %s", self.containers.network().mode)
        return self.address

    def _docker_lacks_gpus(self) -> bool:
        """Whether this machine has GPUs its Docker cannot give to containers
        (blocking; False when Docker does not answer: a job meets that itself).
        Simulated GPUs (tests) stand for a machine whose Docker gives them: a
        container Docker refuses its GPUs tells all the same (JobService)."""
        inventory = self.gpus.inventory
        if inventory.source == "simulated" or not inventory.gpus():
            return False
        try:
            return not self.containers.runtime.gpu_runtime_available()
        except GPUMeshError:
            return False

    # --- the relay --------------------------------------------------------------------

    async def _start_relay(self, text: str) -> None:
        """Register with the relay over the share socket, so peers behind NAT reach us."""
        endpoint = self.endpoint
        assert endpoint is not None
        try:
            address = await resolve_relay(text)
        except UnreachableError as exc:
            logger.warning("%s; sharing without the relay", exc)
            self._relay_state = (RelayState.UNAVAILABLE, str(exc))
            return
        port = self.address[1]
        config = self.home.config
        client = RelayClient(
            endpoint,
            address,
            text,
            self.identity,
            token=config.relay_token,
            serving=True,
            candidates=lambda: local_addresses(self.host, port),
            authorize=self._relay_authorize,
            tcp=tcp_route(text, config.relay_tcp, udp_retry=config.relay_udp_retry),
        )
        client.on_change = self._relay_changed
        self.routes.clients[address] = client
        endpoint.relay = self.routes
        self.relay = client
        self._relay_state = (RelayState.REGISTERING, "")
        client.start()

    def _relay_authorize(self, public_key: bytes) -> bool:
        """Whether to accept a relayed session: only paired, allowed peers (default deny)."""
        try:
            self.authorize(public_key)
        except AccessDeniedError:
            return False
        return True

    def _sync_relaying(self) -> None:
        """Relay for peers or not, as ``relay_for_peers`` says, within its bounds now;
        register with the peers that relay for this node. At start, at each of the
        owner's changes, and every few seconds (a peer's Welcome may have said that
        it relays since)."""
        endpoint = self.endpoint
        if endpoint is None:
            return
        config = self.home.config
        if config.relay_for_peers:
            rules = peer_rules(config)
            if self.peer_relay is None:
                self.peer_relay = PeerRelay(endpoint, rules, self._relay_authorize, self._name_of)
                self.routes.server = self.peer_relay
                logger.info(
                    "relaying for peers: at most %d sessions, %s/s in all",
                    rules.max_sessions_total,
                    format_size(rules.total_rate),
                )
            else:
                self.peer_relay.update(rules)
        elif self.peer_relay is not None:
            self.peer_relay.close()
            self.peer_relay = self.routes.server = None
            logger.info("no longer relaying for peers")
        if self._friends is not None:
            self._friends.refresh(self.store.peers())
        # Without a relay client or server, what is not QUIC is dropped (and counted).
        endpoint.relay = self.routes if self.routes.clients or self.routes.server else None

    async def _keep_relaying(self) -> None:
        while True:
            await asyncio.sleep(RELAYING_EVERY)
            try:
                self._sync_relaying()
            except Exception:
                logger.exception("updating the relaying for peers failed")

    def _name_of(self, node_id: str) -> str:
        peer = next((p for p in self.store.peers() if str(p.node_id) == node_id), None)
        return node_id[:12] if peer is None else peer.name

    def _relay_changed(self) -> None:
        client = self.relay
        assert client is not None
        if client.registered.is_set():
            self._relay_state = (RelayState.REGISTERED, client.registered_as)
        elif client.error is not None:
            self._relay_state = (RelayState.REFUSED, client.error.message)
        else:
            self._relay_state = (RelayState.REGISTERING, "")

    def info(self) -> AgentInfo:
        """Where we listen, the relay state, each link's path and the open sessions
        (``status``, the owner's view, ``GET /api/v1/share``)."""
        host, port = self.address
        links = [
            {"peer": name, "path": link.describe_path()}
            for link, name in self._link_names.items()
            if not link.is_closed
        ]
        return AgentInfo(
            os.getpid(),
            host,
            port,
            self.started,
            relay=self._relay_text,
            relay_state=self._relay_state[0],
            relay_detail=self._relay_state[1],
            links=links,
            desktop=[
                {
                    "id": session.id,
                    "peer": session.peer.name,
                    "kind": str(session.kind),
                    "port": str(session.port),
                    "since": str(session.since),
                    "path": session.path,
                }
                for session in self.desktop.sessions()
            ],
            shells=[session.describe() for session in self.shells.sessions()],
            cuda=[session.describe() for session in self.cuda.sessions()],
            reclaimed=self.gpus.withheld(),
            relaying=None if self.peer_relay is None else self.peer_relay.state(),
        )

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._returning_memory is not None:
            self._returning_memory.cancel()
        self.shells.stop()  # before the engine client is closed
        self.desktop.stop()
        self.cuda.stop()
        self.reclaimer.stop()
        self.jobs.runner.stop()
        self.containers.close()
        for task in list(self._tasks):
            task.cancel()
        if self.endpoint is not None:
            self.endpoint.close()
        self._log_refusals(final=True)
        self.home.detach_agent(self)

    # --- connections ------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _accept(self, address: Address, validated: bool) -> Admission | DropReason:
        verdict = self.limiter.admit(address[0], validated)
        if verdict is Admission.RETRY:
            self.refusals.retried()
            self._log_refusals()
        return verdict

    def _dropped(self, address: Address, reason: DropReason, validated: bool) -> None:
        if reason is DropReason.UNDECRYPTABLE and validated:
            self.limiter.failed(address[0])  # junk after echoing a token: not a mistake
        self.refusals.note(address[0], reason)
        self._log_refusals()

    def _log_refusals(self, final: bool = False) -> None:
        summary = self.refusals.due(flush=final)
        if summary is not None:
            level = logging.WARNING if summary.refused else logging.INFO
            logger.log(level, "%s", summary.text)

    async def _summarize_refusals(self) -> None:
        # Refusals are logged as they start, then summed up: this writes the sums
        # of an interval that nothing refused after.
        while True:
            await asyncio.sleep(REFUSALS_EVERY)
            self._log_refusals()

    def _on_link(self, link: QuicLink) -> None:
        slot = self.limiter.opened(link.address[0], link.validated)
        self._spawn(self._authenticate(link, slot))

    def authorize(self, public_key: bytes) -> None:
        """Raise unless ``public_key`` belongs to a paired, allowed peer."""
        peer = self.store.peer_by_key(public_key)
        if peer is None:
            raise NotPairedError(
                f"{self.name} has not paired with you: send its owner your code "
                "(`gpumesh pair-code`) and ask them to run `gpumesh pair '<code>'`"
            )
        if not peer.allowed:
            raise AccessDeniedError(f"{self.name} has denied you access")

    async def _authenticate(self, link: QuicLink, slot: Slot) -> None:
        outcome = Outcome.UNATTRIBUTED
        denied: list[bytes] = []

        def authorize(public_key: bytes) -> None:
            """:meth:`authorize`, noting a paired peer's denial (its proof was good)."""
            try:
                self.authorize(public_key)
            except NotPairedError:
                raise
            except AccessDeniedError:
                denied.append(public_key)
                raise

        try:
            accepted = await accept_session(
                link, self.identity, self.name, authorize, relays=self.peer_relay is not None
            )
            outcome = Outcome.PROVEN
        except GPUMeshError as exc:
            if denied:
                # A peer the owner denied: its proof was good. Not held against the
                # address (allowed peers may share it), and said as what it is.
                outcome = Outcome.REFUSED
                logger.info("refused a connection from %s: %s", _where(link), exc)
                return
            # Held against the address only when the sender is known to receive there:
            # a forged source address must not box its real owner out.
            if link.validated:
                outcome = Outcome.FAILED
            if self.refusals.failed_proof():
                logger.info("refused connection from %s: %s", _where(link), exc)
            self._log_refusals()
            return
        finally:
            self.limiter.closed(slot, outcome)
        key = accepted.auth.client_key
        assert key is not None
        peer = self.store.peer_by_key(key)
        assert peer is not None
        limits = self.share_limits()
        most = limits.max_links_per_peer
        held = sum(1 for other in self._links.values() if other == key)
        if most and held >= most:
            # Each connection has its own request and buffer limits; this bounds
            # how many of them one peer can stack up.
            logger.info("[%s] refused a connection: %d open already", peer.name, held)
            link.close(
                LimitError(
                    f"{self.name} allows at most {most} connections from one peer at once "
                    f"(its max_links_per_peer) and you have {held} open; close some (end "
                    "`logs -f` followers, finished copies) and try again"
                )
            )
            return
        self._links[link] = key
        self._link_names[link] = peer.name
        self.store.touch_peer(peer.node_id)
        logger.info("[%s] connected from %s (%s)", peer.name, _where(link), link.describe_path())
        link.buffer_limit = limits.link_buffer  # no longer the early one
        link.on_stream = lambda stream: self._spawn(self._serve_stream(link, key, stream))
        for stream in accepted.early:  # sent with the proof: served in the order they came
            self._spawn(self._serve_stream(link, key, stream))
        closed = await link.wait_closed()
        self._links.pop(link, None)
        self._link_names.pop(link, None)
        logger.info("[%s] disconnected: %s", peer.name, closed)

    def changed(self) -> None:
        """The owner changed this home's state (a deny, a cancel, the desktop or CUDA
        share): act on it now. Owner actions reach the agent only this way, from the
        node process that runs it (its API)."""
        self._changed.set()

    async def _watch_changes(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            try:
                self._sync_relaying()
                await self.revoke_denied()
                self.desktop.revoke()  # its own allowlist, and the share itself
                await self.jobs.owner_cancels()
            except Exception:
                logger.exception("acting on the owner's change failed")

    async def pause(self, grace: float) -> Paused:
        """The owner takes the machine back (``gpumesh pause``) until ``gpumesh resume``
        clears it from the store, through restarts: nothing more is admitted, guest
        jobs are preempted (SIGTERM, then SIGKILL after ``grace`` seconds), guest
        shells and CUDA sessions end (desktop connections stay: the owner shares the
        desktop on purpose). Returns once the guests are stopped."""
        pause = self.store.pause(grace)
        shells = [s.id for s in self.shells.sessions() if self.shells.end(s.id)]
        cuda = [s.id for s in self.cuda.sessions() if self.cuda.end(s.id)]
        jobs = await self.jobs.preempt(self._paused_reason, grace)
        # Shells and CUDA sessions end in their own requests' tasks, which drop them
        # from the lists as they finish (no event tells all of them): wait, bounded.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace + PAUSE_SESSIONS_WAIT):
                while self.shells.sessions() or self.cuda.sessions():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        logger.info(
            "paused by the owner: %d job(s) preempted, %d session(s) ended",
            len(jobs),
            len(shells) + len(cuda),
        )
        return Paused(pause, jobs, len(shells) + len(cuda))

    async def _keep_paused(self) -> None:
        """After a restart while paused: jobs found running (their containers outlived
        the agent) are preempted again, with the grace the pause was given."""
        pause = self.store.paused()
        if pause is not None:
            await self.jobs.preempt(self._paused_reason, pause.grace)

    @property
    def _paused_reason(self) -> str:
        """Why a pause preempted a guest's job, as both sides show it."""
        return f"{self.name}'s owner paused sharing"

    def end_session(self, session_id: str) -> bool:
        """End one open session (a shell, a desktop connection, a CUDA session) the
        owner asked to end; False when none has that id."""
        for service in (self.shells, self.desktop, self.cuda):
            if service.end(session_id):
                logger.info("the owner ended session %s", session_id)
                return True
        return False

    async def revoke_denied(self) -> None:
        """End everything of peers that are denied (or no longer paired): their open
        links (so their shells, copies and follows), and their running jobs."""
        allowed = self.store.allowed_keys(list(set(self._links.values())))
        for link, key in list(self._links.items()):
            if key not in allowed:
                logger.info("access revoked: closing link from %s", _where(link))
                self._links.pop(link, None)
                link.close(AccessDeniedError(f"{self.name} has revoked your access"))
        allowed_ids = {str(peer.node_id) for peer in self.store.peers() if peer.allowed}
        await self.jobs.revoke(lambda peer_id: peer_id in allowed_ids)
        await self.cuda.revoke()

    async def _handle_status(self, ctx: RequestContext, message: StatusRequest) -> None:
        gpus, source = await self.gpus.report()
        reply = StatusReply(
            paused=self.store.paused() is not None,
            name=self.name,
            node_id=self.node_id,
            version=__version__,
            sharing=True,
            uptime=time.time() - self.started,
            gpu_source=source,
            gpus=gpus,
            running_jobs=len(self.store.unfinished_hosted_jobs()),
            max_vram=self.gpus.max_vram,
            container_gpus=not self.jobs.no_gpu_runtime,
        )
        ctx.stream.send_message(reply, end=True)

    def buffered(self) -> int:
        """Bytes all links hold now: unread requests and unsent replies."""
        return sum(link.buffered().total for link in self._links)

    def _open_request(self, link: QuicLink) -> None:
        """Count a new request of ``link``, or refuse it past max_requests_per_link;
        apply the link's buffer limit (link_buffer) as it is now."""
        limits = self.share_limits()
        link.buffer_limit = limits.link_buffer
        requests = self._requests.get(link)
        if requests is None:
            requests = self._requests[link] = set()
            link.closed.add_done_callback(lambda _closed: self._link_ended(link))
        cap = limits.max_requests_per_link
        if cap and len(requests) >= cap:
            raise LimitError(
                f"{self.name} refused this request: your connection has {len(requests)} "
                f"requests open there, and its max_requests_per_link is {cap}; wait for one "
                "to end"
            )
        task = asyncio.current_task()
        assert task is not None
        requests.add(task)

    def _link_ended(self, link: QuicLink) -> None:
        self._requests.pop(link, None)
        # What its requests held is freed once the endpoint lets go of the link; give
        # it back to the system then, or the agent's RSS keeps its high-water mark.
        if self._returning_memory is None and not self._stopped.is_set():
            self._returning_memory = asyncio.get_running_loop().call_later(
                RETURN_MEMORY_AFTER, self._return_memory
            )

    def _return_memory(self) -> None:
        self._returning_memory = None
        return_free_memory()

    def _close_request(self, link: QuicLink) -> None:
        requests = self._requests.get(link)
        task = asyncio.current_task()
        if requests is not None and task is not None:
            requests.discard(task)

    async def _serve_stream(self, link: QuicLink, key: bytes, stream: Stream) -> None:
        try:
            try:
                self.authorize(key)  # every request, not only the first
            except AccessDeniedError as exc:
                stream.refuse(exc)
                link.close(exc)
                return
            peer = self.store.peer_by_key(key)
            assert peer is not None
            self._open_request(link)
            async with asyncio.timeout(REQUEST_TIMEOUT):
                message = await stream.read_message()
            handler = self.handlers.get(type(message))
            if handler is None:
                raise ProtocolError(f"{type(message).__name__} is not a request this node serves")
            await handler(RequestContext(peer, link, stream), message)
        except TimeoutError:
            stream.refuse(ProtocolError("no request arrived in time"))
        except GPUMeshError as exc:
            logger.info("request refused: %s", exc)
            with contextlib.suppress(GPUMeshError):
                stream.refuse(exc)
        except Exception:
            logger.exception("request failed")
            with contextlib.suppress(GPUMeshError):
                stream.refuse(AgentError("the provider hit an internal error; see its debug log"))
        finally:
            self._close_request(link)
            link.forget_stream(stream.stream_id)


async def _handle_ping(ctx: RequestContext, message: Ping) -> None:
    ctx.stream.send_message(Pong(sent=message.sent, time=time.time()), end=True)


async def _handle_throughput(ctx: RequestContext, message: ThroughputRequest) -> None:
    started = time.perf_counter()
    received = 0
    while chunk := await ctx.stream.read_data():
        received += len(chunk)
        if received > message.size:
            raise ProtocolError("peer sent more bytes than it announced")
    seconds = time.perf_counter() - started
    ctx.stream.send_message(ThroughputReply(received=received, seconds=seconds), end=True)


def _where(link: QuicLink) -> str:
    return format_address(link.remote_address())
