"""The control API: its one route table, and the pipeline every request goes through.

Every route is one :class:`Endpoint` in :data:`ENDPOINTS` (method, path, who may
call it, the body it takes and the view it returns); the Starlette routes and
the OpenAPI document are both made from that table, so neither can list a route
the other lacks. The handlers live in :mod:`gpumesh.control.routes`, one module
per resource (node, peers, jobs, groups, files, owner, share, sessions), and
hold no product logic: what the CLI does with the same result lives in
``gpumesh.client``, and the JSON is the view struct the CLI's ``--json`` prints.

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
import logging
from collections.abc import Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gpumesh.client.bodies import (
    AppPullBody,
    AppRunBody,
    CancelBody,
    ConfigBody,
    CopyBody,
    CudaBody,
    DesktopShareBody,
    ExchangeBody,
    GroupBody,
    InviteBody,
    JobBody,
    JoinBody,
    MemberBody,
    PairBody,
    PauseBody,
    PruneBody,
    SearchBody,
    ShareOptions,
    ShellRequest,
    SyncBody,
    SyncPeersBody,
    TcpBody,
    TunnelBody,
)
from gpumesh.client.cuda import BenchResult, DemoResult
from gpumesh.client.views import (
    ErrorView,
    apps,
    desktop,
    files,
    groups,
    joblist,
    jobs,
    node,
    owner,
    peers,
    registry,
)
from gpumesh.client.views.apps import AppPullView
from gpumesh.client.views.node import LoginCodeView, PublishView
from gpumesh.control import auth
from gpumesh.control.call import Call, ControlState, Credential, Refusal, cookie_host
from gpumesh.control.dashboard import history, pages
from gpumesh.control.endpoints import Access, Endpoint, Handler, Query
from gpumesh.control.openapi import document
from gpumesh.control.routes.files import post_app_pull, post_app_run, post_app_sync, post_copy
from gpumesh.control.routes.groups import (
    get_groups,
    get_members,
    post_group,
    post_invite,
    post_join,
    post_member,
)
from gpumesh.control.routes.jobs import (
    get_job,
    get_job_events,
    get_jobs,
    post_cancel,
    post_job,
    post_prune,
)
from gpumesh.control.routes.node import (
    delete_config,
    get_gpu_history,
    get_gpus,
    get_node,
    get_status,
    post_node_stop,
    post_node_tcp,
    put_config,
)
from gpumesh.control.routes.owner import (
    delete_cuda_share,
    delete_desktop_share,
    get_owner,
    post_cuda_share,
    post_desktop_share,
    post_end_cuda,
    post_end_desktop,
    post_end_shell,
    post_shell,
)
from gpumesh.control.routes.peers import (
    get_pairing_code,
    get_pairing_qr,
    get_peers,
    post_allow,
    post_connect,
    post_cuda_allow,
    post_cuda_deny,
    post_deny,
    post_desktop_allow,
    post_desktop_deny,
    post_pair,
)
from gpumesh.control.routes.registry import post_search, post_sync
from gpumesh.control.routes.sessions import delete_session, post_login_code, post_session
from gpumesh.control.routes.share import (
    delete_share,
    get_share,
    get_share_output,
    post_pause,
    post_resume,
    post_share,
    post_share_publish,
)
from gpumesh.control.routes.tunnels import (
    get_desktop_doctor,
    post_cuda_bench,
    post_cuda_bridge,
    post_cuda_demo,
    post_desktop_connect,
)
from gpumesh.control.shareviews import PauseView, ShareLine, ShareView
from gpumesh.control.views import NodeProcessView, ShellOfferView
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

__all__ = ["ENDPOINTS", "Call", "ControlState", "create_app"]

logger = logging.getLogger(__name__)


async def get_openapi(call: Call) -> object:
    return Response(document(ENDPOINTS), media_type="application/json")


_offline = Query("offline", "boolean", "Do not ask peers: local state only.")


def _page(path: str, handler: Handler, summary: str, media_type: str = "text/html") -> Endpoint:
    """A page or file of the dashboard: anybody may ask (a page signs in first)."""
    return Endpoint("GET", path, handler, summary, None, Access.PUBLIC, media_type=media_type)


ENDPOINTS: tuple[Endpoint, ...] = (
    _page("/", pages.overview_page, "Dashboard: overview (sign-in without a session)"),
    _page("/peers", pages.peers_page, "Dashboard: peers"),
    _page("/jobs", pages.jobs_page, "Dashboard: jobs"),
    _page("/jobs/{job_id}", pages.job_page, "Dashboard: one job and its live log"),
    _page("/groups", pages.groups_page, "Dashboard: groups"),
    _page("/owner", pages.owner_page, "Dashboard: the owner's view"),
    _page("/static/{name}", pages.static_file, "Dashboard: its scripts and styles", "text/plain"),
    _page("/static/vendor/{name}", pages.vendor_file,
          "Dashboard: vendored libraries (VENDORED.md lists them)", "text/plain"),
    Endpoint("GET", "/api/v1/openapi.json", get_openapi, "This document", None, Access.PUBLIC),
    Endpoint("POST", "/api/v1/auth/session", post_session,
             "Exchange a one-time login code for a session cookie", None, Access.PUBLIC,
             body=ExchangeBody, status=204),
    Endpoint("DELETE", "/api/v1/auth/session", delete_session, "End a browser session", None,
             status=204),
    Endpoint("POST", "/api/v1/auth/login-codes", post_login_code,
             "A one-time login URL for a browser", LoginCodeView, Access.NO_COOKIE),
    Endpoint("GET", "/api/v1/status", get_status, "This node: identity, sharing, GPUs, jobs",
             node.StatusView, query=(_offline,)),
    Endpoint("GET", "/api/v1/gpus", get_gpus, "This machine's GPUs, read now", node.GpusView),
    Endpoint("GET", "/api/v1/gpus/history", get_gpu_history,
             "The last hour of GPU readings, sampled by this process", history.GpuHistoryView),
    Endpoint("GET", "/api/v1/peers", get_peers, "Paired peers", list[peers.PeerView]),
    Endpoint("POST", "/api/v1/peers/pair", post_pair, "Pair with a peer's code", peers.PairView,
             body=PairBody),
    Endpoint("GET", "/api/v1/pairing-code", get_pairing_code,
             "A fresh pairing code of this node", peers.PairingCodeView),
    Endpoint("GET", "/api/v1/pairing-code/qr.svg", get_pairing_qr,
             "A pairing code of this node as a QR code", None,
             query=(Query("code", "string", "A code of this node's; default: a fresh one"),),
             media_type="image/svg+xml"),
    Endpoint("POST", "/api/v1/peers/{peer}/allow", post_allow, "Allow a peer", peers.PeerView),
    Endpoint("POST", "/api/v1/peers/{peer}/deny", post_deny,
             "Deny a peer: revokes everything at once", peers.PeerView),
    Endpoint("POST", "/api/v1/peers/{peer}/desktop/allow", post_desktop_allow,
             "Put a peer on the desktop allowlist", peers.PeerView),
    Endpoint("POST", "/api/v1/peers/{peer}/desktop/deny", post_desktop_deny,
             "Take a peer off the desktop allowlist: its desktop connections are cut",
             peers.PeerView),
    Endpoint("POST", "/api/v1/peers/{peer}/cuda/allow", post_cuda_allow,
             "Put a peer on the CUDA allowlist", peers.PeerView),
    Endpoint("POST", "/api/v1/peers/{peer}/cuda/deny", post_cuda_deny,
             "Take a peer off the CUDA allowlist: its CUDA sessions end", peers.PeerView),
    Endpoint("PUT", "/api/v1/config/{key}", put_config,
             "Set one setting (checked); a running share sees it at once", node.ConfigChangeView,
             Access.NO_COOKIE, body=ConfigBody),
    Endpoint("DELETE", "/api/v1/config/{key}", delete_config,
             "Return one setting to its default", node.ConfigChangeView, Access.NO_COOKIE),
    Endpoint("POST", "/api/v1/desktop/share", post_desktop_share,
             "Offer this machine's desktop server while it shares", owner.DesktopShareView,
             body=DesktopShareBody),
    Endpoint("DELETE", "/api/v1/desktop/share", delete_desktop_share,
             "Stop offering the desktop: its connections are cut", owner.DesktopShareView),
    Endpoint("POST", "/api/v1/cuda/share", post_cuda_share,
             "Offer CUDA sessions while this machine shares", owner.CudaShareView),
    Endpoint("DELETE", "/api/v1/cuda/share", delete_cuda_share,
             "Stop offering CUDA sessions: open ones end", owner.CudaShareView),
    Endpoint("GET", "/api/v1/desktop/doctor", get_desktop_doctor,
             "Desktop servers on 127.0.0.1, the share, who may use it, who is connected",
             desktop.DesktopDoctorView),
    Endpoint("POST", "/api/v1/desktop/connect", post_desktop_connect,
             "Tunnel a peer's desktop to a loopback port here while the stream lasts: "
             "Server-Sent Events: tunnelview (where it listens), then tunnelconnectionview, "
             "tunnelrefusedview, tunnelwarningview", desktop.TunnelView,
             Access.NO_COOKIE, body=TunnelBody, media_type="text/event-stream"),
    Endpoint("POST", "/api/v1/cuda/bridge", post_cuda_bridge,
             "Serve this machine's programs CUDA sessions on a peer while the stream "
             "lasts: Server-Sent Events (where it listens)", desktop.CudaBridgeView,
             Access.NO_COOKIE, body=CudaBody, media_type="text/event-stream"),
    Endpoint("POST", "/api/v1/cuda/demo", post_cuda_demo,
             "Add two vectors on a peer's device and check the result", DemoResult,
             body=CudaBody),
    Endpoint("POST", "/api/v1/cuda/bench", post_cuda_bench,
             "Call latency and copy bandwidth on a peer's device, beside the link's",
             BenchResult, body=CudaBody),
    Endpoint("POST", "/api/v1/peers/{peer}/connect", post_connect,
             "Dial a peer and measure the path", peers.ConnectView,
             query=(Query("pings", "integer", "Round trips to measure (5)"),
                    Query("timeout", "number", "Seconds to wait for an answer "
                          "(config connect_timeout)"),
                    Query("speed", "integer", "Also push this many bytes and report MB/s"),
                    Query("fresh", "boolean", "Dial anew even when a warm session is "
                          "kept, and time the whole dial"))),
    Endpoint("GET", "/api/v1/jobs", get_jobs, "Jobs submitted and hosted, newest first",
             list[joblist.JobListEntry],
             query=(Query("limit", "integer", "How many (20)"), _offline)),
    Endpoint("POST", "/api/v1/jobs", post_job, "Submit a job to a peer or a group",
             jobs.JobResultView, body=JobBody,
             query=(Query("stream", "boolean", "Answer with the run as Server-Sent Events: "
                          "placement, pull, acceptance, upload, the job's events, end"),)),
    Endpoint("POST", "/api/v1/jobs/prune", post_prune,
             "Forget finished jobs older than an age (hosted ones lose logs and workdir)",
             list[joblist.PrunedJob], body=PruneBody),
    Endpoint("GET", "/api/v1/jobs/{job_id}", get_job, "One job as last known",
             joblist.JobListEntry),
    Endpoint("POST", "/api/v1/jobs/{job_id}/cancel", post_cancel, "Cancel a job",
             jobs.JobResultView, body=CancelBody),
    Endpoint("GET", "/api/v1/jobs/{job_id}/events", get_job_events,
             "A job's events as Server-Sent Events, resumable by sequence number",
             jobs.Output | jobs.Status | jobs.Dropped | jobs.Reconnecting | jobs.Moved,
             media_type="text/event-stream",
             query=(Query("after", "integer", "Start after this sequence number "
                          "(Last-Event-ID wins)"),
                    Query("follow", "boolean", "Until the job ends (true)"))),
    Endpoint("POST", "/api/v1/peers/sync", post_sync,
             "Re-publish this node's records and refresh every paired peer's addresses",
             registry.SyncView, body=SyncPeersBody),
    Endpoint("POST", "/api/v1/registry/search", post_search,
             "Search the public registry; each listing's signature checked here",
             registry.SearchView, body=SearchBody),
    Endpoint("GET", "/api/v1/groups", get_groups, "Groups this node is in",
             list[groups.GroupListEntry]),
    Endpoint("POST", "/api/v1/groups", post_group, "Create a group with this node in it",
             groups.GroupView, body=GroupBody),
    Endpoint("POST", "/api/v1/groups/join", post_join,
             "Join a group with a member's invite and record its members", groups.JoinedView,
             body=JoinBody),
    Endpoint("POST", "/api/v1/groups/{group}/invite", post_invite,
             "A signed invite to a group, carrying every member", groups.InviteView,
             body=InviteBody),
    Endpoint("POST", "/api/v1/groups/{group}/members", post_member,
             "Add a paired peer to a group on this node", groups.AddedView, body=MemberBody),
    Endpoint("GET", "/api/v1/groups/{group}/members", get_members,
             "A group's members, probed live", list[groups.MemberStatusEntry], query=(_offline,)),
    Endpoint("POST", "/api/v1/copies", post_copy, "Copy a file or folder to or from a peer",
             files.CopyView, Access.NO_COOKIE, body=CopyBody,
             query=(Query("stream", "boolean", "Answer with the copy's progress as "
                          "Server-Sent Events: copystarted, copyprogress, copyretrying, "
                          "end"),)),
    Endpoint("POST", "/api/v1/apps/sync", post_app_sync, "Sync a local folder to a peer",
             apps.SyncView, Access.NO_COOKIE, body=SyncBody),
    Endpoint("POST", "/api/v1/apps/run", post_app_run,
             "Sync a local folder, run a job in it, pull a folder back: Server-Sent Events "
             "(the job's numbered as its events route numbers them)",
             apps.AppRunView, Access.NO_COOKIE, body=AppRunBody, media_type="text/event-stream"),
    Endpoint("POST", "/api/v1/apps/pull", post_app_pull,
             "Pull a past app job's folder into a local folder", AppPullView,
             Access.NO_COOKIE, body=AppPullBody),
    Endpoint("POST", "/api/v1/shells", post_shell,
             "Open a shell on a peer: where to connect for its bytes (one connection)",
             ShellOfferView, Access.NO_COOKIE, body=ShellRequest),
    Endpoint("GET", "/api/v1/owner", get_owner,
             "Who uses this machine: connected peers, hosted jobs, open sessions",
             owner.OwnerStatusView,
             query=(Query("limit", "integer", "How many hosted jobs (50)"),)),
    Endpoint("POST", "/api/v1/owner/shells/{session}/stop", post_end_shell,
             "End a peer's open shell here (its container goes)", owner.EndedSessionView),
    Endpoint("POST", "/api/v1/owner/desktop/{session}/stop", post_end_desktop,
             "End a peer's connection to this machine's desktop", owner.EndedSessionView),
    Endpoint("POST", "/api/v1/owner/cuda/{session}/stop", post_end_cuda,
             "End a peer's CUDA session here (its memory is freed)", owner.EndedSessionView),
    Endpoint("GET", "/api/v1/node", get_node,
             "The node process: pid, version, API addresses", NodeProcessView),
    Endpoint("POST", "/api/v1/node/stop", post_node_stop, "Stop the node process",
             NodeProcessView, Access.NO_COOKIE),
    Endpoint("POST", "/api/v1/node/tcp", post_node_tcp,
             "Serve this API on loopback TCP too (then never exit for being idle)",
             NodeProcessView, Access.NO_COOKIE, body=TcpBody),
    Endpoint("GET", "/api/v1/share", get_share,
             "Whether this machine is shared, since when, with which options", ShareView),
    Endpoint("POST", "/api/v1/share", post_share,
             "Share this machine with the `share` options ({}: the defaults)", ShareView,
             body=ShareOptions),
    Endpoint("DELETE", "/api/v1/share", delete_share, "Stop sharing this machine",
             ShareView),
    Endpoint("POST", "/api/v1/share/pause", post_pause,
             "The owner takes the machine back: guest jobs preempted (SIGTERM, then "
             "stopped after the grace), guest shells and CUDA sessions ended, nothing more "
             "admitted until resume, through restarts; answers once the guests are stopped",
             PauseView, body=PauseBody),
    Endpoint("POST", "/api/v1/share/resume", post_resume,
             "Offer the machine to peers again after a pause", PauseView),
    Endpoint("POST", "/api/v1/share/publish", post_share_publish,
             "Re-publish the share's registry listing or address record now", PublishView),
    Endpoint("GET", "/api/v1/share/output", get_share_output,
             "What the share says, as Server-Sent Events: line events, then end (the share "
             "as it is then, as GET /api/v1/share answers)",
             ShareLine, media_type="text/event-stream",
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
    return next((status for cls, status in table if isinstance(error, cls)), 500)


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
    if cookie_host(request, state) and state.sessions.valid(request.cookies.get(auth.COOKIE)):
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
