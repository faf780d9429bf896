"""The dashboard's pages: HTML rendered here from the client layer's views.

A page is what the control API would answer, laid out for people: each reads
the same client functions and view structs as the API routes beside it, and
every button or form on it calls an API route (``dashboard.js`` adds the CSRF
header). A page opened without a credential shows the login form and nothing of
this node. Pages never change state themselves: a ``GET`` only reads.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Iterable
from importlib import resources
from string import Template
from typing import TYPE_CHECKING
from urllib.parse import quote

from starlette.responses import HTMLResponse, Response

from gpumesh.units import format_size

if TYPE_CHECKING:
    from gpumesh.client.views.groups import MemberStatusEntry
    from gpumesh.client.views.joblist import JobListEntry
    from gpumesh.client.views.owner import SessionsView
    from gpumesh.control.app import Call

__all__ = [
    "CSP",
    "NAV",
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


def h(value: object) -> str:
    """``value`` as HTML text (escaped, quotes too)."""
    return html.escape("" if value is None else str(value))


def _template(name: str) -> Template:
    text = resources.files(__package__).joinpath("templates", name).read_text("utf-8")
    return Template(text)


def _headers() -> dict[str, str]:
    return {
        "content-security-policy": CSP,
        "referrer-policy": "no-referrer",
        "x-content-type-options": "nosniff",
        "cache-control": "no-store",
    }


def render(call: Call, page: str, title: str, body: str) -> HTMLResponse:
    theme = call.request.query_params.get("theme", "")
    current = ' aria-current="page"'
    nav = "".join(
        f'<li><a href="{href}"{current if key == page else ""}>{h(label)}</a></li>'
        for key, href, label in NAV
    )
    text = _template("base.html").substitute(
        theme=h(theme if theme in _THEMES else ""),
        title=h(title),
        page=h(page),
        nav=nav,
        body=body,
    )
    return HTMLResponse(text, headers=_headers())


_LOGIN = """
<section class="card" aria-labelledby="login-h">
  <h2 id="login-h">Sign in</h2>
  <p>Open the URL that <code>gpumesh dashboard</code> printed, or paste this node's API
  token (<code>$GPUMESH_API_TOKEN</code>, or the home's <code>api.token</code>).</p>
  <form id="login" class="stack">
    <label for="login-token">API token or login URL</label>
    <input id="login-token" name="token" type="password" autocomplete="off" required>
    <button type="submit">Sign in</button>
  </form>
</section>
"""


def _login(call: Call, page: str, title: str) -> HTMLResponse:
    return render(call, page, title, _LOGIN)


def _table(caption: str, head: Iterable[str], rows: list[str], empty: str) -> str:
    if not rows:
        return f'<p class="empty">{h(empty)}</p>'
    cells = "".join(f'<th scope="col">{h(c)}</th>' for c in head)
    return (
        f'<div class="scroll"><table><caption>{h(caption)}</caption>'
        f"<thead><tr>{cells}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
    )


def _ago(when: float | None) -> str:
    if not when:
        return "never"
    seconds = max(0, int(time.time() - when))
    if seconds < 60:
        return f"{seconds} s ago"
    if seconds < 3600:
        return f"{seconds // 60} min ago"
    if seconds < 86400:
        return f"{seconds // 3600} h ago"
    return f"{seconds // 86400} d ago"


def _button(
    label: str,
    api: str,
    *,
    then: str = "refresh",
    extra: str = "",
    danger: bool = False,
    confirm: str = "",
) -> str:
    cls = ' class="danger"' if danger else ""
    ask = f' data-confirm="{h(confirm)}"' if confirm else ""
    return (
        f'<button type="button"{cls} data-api="{h(api)}" data-then="{h(then)}"{ask}{extra}>'
        f"{h(label)}</button>"
    )


def _job_rows(jobs: list[JobListEntry], *, stop: bool) -> list[str]:
    from gpumesh.protocol.states import FINAL_STATES, JobState

    rows = []
    for job in jobs:
        running = JobState(job.state) not in FINAL_STATES
        action = ""
        if running and stop:
            action = _button(
                "Stop",
                f"POST /api/v1/jobs/{quote(job.job_id)}/cancel",
                extra=f' aria-label="Stop job {h(job.job_id)}"',
                danger=True,
            )
        peak = format_size(job.peak_gpu_memory) if job.peak_gpu_memory else "-"
        asked = format_size(job.gpu_memory) if job.gpu_memory else "-"
        rows.append(
            "<tr>"
            f'<td><a href="/jobs/{h(job.job_id)}">{h(job.job_id)}</a></td>'
            f"<td>{h(job.role)}</td><td>{h(job.peer)}</td>"
            f'<td><span class="state state-{h(job.state)}">{h(job.state)}</span></td>'
            f"<td>{h('-' if job.exit_code is None else job.exit_code)}</td>"
            f"<td>{h(job.attempt)}/{h(job.retries + 1)}</td>"
            f"<td>{h(asked)} / {h(peak)}</td>"
            f"<td><code>{h(' '.join(job.command))}</code></td>"
            f"<td>{action}</td></tr>"
        )
    return rows


_JOB_HEAD = ("Job", "Role", "Peer", "State", "Exit", "Attempt", "GPU memory asked / peak",
             "Command", "")  # fmt: skip


# --- Overview ----------------------------------------------------------------------------


async def overview_page(call: Call) -> object:
    if not call.signed_in:
        return _login(call, "overview", "Overview")
    from gpumesh.client.views.joblist import JobListEntry
    from gpumesh.client.views.node import StatusView
    from gpumesh.protocol.states import FINAL_STATES, JobState

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
    dl = "".join(f"<dt>{h(k)}</dt><dd>{h(v)}</dd>" for k, v in facts)
    gpus = "".join(
        f'<figure class="gpu card" data-gpu="{g.index}">'
        f"<figcaption>GPU {g.index}: {h(g.name)}, "
        f'<span class="mem">{h(format_size(g.memory_used))} of '
        f"{h(format_size(g.memory_total))} used</span></figcaption>"
        f'<div class="chart" data-chart="{g.index}" role="img" '
        f'aria-label="GPU {g.index}: utilisation, memory, temperature and power, last hour">'
        "</div></figure>"
        for g in status.gpus
    )
    if not gpus:
        gpus = '<p class="empty">No NVIDIA GPU on this machine.</p>'
    running = [
        JobListEntry.of(j, {})
        for j in node.home.store.jobs(limit=200)
        if JobState(j.state) not in FINAL_STATES
    ]
    body = (
        '<div id="live" hx-get="/" hx-trigger="every 5s" hx-select="#live" hx-swap="outerHTML">'
        f'<section class="card" aria-labelledby="node-h"><h2 id="node-h">This node</h2>'
        f'<dl class="facts">{dl}</dl></section>'
        '<section aria-labelledby="run-h"><h2 id="run-h">Running jobs</h2>'
        + _table("Jobs not yet ended", _JOB_HEAD, _job_rows(running, stop=True), "None runs.")
        + "</section></div>"
        f'<section aria-labelledby="gpu-h"><h2 id="gpu-h">GPUs</h2>'
        f'<p class="hint">Utilisation, memory, temperature and power over the last hour, '
        f"sampled by this node.</p>"
        f'<div class="gpus" id="gpus">{gpus}</div></section>'
    )
    return render(call, "overview", "Overview", body)


# --- Peers -------------------------------------------------------------------------------


def qr_svg(text: str) -> bytes:
    """``text`` as a QR code, an SVG image that scales (no fixed size)."""
    import io

    import segno

    out = io.BytesIO()
    segno.make(text, error="m", micro=False).save(
        out, kind="svg", scale=1, border=4, xmldecl=False, svgns=True, omitsize=True
    )
    return out.getvalue()


async def peers_page(call: Call) -> object:
    if not call.signed_in:
        return _login(call, "peers", "Peers")
    from gpumesh.client.views.peers import PeerView

    node = call.node
    code = node.pairing_code()
    svg = qr_svg(code).decode()
    svg = svg.replace("<svg ", '<svg role="img" aria-labelledby="qr-title" ', 1)
    svg = svg.replace(">", '><title id="qr-title">QR code of the pairing code</title>', 1)
    rows = []
    for peer in (PeerView.of(p) for p in node.peers()):
        name = h(peer.name)
        toggle = (
            _button("Deny", f"POST /api/v1/peers/{quote(peer.name)}/deny",
                    extra=f' aria-label="Deny {name}"', danger=True)
            if peer.allowed
            else _button("Allow", f"POST /api/v1/peers/{quote(peer.name)}/allow",
                         extra=f' aria-label="Allow {name}"')
        )  # fmt: skip
        connect = _button(
            "Connect",
            f"POST /api/v1/peers/{quote(peer.name)}/connect",
            then="connect",
            extra=f' aria-label="Connect to {name}" data-result="connect-{name}"',
        )
        rows.append(
            f'<tr data-peer="{name}"><th scope="row">{name}</th>'
            f"<td>{'allowed' if peer.allowed else 'denied'}</td>"
            f"<td>{h(_ago(peer.last_seen))}</td>"
            f"<td>{h(peer.last_path or '-')}</td>"
            f"<td>{h(', '.join(peer.addresses) or '-')}{' (relay)' if peer.relay else ''}</td>"
            f'<td>{toggle} {connect} <output id="connect-{name}" class="result"></output></td></tr>'
        )
    body = (
        '<div class="cols">'
        '<section class="card" aria-labelledby="code-h"><h2 id="code-h">This node\'s pairing code'
        "</h2><p>Give it to a peer (it pairs once and expires); it holds no secret.</p>"
        '<label for="my-code">Pairing code</label>'
        f'<textarea id="my-code" readonly rows="5" spellcheck="false">{h(code)}</textarea>'
        f'<div class="qr" id="qr">{svg}</div></section>'
        '<section class="card" aria-labelledby="pair-h"><h2 id="pair-h">Pair with a peer</h2>'
        '<form id="pair" class="stack" data-api="POST /api/v1/peers/pair" data-then="reload">'
        '<label for="pair-code">Their pairing code</label>'
        '<textarea id="pair-code" name="code" rows="3" required spellcheck="false"></textarea>'
        '<button type="submit">Pair</button></form></section></div>'
        '<section aria-labelledby="peers-h" id="live" hx-get="/peers" hx-trigger="every 10s" '
        'hx-select="#live" hx-swap="outerHTML"><h2 id="peers-h">Paired peers</h2>'
        + _table(
            "Paired peers",
            ("Peer", "Access", "Last seen", "Path", "Addresses", "Actions"),
            rows,
            "No peer yet: pair with one above.",
        )
        + "</section>"
    )
    return render(call, "peers", "Peers", body)


# --- Jobs --------------------------------------------------------------------------------


def _run_form(peers: list[str], groups: list[str]) -> str:
    options = "".join(f'<option value="peer:{h(p)}">peer {h(p)}</option>' for p in peers)
    options += "".join(f'<option value="group:{h(g)}">group {h(g)}</option>' for g in groups)
    return (
        '<section class="card" aria-labelledby="runf-h"><h2 id="runf-h">Start a run</h2>'
        '<form id="run" class="grid" data-api="POST /api/v1/jobs" data-then="job">'
        '<label for="run-where">Run on</label>'
        f'<select id="run-where" name="where" required>{options}</select>'
        '<label for="run-image">Image</label>'
        '<input id="run-image" name="image" placeholder="the default image">'
        '<label for="run-command">Command</label>'
        '<input id="run-command" name="command" required spellcheck="false" '
        'placeholder="python train.py --epochs 3">'
        '<label for="run-env">Environment (NAME=value, one a line)</label>'
        '<textarea id="run-env" name="env" rows="2" spellcheck="false"></textarea>'
        '<label for="run-mem">GPU memory</label>'
        '<input id="run-mem" name="gpu_memory" placeholder="e.g. 8GB">'
        '<label for="run-retries">Retries</label>'
        '<input id="run-retries" name="retries" type="number" min="0" max="100" value="0">'
        '<button type="submit">Run</button></form></section>'
    )


async def jobs_page(call: Call) -> object:
    if not call.signed_in:
        return _login(call, "jobs", "Jobs")
    from gpumesh.client.groups import summaries
    from gpumesh.client.views.joblist import JobListEntry

    node = call.node
    jobs = [JobListEntry.of(j, {}) for j in node.home.store.jobs(limit=100)]
    peers = [p.name for p in node.peers() if p.allowed]
    groups = [s.group.name for s in summaries(node)]
    body = _run_form(peers, groups) + (
        '<section aria-labelledby="jobs-h" id="live" hx-get="/jobs" hx-trigger="every 5s" '
        'hx-select="#live" hx-swap="outerHTML"><h2 id="jobs-h">Submitted and hosted</h2>'
        + _table("Jobs, newest first", _JOB_HEAD, _job_rows(jobs, stop=True), "No job yet.")
        + "</section>"
    )
    return render(call, "jobs", "Jobs", body)


async def job_page(call: Call) -> object:
    if not call.signed_in:
        return _login(call, "jobs", "Job")
    from gpumesh.client.jobs import find_job
    from gpumesh.client.views.joblist import JobListEntry
    from gpumesh.errors import GPUMeshError

    try:
        job = JobListEntry.of(find_job(call.node, call.param("job_id")), {})
    except GPUMeshError as exc:
        response = render(call, "jobs", "Job", f'<p class="error">{h(exc.message)}</p>')
        response.status_code = 404
        return response
    facts = [
        ("Peer", job.peer),
        ("Role", job.role),
        ("Image", job.image),
        ("Command", " ".join(job.command)),
        ("Attempt", f"{job.attempt} of {job.retries + 1}"),
        ("GPU memory asked", format_size(job.gpu_memory) if job.gpu_memory else "-"),
        ("GPU memory peak", format_size(job.peak_gpu_memory) if job.peak_gpu_memory else "-"),
    ]
    dl = "".join(f"<dt>{h(k)}</dt><dd>{h(v)}</dd>" for k, v in facts)
    cancel_peer = f' data-body="{h(json.dumps({"peer": job.peer}))}"'
    body = (
        f'<section class="card" aria-labelledby="job-h" data-job="{h(job.job_id)}" id="job">'
        '<h2 id="job-h">Details</h2>'
        f'<p>State: <span id="job-state" class="state state-{h(job.state)}">{h(job.state)}</span>'
        f' exit code: <span id="job-exit">{h("-" if job.exit_code is None else job.exit_code)}'
        f'</span></p><dl class="facts">{dl}</dl>'
        + _button(
            "Cancel job",
            f"POST /api/v1/jobs/{quote(job.job_id)}/cancel",
            then="none",
            danger=True,
            extra=f' id="cancel"{cancel_peer}',
        )
        + "</section>"
        '<section aria-labelledby="log-h"><h2 id="log-h">Log</h2>'
        '<div class="logbar"><label for="log-filter">Filter lines</label>'
        '<input id="log-filter" type="search" spellcheck="false">'
        '<span class="legend"><span class="stderr">stderr</span> '
        '<span class="stdout">stdout</span></span></div>'
        '<div id="log" class="log" role="log" aria-live="polite" aria-label="Job output" '
        'tabindex="0"></div><p id="log-end" class="hint"></p></section>'
    )
    return render(call, "jobs", f"Job {job.job_id}", body)


# --- Groups ------------------------------------------------------------------------------


def _member_row(m: MemberStatusEntry) -> str:
    why = ""
    if m.is_self:
        why = "this node"
    elif not m.paired:
        why = "not paired"
    elif m.allowed is False:
        why = "denied here"
    elif m.reachable is False:
        why = str(m.reach)
    elif m.state == "busy":
        why = "busy"
    reach = "-" if m.reachable is None else str(m.reach) if m.reachable else "no"
    free = format_size(m.free_gpu_memory) if m.free_gpu_memory is not None else "-"
    return (
        f'<tr data-member="{h(m.name)}"><th scope="row">{h(m.name)}</th>'
        f"<td>{h(reach)}</td><td>{h(m.gpus or '-')}</td><td>{h(free)}</td>"
        f"<td>{h(m.state or '-')}</td><td>{h(why or '-')}</td></tr>"
    )


async def groups_page(call: Call) -> object:
    if not call.signed_in:
        return _login(call, "groups", "Groups")
    from gpumesh.client.groups import group_status, summaries
    from gpumesh.client.views.groups import MemberStatusEntry

    node = call.node
    sections = []
    for summary in summaries(node):
        name = summary.group.name
        statuses = await group_status(node, name, live=True)
        rows = [_member_row(MemberStatusEntry.of_status(s)) for s in statuses]
        sections.append(
            f'<section class="card" aria-labelledby="g-{h(summary.group.group_id)}" '
            f'data-group="{h(name)}"><h2 id="g-{h(summary.group.group_id)}">{h(name)}</h2>'
            + _table(
                f"Members of {name}",
                ("Member", "Reachable", "GPUs", "Free GPU memory", "State", "Why skipped"),
                rows,
                "No member.",
            )
            + "</section>"
        )
    body = (
        '<div id="live" hx-get="/groups" hx-trigger="every 15s" hx-select="#live" '
        'hx-swap="outerHTML">'
        + ("".join(sections) or '<p class="empty">This node is in no group.</p>')
        + '</div><p class="hint">Start a run on a group from <a href="/jobs">Jobs</a>.</p>'
    )
    return render(call, "groups", "Groups", body)


# --- Owner -------------------------------------------------------------------------------


async def owner_page(call: Call) -> object:
    if not call.signed_in:
        return _login(call, "owner", "Owner")
    from gpumesh.client.owner import owner_view
    from gpumesh.client.views.owner import OwnerStatusView
    from gpumesh.protocol.states import FINAL_STATES, JobState

    node = call.node
    view = OwnerStatusView.of(owner_view(node, limit=50))
    peers = {p.name for p in node.peers() if p.allowed}
    open_now = view.sessions
    in_session = (
        {s.peer for s in open_now.shells}
        | {d.peer for d in open_now.desktops}
        | {c.peer for c in open_now.cuda}
    )
    users = sorted(
        {c.get("peer", "") for c in view.connections} | {j.peer for j in view.hosted} | in_session
    )
    rows = []
    for name in users:
        if not name:
            continue
        paths = [c.get("path", "?") for c in view.connections if c.get("peer") == name]
        running = sum(
            1 for j in view.hosted if j.peer == name and JobState(j.state) not in FINAL_STATES
        )
        action = (
            _button(
                "Deny and stop everything",
                f"POST /api/v1/peers/{quote(name)}/deny",
                danger=True,
                confirm=(
                    f"Deny {name}: stops its jobs, shells, desktop and CUDA sessions and "
                    "refuses it from now on?"
                ),
                extra=f' aria-label="Deny and stop everything for {h(name)}"',
            )
            if name in peers
            else "denied"
        )
        rows.append(
            f'<tr data-peer="{h(name)}"><th scope="row">{h(name)}</th>'
            f"<td>{h(', '.join(paths) or 'not connected')}</td><td>{running}</td>"
            f"<td>{action}</td></tr>"
        )
    body = (
        '<div id="live" hx-get="/owner" hx-trigger="every 5s" hx-select="#live" '
        'hx-swap="outerHTML">'
        + _share_section(call, agent_sharing=view.sharing)
        + f"<p>{view.running} job(s) running here for peers.</p>"
        '<section aria-labelledby="who-h"><h2 id="who-h">Who uses this machine</h2>'
        + _table(
            "Peers connected now or with jobs here",
            ("Peer", "Connected", "Running jobs", "Action"),
            rows,
            "Nobody uses this machine now.",
        )
        + '</section><section aria-labelledby="hosted-h"><h2 id="hosted-h">Jobs run here</h2>'
        + _table(
            "Hosted jobs, newest first",
            _JOB_HEAD,
            _job_rows(view.hosted, stop=True),
            "No job was run here.",
        )
        + '</section><section aria-labelledby="sessions-h">'
        '<h2 id="sessions-h">Open sessions</h2>'
        + _table(
            "Shells, desktop connections and CUDA sessions open now",
            ("Kind", "Peer", "What", "Since", "Action"),
            _session_rows(open_now),
            "No shell, desktop or CUDA session is open.",
        )
        + "</section></div>"
    )
    return render(call, "owner", "Owner", body)


def _clock(when: float) -> str:
    """``when`` as this machine's local date and time, in a ``<time>`` element."""
    iso = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(when))
    shown = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    return f'<time datetime="{h(iso)}">{h(shown)}</time> ({h(_ago(when))})'


def _share_section(call: Call, *, agent_sharing: bool) -> str:
    """Whether this machine is shared (since when, on which UDP address, or how the
    last share ended), with the button that starts or stops it: ``POST`` and
    ``DELETE /api/v1/share``, the routes ``gpumesh share`` uses. Without a node
    process behind this API, only what the agent's record says, and why nothing
    can be changed here."""
    process = call.state.process
    sharing = process.sharing if process is not None else None
    if sharing is None:
        why = (
            "This control API is not served by this home's node process: start and stop "
            "sharing with <code>gpumesh share</code> and <code>gpumesh share stop</code>."
            if process is None
            else "The node process is stopping: sharing cannot be started or stopped now."
        )
        state = "Shared" if agent_sharing else "Not shared"
        return (
            '<section class="card" id="share" aria-labelledby="share-h" data-sharing="'
            f'{"true" if agent_sharing else "false"}"><h2 id="share-h">Sharing</h2>'
            f'<p id="share-state"><strong>{state}.</strong></p>'
            f'<p class="hint" id="share-note">{why}</p></section>'
        )
    share = sharing.view()
    if share.sharing:
        options = share.options.describe() if share.options is not None else "the defaults"
        since = _clock(share.since) if share.since else "now"
        where = f" on UDP <code>{h(share.udp)}</code>," if share.udp else ""
        text = f'<strong class="shared">Shared</strong> since {since},{where} with {h(options)}.'
        action = _button(
            "Stop sharing",
            "DELETE /api/v1/share",
            danger=True,
            confirm=(
                "Stop sharing this machine? Peers can no longer reach it and their open "
                "sessions here end; running jobs go on and are picked up again when it "
                "shares again."
            ),
            extra=' id="share-stop" aria-label="Stop sharing this machine"',
        )
    else:
        text = "<strong>Not shared.</strong>"
        if share.ended is not None:
            text += f" The last share ended {_clock(share.ended.at)}: {h(share.ended.how)}."
        action = _button(
            "Start sharing",
            "POST /api/v1/share",
            extra=(
                ' id="share-start" data-body="{}" '
                'aria-label="Start sharing this machine with the default options"'
            ),
        )
    return (
        '<section class="card" id="share" aria-labelledby="share-h" '
        f'data-sharing="{"true" if share.sharing else "false"}">'
        '<h2 id="share-h">Sharing</h2>'
        f'<p id="share-state">{text}</p>{action}</section>'
    )


def _session_rows(sessions: SessionsView) -> list[str]:
    """One row per open session, each with its stop button."""
    found: list[tuple[float, str, str, str, str, str]] = []
    for shell in sessions.shells:
        what = f"{shell.image} ({shell.container})"
        found.append((shell.since, "Shell", "shells", shell.id, shell.peer, what))
    for desk in sessions.desktops:
        what = f"{desk.kind.upper()} on port {desk.port}"
        found.append((desk.since, "Desktop", "desktop", desk.id, desk.peer, what))
    for cuda in sessions.cuda:
        what = f"{format_size(cuda.memory)} on {cuda.device} (pid {cuda.pid})"
        found.append((cuda.since, "CUDA", "cuda", cuda.id, cuda.peer, what))
    rows = []
    for since, kind, route, session_id, peer, what in sorted(found):
        label = f"Stop {peer}'s {kind.lower()} session {session_id}"
        stop = _button(
            "Stop",
            f"POST /api/v1/owner/{route}/{quote(session_id)}/stop",
            danger=True,
            extra=f' aria-label="{h(label)}"',
        )
        rows.append(
            f'<tr data-session="{h(session_id)}"><td>{h(kind)}</td>'
            f'<th scope="row">{h(peer)}</th><td>{h(what)}</td>'
            f"<td>{h(_ago(since))}</td><td>{stop}</td></tr>"
        )
    return rows


# --- static files ------------------------------------------------------------------------


async def static_file(call: Call) -> object:
    """A file of the dashboard's ``static/``, by its plain name."""
    return _static(call, "static", call.param("name"))


async def vendor_file(call: Call) -> object:
    """A vendored library's file (``static/vendor/``), by its plain name."""
    return _static(call, "static/vendor", call.param("name"))


def _static(call: Call, folder: str, name: str) -> Response:
    from gpumesh.errors import NotFoundError

    suffix = "." + name.rpartition(".")[2]
    resource = resources.files(__package__).joinpath(*folder.split("/"), name)
    if name.startswith(".") or suffix not in _STATIC_TYPES or not resource.is_file():
        raise NotFoundError(f"no file {call.request.url.path}")
    return Response(
        resource.read_bytes(),
        media_type=_STATIC_TYPES[suffix],
        headers={"cache-control": "no-cache", "x-content-type-options": "nosniff"},
    )
