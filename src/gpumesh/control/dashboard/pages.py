"""The dashboard's pages: HTML rendered here from the client layer's views.

A page is what the control API would answer, laid out for people: each reads
the same client functions and view structs as the API routes beside it, and
every button or form on it calls an API route (``dashboard.js`` adds the CSRF
header). A page opened without a credential shows the login form and nothing of
this node. Pages never change state themselves: a ``GET`` only reads.

The HTML is in ``templates/``, rendered with autoescaping: the handlers here pass
plain values (``views.py``), never HTML, so a peer's name, a job's argv or an
error message always reaches the browser as text.
"""

from __future__ import annotations

import io
from importlib import resources
from typing import TYPE_CHECKING

import jinja2
import segno
from markupsafe import Markup
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from gpumesh.client.groups import group_status, summaries
from gpumesh.client.jobs import find_job
from gpumesh.client.owner import owner_view
from gpumesh.client.views.groups import MemberStatusEntry
from gpumesh.client.views.joblist import JobListEntry
from gpumesh.client.views.node import StatusView
from gpumesh.client.views.owner import OwnerStatusView
from gpumesh.client.views.peers import PeerView
from gpumesh.control.dashboard.views import (
    GpuCard,
    GroupCard,
    JobCard,
    JobRow,
    MemberRow,
    PeerRow,
    SessionRow,
    ShareCard,
    UserRow,
    running,
)
from gpumesh.errors import GPUMeshError, NotFoundError
from gpumesh.units import format_size

if TYPE_CHECKING:
    from gpumesh.control.call import Call

__all__ = [
    "CSP",
    "NAV",
    "TEMPLATES",
    "groups_page",
    "job_page",
    "jobs_page",
    "overview_page",
    "owner_page",
    "peers_page",
    "qr_svg",
    "static_file",
    "vendor_file",
]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
"""Our own scripts and styles only: no inline script, no other site."""

NAV = (
    ("overview", "/", "Overview"),
    ("peers", "/peers", "Peers"),
    ("jobs", "/jobs", "Jobs"),
    ("groups", "/groups", "Groups"),
    ("owner", "/owner", "Owner"),
)
_THEMES = frozenset({"light", "dark"})
_STATIC_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".md": "text/markdown; charset=utf-8",
}

TEMPLATES = Jinja2Templates(
    env=jinja2.Environment(
        loader=jinja2.PackageLoader("gpumesh.control.dashboard", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
)
"""The pages' templates, every value escaped; a name no view passes is an error."""


_HEADERS = {
    "content-security-policy": CSP,
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
    "cache-control": "no-store",
}


def _render(
    call: Call, template: str, page: str, title: str, status_code: int = 200, **values: object
) -> Response:
    """``template`` in the dashboard's layout: ``page`` is the section the menu marks."""
    theme = call.request.query_params.get("theme", "")
    context = {
        "nav": NAV,
        "page": page,
        "title": title,
        "theme": theme if theme in _THEMES else "",
        **values,
    }
    return TEMPLATES.TemplateResponse(
        call.request, template, context, status_code=status_code, headers=_HEADERS
    )


async def overview_page(call: Call) -> object:
    if not call.signed_in:
        return _render(call, "login.html", "overview", "Overview")
    node = call.node
    status = StatusView.of(node.status(), submitted_unknown=0)
    links = ", ".join(f"{c.get('peer', '?')} ({c.get('path', '?')})" for c in status.connections)
    facts = [
        ("Name", status.name),
        ("Node id", status.node_id),
        ("Sharing", "on" if status.sharing else "off"),
        ("Listens on", status.listen),
        ("Relay", status.relay or "none"),
        ("Relay / NAT state", status.relay_state or "-"),
        ("Connected peers", links or "none"),
        ("State", status.state),
        ("Peers", f"{status.peers} paired, {status.allowed} allowed"),
        ("GPU source", status.gpu_source),
    ]
    gpus = [
        GpuCard(g.index, g.name, format_size(g.memory_used), format_size(g.memory_total))
        for g in status.gpus
    ]
    jobs = [
        JobRow.of(JobListEntry.of(j, {}))
        for j in node.home.store.jobs(limit=200)
        if running(j.state)
    ]
    return _render(call, "overview.html", "overview", "Overview", node=facts, jobs=jobs, gpus=gpus)


def qr_svg(text: str) -> bytes:
    """``text`` as a QR code, an SVG image that scales (no fixed size)."""
    out = io.BytesIO()
    segno.make(text, error="m", micro=False).save(
        out, kind="svg", scale=1, border=4, xmldecl=False, svgns=True, omitsize=True
    )
    return out.getvalue()


async def peers_page(call: Call) -> object:
    if not call.signed_in:
        return _render(call, "login.html", "peers", "Peers")
    node = call.node
    code = node.pairing_code()
    svg = qr_svg(code).decode()
    svg = svg.replace("<svg ", '<svg role="img" aria-labelledby="qr-title" ', 1)
    svg = svg.replace(">", '><title id="qr-title">QR code of the pairing code</title>', 1)
    # Markup: segno's drawing of this node's own pairing code (path data, none of its
    # text) and the two fixed pieces above. Nothing in it comes from a peer.
    qr = Markup(svg)
    peers = [PeerRow.of(PeerView.of(p)) for p in node.peers()]
    return _render(call, "peers.html", "peers", "Peers", code=code, qr=qr, peers=peers)


async def jobs_page(call: Call) -> object:
    if not call.signed_in:
        return _render(call, "login.html", "jobs", "Jobs")
    node = call.node
    jobs = [JobRow.of(JobListEntry.of(j, {})) for j in node.home.store.jobs(limit=100)]
    peers = [p.name for p in node.peers() if p.allowed]
    groups = [s.group.name for s in summaries(node)]
    return _render(call, "jobs.html", "jobs", "Jobs", peers=peers, groups=groups, jobs=jobs)


async def job_page(call: Call) -> object:
    if not call.signed_in:
        return _render(call, "login.html", "jobs", "Job")
    try:
        job = JobListEntry.of(find_job(call.node, call.param("job_id")), {})
    except GPUMeshError as exc:
        return _render(call, "job.html", "jobs", "Job", status_code=404, error=exc.message)
    card = JobCard.of(job)
    return _render(call, "job.html", "jobs", f"Job {job.job_id}", error="", job=card)


async def groups_page(call: Call) -> object:
    if not call.signed_in:
        return _render(call, "login.html", "groups", "Groups")
    node = call.node
    groups = []
    for summary in summaries(node):
        name = summary.group.name
        statuses = await group_status(node, name, live=True)
        members = [MemberRow.of(MemberStatusEntry.of_status(s)) for s in statuses]
        groups.append(GroupCard(summary.group.group_id, name, members))
    return _render(call, "groups.html", "groups", "Groups", groups=groups)


async def owner_page(call: Call) -> object:
    if not call.signed_in:
        return _render(call, "login.html", "owner", "Owner")
    node = call.node
    view = OwnerStatusView.of(owner_view(node, limit=50))
    allowed = {p.name for p in node.peers() if p.allowed}
    open_now = view.sessions
    in_session = (
        {s.peer for s in open_now.shells}
        | {d.peer for d in open_now.desktops}
        | {c.peer for c in open_now.cuda}
    )
    names = sorted(
        {c.get("peer", "") for c in view.connections} | {j.peer for j in view.hosted} | in_session
    )
    users = [
        UserRow(
            name=name,
            paths=", ".join(c.get("path", "?") for c in view.connections if c.get("peer") == name)
            or "not connected",
            running=sum(1 for j in view.hosted if j.peer == name and running(j.state)),
            allowed=name in allowed,
        )
        for name in names
        if name
    ]
    return _render(
        call,
        "owner.html",
        "owner",
        "Owner",
        share=_share(call, agent_sharing=view.sharing),
        running=view.running,
        users=users,
        hosted=[JobRow.of(j) for j in view.hosted],
        sessions=SessionRow.of(open_now),
        relaying=view.relaying,
    )


def _share(call: Call, *, agent_sharing: bool) -> ShareCard:
    """Whether this machine is shared, from the node process serving this API; without
    one, only what the agent's record says."""
    process = call.state.process
    sharing = process.sharing if process is not None else None
    if sharing is None:
        return ShareCard(
            control="elsewhere" if process is None else "stopping", sharing=agent_sharing
        )
    return ShareCard.of(sharing.view())


# --- static files ------------------------------------------------------------------------


async def static_file(call: Call) -> object:
    """A file of the dashboard's ``static/``, by its plain name."""
    return _static(call, "static", call.param("name"))


async def vendor_file(call: Call) -> object:
    """A vendored library's file (``static/vendor/``), by its plain name."""
    return _static(call, "static/vendor", call.param("name"))


def _static(call: Call, folder: str, name: str) -> Response:
    suffix = "." + name.rpartition(".")[2]
    resource = resources.files(__package__).joinpath(*folder.split("/"), name)
    if name.startswith(".") or suffix not in _STATIC_TYPES or not resource.is_file():
        raise NotFoundError(f"no file {call.request.url.path}")
    return Response(
        resource.read_bytes(),
        media_type=_STATIC_TYPES[suffix],
        headers={"cache-control": "no-cache", "x-content-type-options": "nosniff"},
    )
