"""The node process: holds the home, serves the control API, and knows when to go.

One per home (:mod:`gpumesh.daemon.record`'s lock). It serves the control API on
the home's ``control.sock`` (0600) and, when asked, on TCP, in one event loop.
Started in the background by a command that needs it (``detached``), it exits
after :data:`IDLE_DEFAULT` seconds without a request unless it serves TCP; it
also exits as soon as its home folder is gone (a test's temporary home leaves
no process behind). SIGINT and SIGTERM, or ``POST /api/v1/node/stop``, stop it.
``POST /api/v1/node/tcp`` (``gpumesh dashboard``) makes a running one serve TCP
too, on loopback: from then on it stays until stopped, as ``gpumesh-control`` does.
At start it lifts its descriptor limit to the hard limit, and every connection,
on every socket, passes one :class:`~gpumesh.httpguard.Guard`: what another local
user (or, with ``--allow-remote``, anybody) can open costs bounded descriptors,
memory and time. A bind beyond loopback is served over TLS only, with a token of
at least 128 bits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpumesh import platform
from gpumesh.client.bodies import ShareOptions
from gpumesh.client.lan import LanPeers
from gpumesh.client.moves import JobKeeper
from gpumesh.client.node import Node
from gpumesh.client.outputs import OutputsReceivers
from gpumesh.client.pool import SessionPool
from gpumesh.control import auth
from gpumesh.control.app import create_app
from gpumesh.control.call import ControlState
from gpumesh.control.server import (
    limits,
    parse_listen,
    serve,
    tcp_listener,
    tls_context,
    unix_listener,
)
from gpumesh.control.shareviews import ShareEnd, ShareLine, ShareView
from gpumesh.control.views import (
    NodeProcessView,
    NodeVersionView,
    OutgoingView,
    RelayRegistrationView,
    ShareEndedView,
    WarmSessionView,
)
from gpumesh.daemon.client import NoAnswer, NodeClient, NodeUnavailableError
from gpumesh.daemon.record import HomeLock, NodeRecord, holder, last_share_end
from gpumesh.daemon.sharing import Sharing
from gpumesh.daemon.shells import Shells
from gpumesh.errors import ConfigError, GPUMeshError, InUseError
from gpumesh.httpguard import Guard, raise_descriptor_limit
from gpumesh.protocol.states import FINAL_STATES, JobRole
from gpumesh.settings import (
    API_ADDR_DEFAULT,
    ENV_API_ADDR,
    ENV_API_TOKEN,
    ENV_NODE_IDLE,
    ENV_TEST_NODE_VERSION,
    env,
)
from gpumesh.transport.lan import LanDiscovery, LanSettings
from gpumesh.transport.outgoing import OutgoingSocket
from gpumesh.version import __version__

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from gpumesh.store.home import Home

__all__ = ["IDLE_DEFAULT", "NodeProcess", "run_node"]

logger = logging.getLogger(__name__)

TOKEN_MIN = 32
"""Characters of ``$GPUMESH_API_TOKEN`` a bind beyond loopback needs (128 bits as hex)."""
IDLE_DEFAULT = 600.0
"""Seconds a background node process waits for the next request before it exits."""
TICK = 0.5
"""Seconds between the checks for idleness and for the home's folder."""
TAKEOVER_WAIT = 30.0
"""Seconds a foreground start waits for a background node process to hand over (its
share, if any, stops first: the registry listing is withdrawn, links close)."""


def idle_limit() -> float:
    """``$GPUMESH_NODE_IDLE`` seconds, else :data:`IDLE_DEFAULT`."""
    text = env(ENV_NODE_IDLE)
    if text is None:
        return IDLE_DEFAULT
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{ENV_NODE_IDLE}={text!r}: give seconds, such as 600") from None
    if value <= 0:
        raise ConfigError(f"{ENV_NODE_IDLE} must be more than 0 seconds")
    return value


@dataclass
class NodeProcess:
    """This process as the control API shows it, and how idle it is.

    ``clock`` is injected so idleness is decided without sleeping in tests."""

    home: Path
    detached: bool
    api: list[str]
    tcp: bool
    idle: float | None
    """Seconds without a request before exiting; None: never (foreground, TCP)."""
    version: str = __version__
    clock: Callable[[], float] = time.monotonic
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    started_at: float = field(default_factory=time.time)
    active: int = 0
    """Requests under way (an event stream counts until it ends)."""
    last_active: float = 0.0
    pool: SessionPool | None = None
    serve_tcp: Callable[[str], Awaitable[None]] | None = None
    """Start serving the API on TCP at ``host:port`` too (loopback only); nothing
    when it already does."""
    sharing: Sharing | None = None
    """The home's share, which this process owns."""
    stopping: str = ""
    """Why it stops (said in how a share it ran ended)."""
    unfinished: Callable[[], bool] = lambda: False
    """Whether the home has work that has not ended (jobs hosted or submitted)."""
    _ending: asyncio.Future[bool] | None = None

    def __post_init__(self) -> None:
        self.last_active = self.clock()

    @property
    def shares(self) -> bool:
        return self.sharing is not None and self.sharing.active

    def end(self, why: str) -> None:
        """Stop, saying why: a share it runs ends first, with that reason (while the
        API still serves, so its followers hear how it ended)."""
        if self.stopping:
            return
        self.stopping = why
        if self.sharing is None or not self.sharing.active:
            self.stop.set()
            return
        # Kept here: the loop holds a task only weakly.
        self._ending = asyncio.ensure_future(self.sharing.stop(why))
        self._ending.add_done_callback(lambda _task: self.stop.set())

    def view(self) -> NodeProcessView:
        ended = None if self.sharing is None or self.shares else self.sharing.ended
        return NodeProcessView(
            pid=os.getpid(),
            version=self.version,
            started_at=self.started_at,
            detached=self.detached,
            sharing=self.shares,
            api=list(self.api),
            idle_exit=self.idle,
            warm_sessions=[
                WarmSessionView(
                    peer=w.peer_name,
                    path=w.session.path,
                    idle=round(max(0.0, self.clock() - w.last_used), 1),
                    uses=w.uses,
                    local_port=w.session.link.local_port,
                )
                for w in (self.pool.sessions() if self.pool is not None else [])
            ],
            outgoing=self._outgoing(),
            share_ended=None if ended is None else ShareEndedView(ended.at, ended.how),
        )

    def _outgoing(self) -> OutgoingView | None:
        shared = None if self.pool is None else self.pool.outgoing
        if shared is None:
            return None
        state = shared.state()
        relays = [
            RelayRegistrationView(relay=r.relay, state=r.state, registrations=r.registrations)
            for r in state.relays
        ]
        return OutgoingView(port=state.port, links=state.links, relays=relays)

    def should_exit(self) -> str | None:
        """Why to exit now, or None."""
        if not self.home.is_dir():
            return f"its home {self.home} is gone"
        idle_for = self.clock() - self.last_active
        if self.idle is not None and self.active == 0 and idle_for >= self.idle:
            if self.shares or self.unfinished():
                return None  # a share, or jobs that have not ended, keep it
            return f"idle for {self.idle:g} s"
        return None

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """``app``, counting its requests as activity."""

        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            self.active += 1
            try:
                await app(scope, receive, send)
            finally:
                self.active -= 1
                self.last_active = self.clock()

        return counted


def _take_home(home: Path, *, detached: bool) -> tuple[HomeLock, ShareOptions | None]:
    """The home's lock, and the options of the share it took over (or None). A
    background node process hands over to a foreground start (a share it runs
    stops there, and the start shares with the same options); any other holder is
    named."""
    lock = HomeLock(home)
    deadline = time.monotonic() + TAKEOVER_WAIT
    asked = False
    taken: ShareOptions | None = None
    while not lock.acquire():
        record = holder(home)
        if record is None:
            continue  # it let go between the two looks
        if detached or not asked:
            client = NodeClient(home)
            view: NodeVersionView | None = None
            with contextlib.suppress(NodeUnavailableError):
                view = client.call("GET", "/api/v1/node", NodeVersionView, timeout=5)
            if detached or view is None or not view.detached:
                pid = record.pid or "starting"
                raise InUseError(
                    f"a node process (pid {pid}) already serves {home}: "
                    "`gpumesh daemon status` shows it, `gpumesh daemon stop` stops it"
                )
            with contextlib.suppress(NodeUnavailableError):
                if view.sharing:
                    taken = client.call("GET", "/api/v1/share", ShareView, timeout=5).options
                client.call("POST", "/api/v1/node/stop", NoAnswer, timeout=5)
            asked = True
        if time.monotonic() > deadline:
            raise InUseError(
                f"the node process (pid {record.pid}) of {home} did not stop: "
                f"stop it with `kill {record.pid}`"
            )
        time.sleep(0.05)
    return lock, taken


async def run_node(
    home_arg: str | Path | Node | None,
    *,
    listen: str | None,
    allow_remote: bool,
    hosts: list[str],
    detached: bool,
    announce: Callable[[str], None] = print,
    tls: tuple[Path, Path] | None = None,
    share: ShareOptions | None = None,
    echo: Callable[[ShareLine], None] | None = None,
    title: str | None = None,
) -> int:
    """Be this home's node process until stopped (SIGINT, SIGTERM, the API); 0 on
    an orderly end.

    ``home_arg``: the home, or the hosting process's own :class:`Node` (left open).
    ``tls``: a certificate and its key (PEM) that TCP is served with
    (``--allow-remote`` needs them). ``share``: share with these options from the
    start (``gpumesh daemon run`` with share options); a share that cannot start
    ends the process with its error. ``echo`` hears every line a share says (a
    process in the foreground prints them). ``title``: what its lines call it
    (``gpumesh-control`` in the foreground, by default)."""

    # One Node (so one database connection) per process: a second connection made
    # beside the agent's would close a descriptor of the database file, and with it
    # the agent's POSIX locks, and SQLite could then hand the agent a stale snapshot.
    title = title or ("gpumesh node process" if detached else "gpumesh-control")
    own = not isinstance(home_arg, Node)
    node = home_arg if isinstance(home_arg, Node) else Node(home_arg)
    info = node.info()  # a home without an identity is refused here, in one line
    home = node.home.path
    tcp_address = None
    if listen is not None:
        host, port = parse_listen(listen)
        if not auth.is_loopback(host.lower()):
            if not allow_remote:
                raise ConfigError(
                    f"{listen} is not a loopback address: the API is served on loopback unless "
                    "--allow-remote says otherwise (and then only with a token)"
                )
            hosts.append(host.lower())
        tcp_address = (host, port)
    if allow_remote:
        _check_remote(tls)
    context = None if tls is None or listen is None else tls_context(*tls)
    guard = Guard(limits().fitted(raise_descriptor_limit()))
    # Where the system has no unix sockets, the owner's way in is loopback TCP
    # with the home's token (the CLI reads the address from the home's record).
    unix = platform.has("unix")
    local_tcp = tcp_address is None and not unix
    if local_tcp:
        tcp_address = ("127.0.0.1", 0)
    previous_end = last_share_end(home)  # before this process's record replaces it
    # In a thread: a background node process may take a moment to hand over.
    lock, taken = await asyncio.to_thread(_take_home, home, detached=detached)
    if share is None and taken is not None:
        share = taken
        announce(f"  it shares, as the node process it took over did ({share.describe()})")
    record: NodeRecord | None = None
    sockets: list[socket.socket] = []
    socket_path = home / "control.sock"
    try:
        public_url = ""
        if tcp_address is not None:
            tcp = tcp_listener(*tcp_address)
            sockets.append(tcp)
            public_url = _url_of(tcp, secure=context is not None)
        if unix:
            sockets.insert(0, unix_listener(home))
        api = [*([str(socket_path)] if unix else []), *([public_url] if public_url else [])]
        process = NodeProcess(
            home=home,
            detached=detached,
            api=api,
            tcp=bool(public_url) and not local_tcp,
            idle=idle_limit() if detached and (local_tcp or not public_url) else None,
            version=env(ENV_TEST_NODE_VERSION) or __version__,
        )
        record = NodeRecord(
            pid=os.getpid(),
            version=process.version,
            started_at=time.time(),
            api=api,
            tcp=process.tcp,
            share_ended=previous_end,
        )

        def write_record() -> None:
            nonlocal record
            assert record is not None
            shared = process.sharing
            active = shared is not None and shared.active
            ended = None if active or shared is None else shared.ended
            record = replace(
                record,
                api=list(process.api),
                tcp=process.tcp,
                sharing_since=shared.since if shared is not None and active else None,
                share_ended=None if ended is None else (ended.at, ended.how),
            )
            lock.write(record)

        lan: LanDiscovery | None = None

        def share_changed() -> None:
            write_record()
            if lan is not None:
                lan.wake()  # announce the new port at once

        process.sharing = Sharing(
            node,
            None if previous_end is None else ShareEnd(*previous_end),
            echo=echo,
            on_change=share_changed,
        )
        process.unfinished = functools.partial(_unfinished, node.home)

        # One socket and one relay registration per relay for every outgoing link.
        outgoing = OutgoingSocket(lambda: node.home.identity)
        process.pool = node.pool = SessionPool(outgoing=outgoing)
        node.pool.on_silent = node.silent_providers.went_silent
        # Submitted jobs' outputs come home here, those still coming from the start.
        receivers = node.outputs = OutputsReceivers(node)
        receivers.resume()
        # Jobs that may move, or wait in the queue, are kept here.
        jobs_keeper = node.keeper = JobKeeper(node)
        jobs_keeper.resume()

        def shell_busy(change: int) -> None:
            process.active += change
            process.last_active = process.clock()

        state = ControlState(
            node=node,
            token=auth.api_token(home),
            host_names=frozenset(hosts),
            public_url=public_url,
            process=process,
            shells=Shells(home, busy=shell_busy),
        )
        write_record()
        app = process.wrap(create_app(state))
        late: list[asyncio.Future[None]] = []

        async def serve_tcp(listen: str) -> None:
            if process.tcp:
                return
            host, port = parse_listen(listen)
            if not auth.is_loopback(host.lower()):
                raise ConfigError(
                    f"{listen} is not a loopback address: a running node process serves TCP on "
                    f"loopback only (set {ENV_API_ADDR} to one, such as {API_ADDR_DEFAULT}); "
                    "for a bind beyond it, run `gpumesh-control --allow-remote` instead"
                )
            try:
                tcp = tcp_listener(host, port)
            except InUseError:
                raise InUseError(
                    f"TCP {listen} is taken by another program: set {ENV_API_ADDR} to a free "
                    "address, such as 127.0.0.1:8081, and run the command again"
                ) from None
            sockets.append(tcp)
            url = _url_of(tcp)
            state.public_url = url
            process.api.append(url)
            process.tcp = True
            process.idle = None
            write_record()
            late.append(asyncio.ensure_future(serve(app, [tcp], process.stop, guard)))
            announce(
                f"  http         {url}/api/v1/ (asked to serve TCP; it now stays until stopped)"
            )

        process.serve_tcp = serve_tcp
        loop = asyncio.get_running_loop()
        # Through platform: Windows' loop has no add_signal_handler.
        undo = [
            platform.add_signal_handler(
                loop, sig, functools.partial(process.end, f"the node process got {sig.name}")
            )
            for sig in (signal.SIGINT, signal.SIGTERM)
        ]
        announce(f"{title}: the control API of {info.name} ({home}), pid {os.getpid()}")
        if unix:
            announce(f"  unix socket  {socket_path} (owner only, no token needed)")
        if public_url:
            where = f"${ENV_API_TOKEN}" if env(ENV_API_TOKEN) else str(home / auth.TOKEN_FILE)
            announce(f"  http         {public_url}/api/v1/ (Authorization: Bearer, from {where})")
            code = state.sessions.new_code()
            announce(f"  browser      {state.login_url(code)} (one-time login)")
        announce("  OpenAPI      /api/v1/openapi.json; stop with Ctrl-C")
        watcher = asyncio.ensure_future(_watch(process))
        keeper = asyncio.ensure_future(process.pool.maintain(node.home.store))
        # Paired peers on the same network, found with no server (the share's port
        # is announced while it runs).
        lan_peers = LanPeers(node)
        lan = _lan_discovery(node, lan_peers, process.sharing)
        discovery = None if lan is None else asyncio.ensure_future(lan.run())
        failed: list[GPUMeshError] = []
        sharer = None
        if share is not None:
            sharer = asyncio.ensure_future(_share_from_start(process, share, failed))
        if context is not None and unix:
            # TLS is TCP's: the unix socket beside it stays plain.
            late.append(asyncio.ensure_future(serve(app, sockets[:1], process.stop, guard)))
            served = sockets[1:]
        else:
            served = list(sockets)
        try:
            await serve(app, served, process.stop, guard, context)
            for task in late:
                await task
        finally:
            process.serve_tcp = None
            if sharer is not None:
                sharer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sharer
            if process.sharing.active:
                await process.sharing.stop(process.stopping or "the node process stopped")
            if discovery is not None:
                discovery.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await discovery
            await lan_peers.stop()
            await jobs_keeper.stop()
            node.keeper = None
            await receivers.stop()
            node.outputs = None
            for task in (watcher, keeper, *late):
                task.cancel()
            for task in (keeper, *late):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for restore in undo:
                restore()
    finally:
        for sock in sockets:
            sock.close()
        if sockets and unix:
            with contextlib.suppress(OSError):
                socket_path.unlink(missing_ok=True)
        lock.release(last=record)
        node.pool = None
        if own:
            node.close()
    announce(f"{title}: stopped")
    if failed:
        raise failed[0]
    return 0


async def _share_from_start(
    process: NodeProcess, options: ShareOptions, failed: list[GPUMeshError]
) -> None:
    """Share as the process starts; a share that cannot start ends the process."""
    assert process.sharing is not None
    try:
        await process.sharing.start(options)
    except GPUMeshError as exc:
        failed.append(exc)
        process.end("its share did not start")


def _lan_discovery(node: Node, peers: LanPeers, sharing: Sharing) -> LanDiscovery | None:
    """LAN discovery as the home's settings say (None: ``lan_discovery`` is off)."""
    config = node.home.config
    if not config.lan_discovery:
        return None
    settings = LanSettings(config.lan_port, config.lan_interval, config.lan_reprobe)
    return LanDiscovery(
        settings, peers=peers.peers, serving_port=lambda: sharing.port, heard=peers.heard
    )


def _unfinished(home: Home) -> bool:
    """Whether ``home`` has jobs it hosts or submitted that have not ended, or whose
    outputs are still to come home."""
    store = home.store
    if store.receiving_outputs():
        return True
    return bool(store.unfinished_hosted_jobs()) or any(
        j.state not in FINAL_STATES and not j.provider_forgot
        for j in store.jobs(limit=1000, role=JobRole.SUBMITTED)
    )


def _url_of(tcp: socket.socket, *, secure: bool = False) -> str:
    bound = tcp.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    return f"{'https' if secure else 'http'}://{shown}:{bound[1]}"


def _check_remote(tls: tuple[Path, Path] | None) -> None:
    """What ``--allow-remote`` needs: a strong token of the user's own, and TLS
    (a token sent in plain HTTP is anybody's on the way)."""
    token = env(ENV_API_TOKEN)
    if not token:
        raise ConfigError(
            f"--allow-remote needs ${ENV_API_TOKEN} set to a token of your own, at least "
            f"{TOKEN_MIN} characters (such as the output of `openssl rand -hex 16`)"
        )
    if len(token) < TOKEN_MIN:
        raise ConfigError(
            f"${ENV_API_TOKEN} has {len(token)} characters and --allow-remote needs at least "
            f"{TOKEN_MIN} (128 bits): make one with `openssl rand -hex 16`"
        )
    if tls is None:
        raise ConfigError(
            "--allow-remote needs --tls-cert FILE and --tls-key FILE: the API is served beyond "
            "loopback over HTTPS only"
        )


async def _watch(process: NodeProcess) -> None:
    while not process.stop.is_set():
        reason = process.should_exit()
        if reason is not None:
            logger.info("node process exits: %s", reason)
            process.end(f"the node process exited: {reason}")
            return
        await asyncio.sleep(TICK)
