"""The control API's routes: parse a request, call the client layer, return a view.

Every route is one :class:`Endpoint` in :data:`ENDPOINTS` (method, path, who may
call it, the body it takes and the view it returns); the Starlette routes and
the OpenAPI document are both made from that table, so neither can list a route
the other lacks. Handlers hold no product logic: what the CLI does with the same
result lives in ``gpumesh.client``, and the JSON is the view struct the CLI's
``--json`` prints.

Who may call what (``auth.py`` has the rules): the unix socket is the owner's
and may call everything; over TCP a bearer token may call everything, a browser
session cookie (sent to the home's secret ``<random>.localhost`` name, and
nowhere else) everything but the routes that name local paths (copies, apps, a
job's local workdir), and nothing without a credential but the page, the login
exchange and the OpenAPI document. Errors are ``{"code", "message"}`` with the
error tree's stable codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gpumesh.client.bodies import (
    AppPullBody,
    AppRunBody,
    CancelBody,
    ConfigBody,
    CopyBody,
    DesktopShareBody,
    ExchangeBody,
    JobBody,
    PairBody,
    SyncBody,
    TcpBody,
)
from gpumesh.client.views import ErrorView
from gpumesh.client.views.apps import AppPullView
from gpumesh.client.views.node import LoginCodeView, PublishView
from gpumesh.control import auth
from gpumesh.control.dashboard import history, pages
from gpumesh.control.dashboard.pages import qr_svg
from gpumesh.control.endpoints import Access, Endpoint, Query
from gpumesh.control.guesses import TokenGuesses
from gpumesh.errors import (
    AccessDeniedError,
    AgentError,
    AmbiguousPeerError,
    BadRequestError,
    ConfigError,
    GPUMeshError,
    InUseError,
    LimitError,
    NotFoundError,
    PairingCodeError,
    PeerKeyChangedError,
    ProtocolError,
    RuntimeUnavailableError,
    TransportError,
    UnknownPeerError,
)
from gpumesh.version import VERSION_HEADER

if TYPE_CHECKING:
    from gpumesh.client.bodies import ShareOptions
    from gpumesh.client.node import Node
    from gpumesh.daemon.process import NodeProcess
    from gpumesh.daemon.sharing import Sharing
    from gpumesh.daemon.shells import Shells

__all__ = ["ENDPOINTS", "Call", "ControlState", "create_app"]

logger = logging.getLogger(__name__)

KEEPALIVE = 15.0
"""Seconds of silence after which an event stream sends a comment, so a client
that left is noticed and a proxy keeps the stream open."""


class Credential(enum.Enum):
    UNIX = "unix"
    BEARER = "bearer"
    COOKIE = "cookie"
    NONE = "none"


@dataclass
class ControlState:
    """What the routes share: the node, the token, the browser sessions."""

    node: Node
    token: str
    sessions: auth.Sessions = field(default_factory=auth.Sessions)
    host_names: frozenset[str] = frozenset()
    """Names besides loopback that ``Host`` may carry (a non-loopback bind's)."""
    public_url: str = ""
    """``http://host:port`` of the TCP listener, for login URLs."""
    gpu_history: history.GpuHistory = field(default_factory=history.GpuHistory.from_env)
    """The last hour of GPU readings, sampled from the first request on."""
    process: NodeProcess | None = None
    """The node process serving this API (its status, its stop)."""
    shells: Shells | None = None
    """``gpumesh exec`` sessions run here (the node process's)."""
    guesses: TokenGuesses = field(default_factory=TokenGuesses.from_env)
    """Wrong bearer tokens per address: 429 after a few in a row."""

    @property
    def dashboard_host(self) -> str:
        """The home's secret ``<random>.localhost`` name its browser sessions live at."""
        return auth.dashboard_host(self.token)

    @property
    def cookie_hosts(self) -> frozenset[str]:
        """The ``Host`` names a session cookie counts on: the dashboard's secret name,
        and a non-loopback bind's configured names (a remote browser's)."""
        return self.host_names | {self.dashboard_host}

    def login_url(self, code: str) -> str:
        """The one-time sign-in URL for ``code``: at the dashboard's secret name when
        the listener is on loopback (where the session cookie will count), else at
        the listener's own address."""
        scheme, _, address = self.public_url.partition("://")
        name, _, port = address.rpartition(":")
        if auth.is_loopback(auth.host_name(address)):
            address = f"{self.dashboard_host}:{port}" if name else self.dashboard_host
        return f"{scheme}://{address}/#code={code}"


class Refusal(Exception):
    """A request refused before it reached the client layer: an HTTP status and an
    error of the tree (its code and message are the body)."""

    def __init__(self, status: int, error: GPUMeshError) -> None:
        super().__init__(error.message)
        self.status = status
        self.error = error


@dataclass
class Call:
    """One request, authorised: what a handler reads."""

    request: Request
    state: ControlState
    credential: Credential
    body: Any = None

    @property
    def node(self) -> Node:
        return self.state.node

    @property
    def signed_in(self) -> bool:
        """Whether the caller holds a credential (a page shows data only then)."""
        return self.credential is not Credential.NONE

    def param(self, name: str) -> str:
        return str(self.request.path_params[name])

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.request.query_params.get(name)
        if value is None:
            return default
        if value.lower() in ("1", "true", "yes", ""):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise BadRequestError(f"query parameter {name}={value!r}: use true or false")

    def number(self, name: str, default: int, *, least: int = 0, most: int = 10_000) -> int:
        value = self.request.query_params.get(name)
        if value is None:
            return default
        try:
            number = int(value)
        except ValueError:
            raise BadRequestError(f"query parameter {name}={value!r} is not a number") from None
        if not least <= number <= most:
            raise BadRequestError(f"query parameter {name} must be {least} to {most}")
        return number

    def refuse_cookie(self, what: str) -> None:
        if self.credential is Credential.COOKIE:
            raise Refusal(
                403,
                AccessDeniedError(
                    f"{what} names a path on this machine: only the unix socket or a bearer "
                    "token may, never a browser session"
                ),
            )


# --- request bodies: unknown fields are refused (a typo must not pass silently) ----------


# --- handlers ----------------------------------------------------------------------------


async def get_status(call: Call) -> object:
    from gpumesh.client.jobs import refresh_jobs
    from gpumesh.client.views.node import StatusView

    node = call.node
    unknown: set[str] = set()
    if not call.flag("offline") and node.home.store.unconfirmed_submitted_jobs():
        for answer in await refresh_jobs(node):
            unknown |= answer.job_ids
    return StatusView.of(node.status(), submitted_unknown=len(unknown))


async def get_gpus(call: Call) -> object:
    from gpumesh.client.views.node import GpusView
    from gpumesh.gpu.inventory import detect_inventory

    inventory = detect_inventory()
    return GpusView.of(inventory, inventory.gpus())


async def get_peers(call: Call) -> object:
    from gpumesh.client.views.peers import PeerView

    return [PeerView.of(p) for p in call.node.peers()]


async def post_pair(call: Call) -> object:
    from gpumesh.client.views.peers import PairView

    body: PairBody = call.body
    peer = call.node.pair(body.code.strip(), rekey=body.rekey)
    check = None
    if not body.offline and (peer.addresses or peer.relay):
        check = await call.node.check_paired_back(peer.name)
    return PairView.of(peer, check)


async def get_pairing_code(call: Call) -> object:
    from gpumesh.client.views.peers import PairingCodeView
    from gpumesh.identity.codes import verify_code

    code = call.node.pairing_code()
    return PairingCodeView.of(code, verify_code(code))


async def get_pairing_qr(call: Call) -> object:
    """The QR code of a pairing code of this node's (``code``), or of a fresh one."""
    from gpumesh.identity.codes import verify_code

    code = call.request.query_params.get("code") or call.node.pairing_code()
    try:
        offer = verify_code(code)
    except PairingCodeError as exc:
        raise BadRequestError(f"code: {exc.message}") from None
    if offer.public_key != call.node.home.identity.public_key:
        raise BadRequestError("code: not a pairing code of this node")
    return Response(qr_svg(code), media_type="image/svg+xml")


async def post_allow(call: Call) -> object:
    from gpumesh.client.views.peers import PeerView

    return PeerView.of(call.node.allow(call.param("peer")))


async def post_deny(call: Call) -> object:
    from gpumesh.client.views.peers import PeerView

    return PeerView.of(call.node.deny(call.param("peer")))


async def post_desktop_allow(call: Call) -> object:
    from gpumesh.client.desktop import allow_desktop
    from gpumesh.client.views.peers import PeerView

    return PeerView.of(allow_desktop(call.node, call.param("peer")))


async def post_desktop_deny(call: Call) -> object:
    from gpumesh.client.desktop import deny_desktop
    from gpumesh.client.views.peers import PeerView

    return PeerView.of(deny_desktop(call.node, call.param("peer")))


async def post_cuda_allow(call: Call) -> object:
    from gpumesh.client.views.peers import PeerView
    from gpumesh.cuda.ops import allow

    return PeerView.of(allow(call.node, call.param("peer")))


async def post_cuda_deny(call: Call) -> object:
    from gpumesh.client.views.peers import PeerView
    from gpumesh.cuda.ops import deny

    return PeerView.of(deny(call.node, call.param("peer")))


async def post_desktop_share(call: Call) -> object:
    """Offer the desktop server on 127.0.0.1:``port`` (a new port cuts the old one's
    connections)."""
    from gpumesh.client.desktop import share_desktop
    from gpumesh.client.views.owner import DesktopShareView
    from gpumesh.protocol.desktop import DesktopKind

    body: DesktopShareBody = call.body
    shared = share_desktop(call.node, DesktopKind(body.kind), body.port)
    sharing = call.node.home.agent is not None
    return DesktopShareView(True, str(shared.kind), shared.port, sharing)


async def delete_desktop_share(call: Call) -> object:
    """Stop offering the desktop; its open connections are cut."""
    from gpumesh.client.desktop import stop_desktop_share
    from gpumesh.client.views.owner import DesktopShareView

    stopped = stop_desktop_share(call.node)
    return DesktopShareView(stopped, sharing=call.node.home.agent is not None)


async def post_cuda_share(call: Call) -> object:
    return _set_cuda_share(call, True)


async def delete_cuda_share(call: Call) -> object:
    """Stop offering CUDA sessions; open ones end."""
    return _set_cuda_share(call, False)


def _set_cuda_share(call: Call, on: bool) -> object:
    from gpumesh.client.views.owner import CudaShareView
    from gpumesh.cuda.ops import share

    share(call.node, on)
    return CudaShareView(on, sharing=call.node.home.agent is not None)


async def put_config(call: Call) -> object:
    """Set one setting (``config set``): a running share sees it at once."""
    from gpumesh.client.views.node import ConfigChangeView

    body: ConfigBody = call.body
    key, config = call.param("key"), call.node.home.config
    config.set(key, body.value)
    config.save()
    return ConfigChangeView.of(call.node.home, key)


async def delete_config(call: Call) -> object:
    """Return one setting to its default (``config unset``)."""
    from gpumesh.client.views.node import ConfigChangeView

    key, config = call.param("key"), call.node.home.config
    config.unset(key)
    config.save()
    return ConfigChangeView.of(call.node.home, key)


async def post_connect(call: Call) -> object:
    """The path to a peer, on the warm session to it when there is one (dialled now
    when not, and kept warm for the next request); ``fresh``: a new dial all the
    same, timed whole and closed after; ``speed``: bytes to push too."""
    from gpumesh.client.views.peers import ConnectView

    pings = call.number("pings", 5, least=1, most=100)
    size = call.number("speed", 0, most=2**62)
    timeout = call.request.query_params.get("timeout")
    seconds = None
    if timeout is not None:
        try:
            seconds = float(timeout)
        except ValueError:
            raise BadRequestError(f"query parameter timeout={timeout!r} is not a number") from None
        if not 0 < seconds <= 3600:
            raise BadRequestError("query parameter timeout must be above 0 and at most 3600")
    peer = call.param("peer")
    fresh = call.flag("fresh")
    result = await call.node.connect(peer, pings=pings, timeout=seconds, fresh=fresh)
    throughput = await call.node.throughput(peer, size) if size else None
    return ConnectView.of(result, throughput)


async def get_jobs(call: Call) -> object:
    from gpumesh.client.jobs import refresh_jobs
    from gpumesh.client.views.joblist import JobListEntry

    node = call.node
    limit = call.number("limit", 20, least=1, most=1000)
    unconfirmed: dict[str, str] = {}
    if not call.flag("offline") and node.home.store.unconfirmed_submitted_jobs(limit):
        for answer in await refresh_jobs(node, limit=limit):
            unconfirmed.update(dict.fromkeys(answer.job_ids, answer.reason))
    return [JobListEntry.of(j, unconfirmed) for j in node.home.store.jobs(limit=limit)]


async def get_job(call: Call) -> object:
    from gpumesh.client.jobs import find_job
    from gpumesh.client.views.joblist import JobListEntry

    return JobListEntry.of(find_job(call.node, call.param("job_id")), {})


async def post_job(call: Call) -> object:
    """Submit a job to a peer or to the best member of a group; returns once the
    provider accepted it (follow it with the events route)."""
    from gpumesh.client.jobs import run_job
    from gpumesh.client.jobspec import build_spec
    from gpumesh.client.views.jobs import JobResultView

    body: JobBody = call.body
    if body.workdir is not None:
        call.refuse_cookie("workdir")
    if not body.peer and not body.group:
        raise BadRequestError(
            "The job names no place to run: give `peer` (a paired node) or `group`."
        )
    spec = build_spec(
        image=body.image,
        command=body.command,
        env_items=[f"{k}={v}" for k, v in body.env.items()],
        workdir=body.workdir,
        gpu_memory=body.gpu_memory,
        retries=body.retries,
        timeout=body.timeout,
        peer=body.peer,
        group=body.group,
        mounts=body.mounts,
    )
    if call.flag("stream"):
        from gpumesh.client.runs import watch_run

        return EventStream(_run_events(watch_run(call.node, spec, wait=body.wait)))
    return JobResultView.of(await run_job(call.node, spec, detach=True, wait=body.wait))


async def _run_events(run: Any) -> AsyncIterator[bytes]:
    """A run as Server-Sent Events: its steps (``placedview``, ``pullingview``,
    ``acceptedview``, ``uploadingview``), then the job's events as the events route
    sends them (numbered: resume that route with ``after``), then ``end``. Leaving
    early cancels a submission still under way (an accepted job keeps running)."""
    from gpumesh.client.views.jobs import JobResultView

    try:
        async for event in run:
            yield _run_event(event, run.seq)
        yield sse("end", JobResultView.of(run.result))
    except GPUMeshError as exc:
        yield sse("error", ErrorView(exc.code, exc.message))
    finally:
        await run.aclose()


async def post_cancel(call: Call) -> object:
    from gpumesh.client.jobs import cancel
    from gpumesh.client.views.jobs import JobResultView

    body: CancelBody = call.body
    return JobResultView.of(await cancel(call.node, call.param("job_id"), peer=body.peer))


async def get_job_events(call: Call) -> object:
    """A job's events as Server-Sent Events. Each output and status event carries
    its sequence number as the event's id: a client that reconnects with
    ``Last-Event-ID`` (as a browser's EventSource does) or ``after`` resumes right
    after it. The stream ends with an ``end`` event (the job's result), or an
    ``error`` event."""
    from gpumesh.client.jobs import find_job, logs

    job = find_job(call.node, call.param("job_id"))  # an unknown job is a plain 404
    after = call.number("after", 0, most=2**62)
    last = call.request.headers.get("last-event-id")
    if last is not None:
        try:
            after = max(0, int(last))
        except ValueError:
            raise BadRequestError(f"Last-Event-ID {last!r} is not a sequence number") from None
    follow = logs(call.node, job.job_id, follow=call.flag("follow", True), after_seq=after)
    return EventStream(_job_events(follow))


def _run_event(event: Any, seq: int) -> bytes:
    """One event of a run (a step of its submission, or the job's own) as an SSE
    event; only output and status events carry ``seq`` as their id."""
    from gpumesh.client import jobs
    from gpumesh.client.views.jobs import event_view
    from gpumesh.client.views.runs import step_view

    step = step_view(event)
    if step is not None:
        return sse(type(step).__name__.lower(), step)
    view = event_view(event, seq)
    numbered = isinstance(event, jobs.Output | jobs.StatusChanged)
    return sse(type(view).__name__.lower(), view, seq if numbered else None)


KEEP_ALIVE = object()
"""What :func:`_paced` yields when its source was silent for :data:`KEEPALIVE` seconds."""


async def _paced(source: Any) -> AsyncGenerator[Any, None]:
    """``source``'s events, with :data:`KEEP_ALIVE` after every :data:`KEEPALIVE`
    seconds of silence (a long sync or a quiet job), so proxies and browsers keep
    the stream open; closing this closes ``source``."""
    it = aiter(source)
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            finally:
                if pending.done():
                    pending = None
            yield event
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await source.aclose()


async def _job_events(follow: Any) -> AsyncIterator[bytes]:
    from gpumesh.client import jobs
    from gpumesh.client.views.jobs import JobResultView, event_view

    events = _paced(follow)
    try:
        async for event in events:
            if event is KEEP_ALIVE:
                yield b": keep-alive\n\n"
                continue
            view = event_view(event, follow.seq)
            # Only output and status events are resumable points: a drop notice
            # shares its output's number and a reconnect has none.
            numbered = isinstance(event, jobs.Output | jobs.StatusChanged)
            yield sse(type(view).__name__.lower(), view, follow.seq if numbered else None)
        yield sse("end", JobResultView.of(follow.result))
    except GPUMeshError as exc:
        yield sse("error", ErrorView(exc.code, exc.message))
    finally:
        await events.aclose()


def sse(event: str, data: object, event_id: int | None = None) -> bytes:
    """One Server-Sent Event: its name, id (when it has one) and JSON data on one line."""
    head = f"event: {event}\n" + ("" if event_id is None else f"id: {event_id}\n")
    return head.encode() + b"data: " + msgspec.json.encode(data, enc_hook=str) + b"\n\n"


async def get_groups(call: Call) -> object:
    from gpumesh.client.groups import summaries
    from gpumesh.client.views.groups import GroupListEntry

    return [GroupListEntry.of_summary(s) for s in summaries(call.node)]


async def get_members(call: Call) -> object:
    from gpumesh.client.groups import group_status
    from gpumesh.client.views.groups import MemberStatusEntry

    statuses = await group_status(call.node, call.param("group"), live=not call.flag("offline"))
    return [MemberStatusEntry.of_status(s) for s in statuses]


async def post_copy(call: Call) -> object:
    """A copy; with ``stream``, its progress as Server-Sent Events (``copystarted``,
    ``copyprogress``, ``copyretrying``), then ``end`` (the copy's view) or ``error``.
    Leaving the stream stops the copy where it is (the next one resumes there)."""
    from gpumesh.client.files import RETRIES, CopyCallbacks, copy
    from gpumesh.client.views.files import (
        CopyProgressView,
        CopyRetryingView,
        CopyStartedView,
        CopyView,
    )

    body: CopyBody = call.body
    if body.retries is not None and not 0 <= body.retries <= 20:
        raise BadRequestError("retries must be 0 to 20")
    source, destination, shown = _local_side(body)

    async def work(feed: Feed) -> object:
        def started(label: str, total: int) -> None:
            feed.put("copystarted", CopyStartedView(shown(label), total))

        def progress(done: int, total: int) -> None:
            feed.put("copyprogress", CopyProgressView(done, total), latest=True)

        def retrying(error: GPUMeshError, attempt: int) -> None:
            feed.put("copyretrying", CopyRetryingView(str(error), attempt))

        result = await copy(
            call.node,
            source,
            destination,
            retries=RETRIES if body.retries is None else body.retries,
            callbacks=CopyCallbacks(started=started, progress=progress, retrying=retrying),
            fast_path=body.fast_path,
        )
        view = CopyView.of(result)
        view.local = shown(view.local)
        return view

    if call.flag("stream"):
        return EventStream(feed_events(work))
    return await work(Feed())


def _local_side(body: CopyBody) -> tuple[str, str, Callable[[str], str]]:
    """``body``'s source and destination with a relative local path made absolute
    from ``cwd``, and a function that shows that absolute path as the caller wrote it."""
    import os

    from gpumesh.client.files import parse_location

    source, destination = body.source, body.destination
    if body.cwd is None:
        return source, destination, lambda text: text
    if not os.path.isabs(body.cwd):
        raise BadRequestError(f"cwd {body.cwd!r} is not an absolute path")
    local = destination if parse_location(source).peer is not None else source
    if os.path.isabs(local) or parse_location(local).peer is not None:
        return source, destination, lambda text: text
    absolute = os.path.join(body.cwd, local)
    written = str(Path(local))
    norm = str(Path(absolute))
    if local == source:
        source = absolute
    else:
        destination = absolute

    def shown(text: str) -> str:
        parts = text.split(" -> ")
        for i, part in enumerate(parts):
            if part == norm:
                parts[i] = written
            elif part.startswith(norm.rstrip(os.sep) + os.sep):
                parts[i] = os.path.join(written, part[len(norm.rstrip(os.sep)) + 1 :])
        return " -> ".join(parts)

    return source, destination, shown


class Feed:
    """What a long call reports while it runs, for :func:`feed_events`: named
    events in order; a ``latest`` one replaces one of its name not yet sent (a
    progress figure the client has not seen need not be sent)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, object]] = []
        self.ready = asyncio.Event()

    def put(self, name: str, data: object, *, latest: bool = False) -> None:
        if latest and self.items and self.items[-1][0] == name:
            self.items[-1] = (name, data)
        else:
            self.items.append((name, data))
        self.ready.set()


async def feed_events(work: Callable[[Feed], Awaitable[object]]) -> AsyncIterator[bytes]:
    """Server-Sent Events of ``work``: what it puts in its feed, then ``end`` with
    what it returns, or ``error``. The stream's end (the client left) cancels it."""
    feed = Feed()
    task = asyncio.ensure_future(work(feed))
    try:
        while True:
            waiter = asyncio.ensure_future(feed.ready.wait())
            try:
                done, _ = await asyncio.wait(
                    {task, waiter}, timeout=KEEPALIVE, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                waiter.cancel()
            finished = task.done()
            feed.ready.clear()
            items, feed.items = feed.items, []
            for name, data in items:
                yield sse(name, data)
            if finished:
                break
            if not done:
                yield b": keep-alive\n\n"
        yield sse("end", task.result())
    except GPUMeshError as exc:
        yield sse("error", ErrorView(exc.code, exc.message))
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def post_app_sync(call: Call) -> object:
    from gpumesh.client.apps import sync_app
    from gpumesh.client.views.apps import SyncView

    body: SyncBody = call.body
    result = await sync_app(
        call.node, body.peer, Path(body.dir), name=body.name, dry_run=body.dry_run
    )
    return SyncView.of(result)


def _absolute(what: str, path: str) -> Path:
    """A local path of a request: absolute, since the caller's folder is not ours."""
    if not Path(path).is_absolute():
        raise BadRequestError(f"{what} {path!r} is not an absolute path")
    return Path(path)


async def post_app_run(call: Call) -> object:
    """Sync a local folder, run a job in it, pull a folder back: Server-Sent Events
    ``syncview``, the job's steps and events as the jobs route streams them
    (numbered: resume a dropped stream with the job's events route, ``after`` the
    last number read), then ``end`` (the app run's view) or ``error``. The job's
    output is paced by the reader (nothing piles up here). Leaving the stream
    stops following (the job keeps running)."""
    from gpumesh.client.apprun import watch_app_run
    from gpumesh.client.jobspec import build_spec

    body: AppRunBody = call.body
    folder = _absolute("dir", body.dir)
    out = None if body.out is None else _absolute("out", body.out)
    spec = build_spec(
        None,
        image=body.image,
        command=body.command or None,
        env_items=[f"{k}={v}" for k, v in body.env.items()],
        gpu_memory=body.gpu_memory,
        retries=body.retries,
        timeout=body.timeout,
        peer=body.peer,
        mounts=body.mounts,
    )
    return EventStream(_app_run_events(watch_app_run(call.node, body.peer, folder, spec, out=out)))


async def _app_run_events(run: Any) -> AsyncIterator[bytes]:
    """An app run (:class:`gpumesh.client.apprun.AppRunWatch`) as Server-Sent Events,
    with a keep-alive comment while it is silent (a long sync or a quiet job)."""
    from gpumesh.client import apprun
    from gpumesh.client.views.apps import AppRunView, SyncView

    events = _paced(run)
    try:
        async for event in events:
            if event is KEEP_ALIVE:
                yield b": keep-alive\n\n"
                continue
            if isinstance(event, apprun.Synced):
                yield sse("syncview", SyncView.of(event.sync))
                continue
            yield _run_event(event, run.seq)
        yield sse("end", AppRunView.of(run.result))
    except GPUMeshError as exc:
        yield sse("error", ErrorView(exc.code, exc.message))
    finally:
        await events.aclose()


async def post_app_pull(call: Call) -> object:
    from gpumesh.client.apps import app_job, job_folder, pull_folder, pull_job

    body: AppPullBody = call.body
    dest = _absolute("dir", body.dir)
    peer, job = app_job(call.node, body.job, body.peer)
    if not body.folder:
        remote, size = await pull_job(call.node, peer.node_id, job, dest)
        return AppPullView(remote, size, peer.name, job)
    if body.folder in (".", "..") or "/" in body.folder or "\\" in body.folder:
        raise BadRequestError(f"folder {body.folder!r} is not a folder name")
    remote = f"{await job_folder(call.node, peer.node_id, job)}/{body.folder}"
    size = await pull_folder(call.node, peer.node_id, remote, dest)
    return AppPullView(remote, size, peer.name, job)


async def post_shell(call: Call) -> object:
    """A shell on a peer, run by this process: where to connect for its bytes
    (:mod:`gpumesh.daemon.shells`)."""
    from gpumesh.client.bodies import ShellRequest

    state = call.state
    body: ShellRequest = call.body
    from gpumesh.client.jobspec import parse_env

    call.node.peer(body.peer)  # an unknown peer is refused now, not on the socket
    parse_env([f"{key}={value}" for key, value in body.env.items()])  # `--env`'s checks
    if body.gpu_memory < 0 or body.rows < 0 or body.cols < 0:
        raise BadRequestError("gpu_memory, rows and cols cannot be negative")
    if state.shells is None:
        raise AgentError("this control API is not served by a node process")
    return await state.shells.offer(call.node, body)


async def get_owner(call: Call) -> object:
    from gpumesh.client.owner import owner_view
    from gpumesh.client.views.owner import OwnerStatusView

    return OwnerStatusView.of(owner_view(call.node, limit=call.number("limit", 50, least=1)))


async def _end_session(call: Call, kind: str) -> object:
    from gpumesh.client.owner import SessionKind, end_session
    from gpumesh.client.views.owner import EndedSessionView

    ended = await end_session(call.node, SessionKind(kind), call.param("session"))
    return EndedSessionView.of(ended)


async def post_end_shell(call: Call) -> object:
    return await _end_session(call, "shell")


async def post_end_desktop(call: Call) -> object:
    return await _end_session(call, "desktop")


async def post_end_cuda(call: Call) -> object:
    return await _end_session(call, "cuda")


async def post_session(call: Call) -> object:
    """Exchange a one-time login code for a browser session cookie."""
    body: ExchangeBody = call.body
    if not _cookie_host(call.request, call.state):
        # Checked before the code is spent: the owner may still follow the right URL.
        raise Refusal(
            403,
            AccessDeniedError(
                "sign in through the URL `gpumesh dashboard` prints: a session cookie counts "
                "only at the host name in it"
            ),
        )
    session = call.state.sessions.exchange(body.code)
    if session is None:
        raise Refusal(401, AccessDeniedError("that login code is unknown, used or expired"))
    response = Response(status_code=204)
    response.set_cookie(
        auth.COOKIE,
        session,
        max_age=int(auth.SESSION_TTL),
        path="/",
        httponly=True,
        samesite="strict",
    )
    return response


async def delete_session(call: Call) -> object:
    call.state.sessions.end(call.request.cookies.get(auth.COOKIE))
    response = Response(status_code=204)
    response.delete_cookie(auth.COOKIE, path="/", httponly=True, samesite="strict")
    return response


async def post_login_code(call: Call) -> object:
    """A one-time login URL for a browser (the code is in its fragment, which
    browsers never send to a server or put in a Referer)."""
    if not call.state.public_url:
        raise AgentError("this control server does not listen on TCP: no browser can log in")
    code = call.state.sessions.new_code()
    return LoginCodeView(call.state.login_url(code), auth.CODE_TTL)


async def get_openapi(call: Call) -> object:
    from gpumesh.control.openapi import document

    return Response(document(ENDPOINTS), media_type="application/json")


async def get_gpu_history(call: Call) -> object:
    """The last hour of this machine's GPU readings, sampled by this process."""
    call.state.gpu_history.start()
    return call.state.gpu_history.view()


# --- the node process (gpumesh.daemon) ----------------------------------------------------


def _process(call: Call) -> NodeProcess:
    if call.state.process is None:
        raise AgentError("this control API is not served by a node process")
    return call.state.process


async def get_node(call: Call) -> object:
    view = _process(call).view()
    # The version in a header too: a command's check of it reads no body.
    return Response(
        msgspec.json.encode(view),
        media_type="application/json",
        headers={VERSION_HEADER: view.version},
    )


async def post_node_stop(call: Call) -> object:
    """Stop the node process once this answer is sent (open streams end; a share
    it runs stops first)."""
    process = _process(call)
    why = "the node process was stopped (`gpumesh daemon stop`)"
    asyncio.get_running_loop().call_soon(process.end, why)
    return process.view()


async def post_node_tcp(call: Call) -> object:
    """Serve this API on TCP too (a dashboard's way in); the node process then stays
    until stopped. Nothing changes when it serves TCP already."""
    from gpumesh.settings import API_ADDR_DEFAULT, ENV_API_ADDR, env

    process = _process(call)
    if process.serve_tcp is None:
        raise AgentError("this node process is stopping: run the command again")
    body: TcpBody = call.body
    await process.serve_tcp(body.listen or env(ENV_API_ADDR) or API_ADDR_DEFAULT)
    return process.view()


# --- sharing (gpumesh.daemon.sharing) ----------------------------------------------------


def _sharing(call: Call) -> Sharing:
    sharing = _process(call).sharing
    if sharing is None:
        raise AgentError("this node process is stopping: run the command again")
    return sharing


async def get_share(call: Call) -> object:
    return _sharing(call).view()


async def post_share(call: Call) -> object:
    """Share with the body's options (``{}``: the defaults); the running share when
    it has the same options; 409 when it has others. Answers once peers are served
    and the share's start is reported (its output, from ``first_line``)."""
    options: ShareOptions = call.body
    try:
        options.check()
    except ConfigError as exc:
        raise Refusal(422, exc) from None
    return await _sharing(call).start(options)


async def delete_share(call: Call) -> object:
    """Stop sharing (withdrawn from the registry, links closed); the share as it ended."""
    sharing = _sharing(call)
    how = "stopped from the dashboard" if call.credential is Credential.COOKIE else None
    if not await (sharing.stop(how) if how else sharing.stop()):
        raise NotFoundError(f"{call.node.home.path} does not share: start with `gpumesh share`")
    return sharing.view()


async def post_share_publish(call: Call) -> object:
    """Refresh the share's registry listing or address record now (``gpumesh sync``)."""
    sharing = _sharing(call)
    return PublishView(sharing=sharing.active, published=sharing.republish(), pid=os.getpid())


async def get_share_output(call: Call) -> object:
    """What the share says, as Server-Sent Events: a ``line`` per line (its ``seq``
    is the event's id), then ``end`` (the share as it is then) when the share
    stops; without ``follow``, the lines there are now, then ``end``."""
    sharing = _sharing(call)
    after = call.number("after", 0, most=2**62)
    if not call.flag("follow", True):
        return EventStream(_lines_then(sharing.lines(after), sharing.view()))
    return EventStream(_share_events(sharing.follow(after)))


async def _lines_then(lines: list[Any], view: Any) -> AsyncIterator[bytes]:
    for line in lines:
        yield sse("line", line, line.seq)
    yield sse("end", view)


async def _share_events(follow: Any) -> AsyncIterator[bytes]:
    from gpumesh.control.shareviews import ShareLine

    events = _paced(follow)
    try:
        async for event in events:
            if event is KEEP_ALIVE:
                yield b": keep-alive\n\n"
            elif isinstance(event, ShareLine):
                yield sse("line", event, event.seq)
            else:
                yield sse("end", event)
    finally:
        await events.aclose()


def _views() -> dict[str, Any]:
    """The response types, imported only when the table is built."""
    from gpumesh.client.bodies import ShareOptions, ShellRequest
    from gpumesh.client.views import apps, files, groups, joblist, jobs, node, owner, peers
    from gpumesh.control.shareviews import ShareLine, ShareView
    from gpumesh.control.views import NodeProcessView, ShellOfferView

    return {
        "status": node.StatusView,
        "gpus": node.GpusView,
        "peers": list[peers.PeerView],
        "peer": peers.PeerView,
        "pair": peers.PairView,
        "code": peers.PairingCodeView,
        "connect": peers.ConnectView,
        "jobs": list[joblist.JobListEntry],
        "job": joblist.JobListEntry,
        "result": jobs.JobResultView,
        "event": jobs.Output | jobs.Status | jobs.Dropped | jobs.Reconnecting,
        "groups": list[groups.GroupListEntry],
        "members": list[groups.MemberStatusEntry],
        "copy": files.CopyView,
        "sync": apps.SyncView,
        "apprun": apps.AppRunView,
        "owner": owner.OwnerStatusView,
        "ended": owner.EndedSessionView,
        "desktopshare": owner.DesktopShareView,
        "configchange": node.ConfigChangeView,
        "cudashare": owner.CudaShareView,
        "history": history.GpuHistoryView,
        "process": NodeProcessView,
        "shell": ShellOfferView,
        "shellbody": ShellRequest,
        "share": ShareView,
        "shareoptions": ShareOptions,
        "shareline": ShareLine,
    }


V = _views()
_offline = Query("offline", "boolean", "Do not ask peers: local state only.")

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/", pages.overview_page, "Dashboard: overview (sign-in without a session)",
             None, Access.PUBLIC, media_type="text/html"),
    Endpoint("GET", "/peers", pages.peers_page, "Dashboard: peers", None, Access.PUBLIC,
             media_type="text/html"),
    Endpoint("GET", "/jobs", pages.jobs_page, "Dashboard: jobs", None, Access.PUBLIC,
             media_type="text/html"),
    Endpoint("GET", "/jobs/{job_id}", pages.job_page, "Dashboard: one job and its live log",
             None, Access.PUBLIC, media_type="text/html"),
    Endpoint("GET", "/groups", pages.groups_page, "Dashboard: groups", None, Access.PUBLIC,
             media_type="text/html"),
    Endpoint("GET", "/owner", pages.owner_page, "Dashboard: the owner's view", None,
             Access.PUBLIC, media_type="text/html"),
    Endpoint("GET", "/static/{name}", pages.static_file, "Dashboard: its scripts and styles",
             None, Access.PUBLIC, media_type="text/plain"),
    Endpoint("GET", "/static/vendor/{name}", pages.vendor_file,
             "Dashboard: vendored libraries (VENDORED.md lists them)", None, Access.PUBLIC,
             media_type="text/plain"),
    Endpoint("GET", "/api/v1/openapi.json", get_openapi, "This document", None, Access.PUBLIC),
    Endpoint("POST", "/api/v1/auth/session", post_session,
             "Exchange a one-time login code for a session cookie", None, Access.PUBLIC,
             body=ExchangeBody, status=204),
    Endpoint("DELETE", "/api/v1/auth/session", delete_session, "End a browser session", None,
             status=204),
    Endpoint("POST", "/api/v1/auth/login-codes", post_login_code,
             "A one-time login URL for a browser", LoginCodeView, Access.NO_COOKIE),
    Endpoint("GET", "/api/v1/status", get_status, "This node: identity, sharing, GPUs, jobs",
             V["status"], query=(_offline,)),
    Endpoint("GET", "/api/v1/gpus", get_gpus, "This machine's GPUs, read now", V["gpus"]),
    Endpoint("GET", "/api/v1/gpus/history", get_gpu_history,
             "The last hour of GPU readings, sampled by this process", V["history"]),
    Endpoint("GET", "/api/v1/peers", get_peers, "Paired peers", V["peers"]),
    Endpoint("POST", "/api/v1/peers/pair", post_pair, "Pair with a peer's code", V["pair"],
             body=PairBody),
    Endpoint("GET", "/api/v1/pairing-code", get_pairing_code,
             "A fresh pairing code of this node", V["code"]),
    Endpoint("GET", "/api/v1/pairing-code/qr.svg", get_pairing_qr,
             "A pairing code of this node as a QR code", None,
             query=(Query("code", "string", "A code of this node's; default: a fresh one"),),
             media_type="image/svg+xml"),
    Endpoint("POST", "/api/v1/peers/{peer}/allow", post_allow, "Allow a peer", V["peer"]),
    Endpoint("POST", "/api/v1/peers/{peer}/deny", post_deny,
             "Deny a peer: revokes everything at once", V["peer"]),
    Endpoint("POST", "/api/v1/peers/{peer}/desktop/allow", post_desktop_allow,
             "Put a peer on the desktop allowlist", V["peer"]),
    Endpoint("POST", "/api/v1/peers/{peer}/desktop/deny", post_desktop_deny,
             "Take a peer off the desktop allowlist: its desktop connections are cut",
             V["peer"]),
    Endpoint("POST", "/api/v1/peers/{peer}/cuda/allow", post_cuda_allow,
             "Put a peer on the CUDA allowlist", V["peer"]),
    Endpoint("POST", "/api/v1/peers/{peer}/cuda/deny", post_cuda_deny,
             "Take a peer off the CUDA allowlist: its CUDA sessions end", V["peer"]),
    Endpoint("PUT", "/api/v1/config/{key}", put_config,
             "Set one setting (checked); a running share sees it at once", V["configchange"],
             Access.NO_COOKIE, body=ConfigBody),
    Endpoint("DELETE", "/api/v1/config/{key}", delete_config,
             "Return one setting to its default", V["configchange"], Access.NO_COOKIE),
    Endpoint("POST", "/api/v1/desktop/share", post_desktop_share,
             "Offer this machine's desktop server while it shares", V["desktopshare"],
             body=DesktopShareBody),
    Endpoint("DELETE", "/api/v1/desktop/share", delete_desktop_share,
             "Stop offering the desktop: its connections are cut", V["desktopshare"]),
    Endpoint("POST", "/api/v1/cuda/share", post_cuda_share,
             "Offer CUDA sessions while this machine shares", V["cudashare"]),
    Endpoint("DELETE", "/api/v1/cuda/share", delete_cuda_share,
             "Stop offering CUDA sessions: open ones end", V["cudashare"]),
    Endpoint("POST", "/api/v1/peers/{peer}/connect", post_connect,
             "Dial a peer and measure the path", V["connect"],
             query=(Query("pings", "integer", "Round trips to measure (5)"),
                    Query("timeout", "number", "Seconds to wait for an answer "
                          "(config connect_timeout)"),
                    Query("speed", "integer", "Also push this many bytes and report MB/s"),
                    Query("fresh", "boolean", "Dial anew even when a warm session is "
                          "kept, and time the whole dial"))),
    Endpoint("GET", "/api/v1/jobs", get_jobs, "Jobs submitted and hosted, newest first",
             V["jobs"], query=(Query("limit", "integer", "How many (20)"), _offline)),
    Endpoint("POST", "/api/v1/jobs", post_job, "Submit a job to a peer or a group",
             V["result"], body=JobBody,
             query=(Query("stream", "boolean", "Answer with the run as Server-Sent Events: "
                          "placement, pull, acceptance, upload, the job's events, end"),)),
    Endpoint("GET", "/api/v1/jobs/{job_id}", get_job, "One job as last known", V["job"]),
    Endpoint("POST", "/api/v1/jobs/{job_id}/cancel", post_cancel, "Cancel a job", V["result"],
             body=CancelBody),
    Endpoint("GET", "/api/v1/jobs/{job_id}/events", get_job_events,
             "A job's events as Server-Sent Events, resumable by sequence number",
             V["event"], media_type="text/event-stream",
             query=(Query("after", "integer", "Start after this sequence number "
                          "(Last-Event-ID wins)"),
                    Query("follow", "boolean", "Until the job ends (true)"))),
    Endpoint("GET", "/api/v1/groups", get_groups, "Groups this node is in", V["groups"]),
    Endpoint("GET", "/api/v1/groups/{group}/members", get_members,
             "A group's members, probed live", V["members"], query=(_offline,)),
    Endpoint("POST", "/api/v1/copies", post_copy, "Copy a file or folder to or from a peer",
             V["copy"], Access.NO_COOKIE, body=CopyBody,
             query=(Query("stream", "boolean", "Answer with the copy's progress as "
                          "Server-Sent Events: copystarted, copyprogress, copyretrying, "
                          "end"),)),
    Endpoint("POST", "/api/v1/apps/sync", post_app_sync, "Sync a local folder to a peer",
             V["sync"], Access.NO_COOKIE, body=SyncBody),
    Endpoint("POST", "/api/v1/apps/run", post_app_run,
             "Sync a local folder, run a job in it, pull a folder back: Server-Sent Events "
             "(the job's numbered as its events route numbers them)",
             V["apprun"], Access.NO_COOKIE, body=AppRunBody, media_type="text/event-stream"),
    Endpoint("POST", "/api/v1/apps/pull", post_app_pull,
             "Pull a past app job's folder into a local folder", AppPullView,
             Access.NO_COOKIE, body=AppPullBody),
    Endpoint("POST", "/api/v1/shells", post_shell,
             "Open a shell on a peer: where to connect for its bytes (one connection)",
             V["shell"], Access.NO_COOKIE, body=V["shellbody"]),
    Endpoint("GET", "/api/v1/owner", get_owner,
             "Who uses this machine: connected peers, hosted jobs, open sessions", V["owner"],
             query=(Query("limit", "integer", "How many hosted jobs (50)"),)),
    Endpoint("POST", "/api/v1/owner/shells/{session}/stop", post_end_shell,
             "End a peer's open shell here (its container goes)", V["ended"]),
    Endpoint("POST", "/api/v1/owner/desktop/{session}/stop", post_end_desktop,
             "End a peer's connection to this machine's desktop", V["ended"]),
    Endpoint("POST", "/api/v1/owner/cuda/{session}/stop", post_end_cuda,
             "End a peer's CUDA session here (its memory is freed)", V["ended"]),
    Endpoint("GET", "/api/v1/node", get_node,
             "The node process: pid, version, API addresses", V["process"]),
    Endpoint("POST", "/api/v1/node/stop", post_node_stop, "Stop the node process",
             V["process"], Access.NO_COOKIE),
    Endpoint("POST", "/api/v1/node/tcp", post_node_tcp,
             "Serve this API on loopback TCP too (then never exit for being idle)",
             V["process"], Access.NO_COOKIE, body=TcpBody),
    Endpoint("GET", "/api/v1/share", get_share,
             "Whether this machine is shared, since when, with which options", V["share"]),
    Endpoint("POST", "/api/v1/share", post_share,
             "Share this machine with the `share` options ({}: the defaults)", V["share"],
             body=V["shareoptions"]),
    Endpoint("DELETE", "/api/v1/share", delete_share, "Stop sharing this machine",
             V["share"]),
    Endpoint("POST", "/api/v1/share/publish", post_share_publish,
             "Re-publish the share's registry listing or address record now", PublishView),
    Endpoint("GET", "/api/v1/share/output", get_share_output,
             "What the share says, as Server-Sent Events: line events, then end (the share "
             "as it is then, as GET /api/v1/share answers)",
             V["shareline"], media_type="text/event-stream",
             query=(Query("after", "integer", "Start after this line's seq (0)"),
                    Query("follow", "boolean", "Until the share stops (true)"))),
)  # fmt: skip


# --- the request pipeline ----------------------------------------------------------------

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def status_of(error: GPUMeshError) -> int:
    """The HTTP status that fits an error of the tree."""
    table: list[tuple[type[GPUMeshError], int]] = [
        (UnknownPeerError, 404),
        (NotFoundError, 404),
        (AmbiguousPeerError, 409),
        (PeerKeyChangedError, 409),
        (InUseError, 409),
        (AccessDeniedError, 403),
        (LimitError, 422),
        (PairingCodeError, 400),
        (ConfigError, 400),
        (BadRequestError, 400),
        (TransportError, 502),
        (ProtocolError, 502),
        (RuntimeUnavailableError, 503),
        (AgentError, 503),
    ]
    for cls, status in table:
        if isinstance(error, cls):
            return status
    return 500


def error_response(status: int, error: GPUMeshError) -> Response:
    return Response(
        msgspec.json.encode(ErrorView(error.code, error.message)),
        status_code=status,
        media_type="application/json",
    )


def _credential(request: Request, state: ControlState, endpoint: Endpoint) -> Credential:
    """Who calls, or a :class:`Refusal`: the checks of ``auth.py`` in order."""
    server = request.scope.get("server")
    if server is not None and server[1] is None:
        return Credential.UNIX  # a unix socket's peer passed its file mode
    headers = request.headers
    host = headers.get("host")
    if not auth.host_allowed(host, state.cookie_hosts):
        raise Refusal(
            403,
            AccessDeniedError(
                f"Host {host!r} is not this server's name: use 127.0.0.1 or localhost"
            ),
        )
    changes = request.method not in _SAFE_METHODS
    if changes and not auth.origin_allowed(headers.get("origin"), host):
        raise Refusal(403, AccessDeniedError("a request from another site's page is refused"))
    given = auth.bearer(headers.get("authorization"))
    if given is not None:
        address = request.client.host if request.client is not None else ""
        refusal = state.guesses.refusal(address)
        if refusal is not None:
            raise Refusal(429, LimitError(refusal))
        if not auth.token_matches(given, state.token):
            state.guesses.wrong(address)
            raise Refusal(401, AccessDeniedError("wrong API token"))
        state.guesses.right(address)
        return Credential.BEARER
    # A cookie reached any port of its host; only at the secret name is it ours.
    if _cookie_host(request, state) and state.sessions.valid(request.cookies.get(auth.COOKIE)):
        if changes and headers.get(auth.CSRF_HEADER) is None:
            raise Refusal(
                403, AccessDeniedError(f"a browser's change needs the {auth.CSRF_HEADER} header")
            )
        if endpoint.access is Access.NO_COOKIE:
            raise Refusal(
                403,
                AccessDeniedError(
                    "this route names paths on this machine: only the unix socket or a bearer "
                    "token may call it, never a browser session"
                ),
            )
        return Credential.COOKIE
    if endpoint.access is Access.PUBLIC:
        return Credential.NONE
    raise Refusal(
        401,
        AccessDeniedError(
            "the control API over TCP needs `Authorization: Bearer TOKEN` ($GPUMESH_API_TOKEN, "
            "or the home's api.token), or a browser session from a login URL"
        ),
    )


def _cookie_host(request: Request, state: ControlState) -> bool:
    """Whether ``request`` names a host a session cookie counts on."""
    return auth.host_name(request.headers.get("host", "")) in state.cookie_hosts


def _endpoint(endpoint: Endpoint, state: ControlState) -> Callable[[Request], Awaitable[Response]]:
    async def respond(request: Request) -> Response:
        try:
            call = Call(request, state, _credential(request, state, endpoint))
            if endpoint.body is not None:
                raw = await request.body()
                try:
                    call.body = msgspec.json.decode(raw or b"{}", type=endpoint.body)
                except msgspec.ValidationError as exc:
                    # A body that does not fit (an unknown field, a bad value): 422
                    # naming the field, as the structs of client/bodies.py refuse it.
                    error = BadRequestError(f"request body: {exc}")
                    raise Refusal(422, error) from None
                except msgspec.DecodeError:
                    raise BadRequestError("request body: not JSON") from None
            result = await endpoint.handler(call)
        except Refusal as refusal:
            return error_response(refusal.status, refusal.error)
        except GPUMeshError as exc:
            return error_response(status_of(exc), exc)
        except Exception:
            logger.exception("control API %s %s failed", request.method, request.url.path)
            return error_response(
                500, GPUMeshError("internal error in the control API (details in the debug log)")
            )
        if isinstance(result, Response):
            return result
        return Response(
            msgspec.json.encode(result, enc_hook=str),
            status_code=endpoint.status,
            media_type="application/json",
        )

    return respond


class EventStream(Response):
    """A ``text/event-stream`` response that stops its source as soon as the client
    leaves (an idle follow notices through the keep-alive comments too)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
            media_type=self.media_type,
        )
        # A stream has no length; the rest of the headers stay Starlette's.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self._events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(stream()), asyncio.ensure_future(disconnected())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is tasks[0]:
                    task.result()
        except OSError:
            pass  # the client left while we wrote
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()


def create_app(state: ControlState) -> Starlette:
    """The ASGI app over ``state``'s node: one route per :data:`ENDPOINTS` entry.
    Made in a running event loop (a server's), it starts sampling the GPUs."""
    with contextlib.suppress(RuntimeError):  # no running loop: from the first request on
        asyncio.get_running_loop()
        state.gpu_history.start()
    routes = [
        Route(e.path, _endpoint(e, state), methods=[e.method], include_in_schema=False)
        for e in ENDPOINTS
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return error_response(
            404, NotFoundError(f"no route {request.url.path}: see /api/v1/openapi.json")
        )

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return error_response(
            405, BadRequestError(f"{request.method} is not a method of {request.url.path}")
        )

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
