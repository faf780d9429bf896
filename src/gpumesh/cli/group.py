"""``gpumesh group``: create, list, invite, join, add and members."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from gpumesh.cli._common import emit_json, get_node
from gpumesh.cli._complete import complete_group, complete_peer
from gpumesh.units import format_duration

if TYPE_CHECKING:
    from gpumesh.cli._table import Column
    from gpumesh.client.groups import MemberView
    from gpumesh.store.db import Group

_ACCESS_COLORS = {"self": "cyan", "allowed": "green", "denied": "red"}


@click.group(
    epilog="""\b
Examples:
  gpumesh group create research
  gpumesh group invite research        # send the output to whoever should join
  gpumesh group join 'gpg1_...'
  gpumesh group members research
\b
A group tells its members about each other; using a member's GPU still
needs mutual pairing (`gpumesh pair-code` / `gpumesh pair`).
"""
)
def group() -> None:
    """Create, share and join groups of nodes."""


@group.command(
    epilog="\b\nExamples:\n  gpumesh group create research\n  gpumesh group create lab --json"
)
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def create(name: str, as_json: bool) -> None:
    """Create a group NAME with this node as its first member."""
    from gpumesh.client.groups import create_group

    created = create_group(get_node(), name)
    if as_json:
        emit_json(_group_json(created))
        return
    click.echo(f"Created group {click.style(created.name, bold=True)} ({created.short_id}).")
    click.echo(f"Invite others with `gpumesh group invite {created.name}`.")


@group.command(
    name="list", epilog="\b\nExamples:\n  gpumesh group list\n  gpumesh group list --json"
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def list_groups(as_json: bool) -> None:
    """List the groups this node created or joined."""
    from gpumesh.client.groups import summaries

    rows = summaries(get_node())
    if as_json:
        emit_json(
            [
                {
                    **_group_json(s.group),
                    "usable": s.usable,
                    "others": s.others,
                    "joined_via": s.inviter or None,
                }
                for s in rows
            ]
        )
        return
    if not rows:
        click.echo(
            "No groups yet. Create one with `gpumesh group create NAME`, or join one with "
            "`gpumesh group join '<invite>'`."
        )
        return
    from gpumesh.cli._table import Column, print_table

    now = time.time()
    shown = []
    for s in rows:
        origin = f"joined via {_escape(s.inviter)}" if s.inviter else "created here"
        shown.append(
            [
                _escape(s.group.name),
                s.group.short_id,
                str(s.group.member_count),
                f"{s.usable}/{s.others}",
                f"{format_duration(now - s.group.created_at)} ago, {origin}",
            ]
        )
    columns = [
        Column("NAME", gives_way=1, least=10),
        Column("ID"),
        Column("MEMBERS"),
        Column("PAIRED"),
        Column("SINCE", gives_way=2, least=12),  # the age comes first and stays
    ]
    print_table(columns, shown)


@group.command(
    epilog="""\b
Examples:
  gpumesh group invite research
  gpumesh group invite research --expires 1h
"""
)
@click.argument("name", shell_complete=complete_group)
@click.option(
    "--expires",
    default="24h",
    show_default=True,
    metavar="DURATION",
    help="How long the invite stays valid (such as 30m, 2h, 3d; at most 7d).",
)
def invite(name: str, expires: str) -> None:
    """Print a signed invite to group NAME.

    The invite carries every member's name, key and addresses. Whoever
    joins with it still pairs with each member before using them.
    """
    from gpumesh.client.groups import invite_code
    from gpumesh.client.jobspec import parse_duration

    lifetime = parse_duration(expires)
    code = invite_code(get_node(), name, lifetime=lifetime)
    click.echo(code)
    if sys.stdout.isatty():
        click.echo(
            f"Give this invite to whoever should join {name}; it expires in "
            f"{format_duration(lifetime)}. They run: gpumesh group join '<invite>'",
            err=True,
        )


@group.command(
    epilog="""\b
Examples:
  gpumesh group join 'gpg1_...'
  gpumesh group join "$(ssh alice gpumesh group invite research)"
"""
)
@click.argument("code")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def join(code: str, as_json: bool) -> None:
    """Join a group with a member's invite CODE and record its members."""
    from gpumesh.client.groups import join_group

    joined = join_group(get_node(), code)
    if as_json:
        emit_json(
            {
                **_group_json(joined.group),
                "inviter": joined.inviter,
                "already_member": joined.already_member,
                "members": [_member_json(v) for v in joined.members],
            }
        )
        return
    verb = "Refreshed" if joined.already_member else "Joined"
    click.echo(
        f"{verb} group {click.style(joined.group.name, bold=True)} ({joined.group.short_id}) "
        f"via {joined.inviter}: {joined.group.member_count} members."
    )
    _print_members(joined.members)


@group.command(
    epilog="""\b
Examples:
  gpumesh group add research bob-laptop
  gpumesh group add research 3f9akq2m       # by node id prefix
"""
)
@click.argument("name", shell_complete=complete_group)
@click.argument("peer", shell_complete=complete_peer)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def add(name: str, peer: str, as_json: bool) -> None:
    """Add the paired PEER to group NAME on this node.

    PEER learns about the group from an invite: `gpumesh group invite NAME`.
    """
    from gpumesh.client.groups import add_member

    added = add_member(get_node(), name, peer)
    if as_json:
        emit_json(
            {
                **_group_json(added.group),
                "already_member": added.already_member,
                "member": _member_json(added.member),
            }
        )
        return
    who = added.member.name
    if added.already_member:
        click.echo(f"{who} is already a member of {added.group.name}.")
    else:
        click.echo(f"Added {who} to {added.group.name} ({added.group.member_count} members).")
    click.echo(f"To let {who} see the group, send them `gpumesh group invite {added.group.name}`.")


@group.command(
    epilog="""\b
Examples:
  gpumesh group members research
  gpumesh group members research --json
"""
)
@click.argument("name", shell_complete=complete_group)
@click.option("--offline", is_flag=True, help="Do not probe the members (local state only).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def members(name: str, offline: bool, as_json: bool) -> None:
    """List the members of group NAME: pairing, reachability, GPUs, free memory, busy/idle.

    Paired members are probed in parallel (about a second at most).
    """
    from gpumesh.client.groups import members as member_views

    node = get_node()
    views = member_views(node, name)
    live: dict[str, Live] = {} if offline else _probe(node, views)
    if as_json:
        emit_json([{**_member_json(v), **_live_json(live.get(v.member.node_id))} for v in views])
        return
    _print_members(views, live)


@dataclass(frozen=True)
class Live:
    """What a probe found out about one member."""

    reach: str
    gpus: str
    free: int | None
    state: str
    problem: str = ""
    """Why it could not be asked (unreachable, not paired back), in full."""


def _probe(node: Any, views: list[MemberView]) -> dict[str, Live]:
    from gpumesh.cli._common import run_async
    from gpumesh.client.placement import evaluate, probe

    targets = [v for v in views if not v.is_self and v.usable]
    results = run_async(probe(node, [(v.name, v.peer) for v in targets]))
    live: dict[str, Live] = {}
    for view, result in zip(targets, results, strict=True):
        status = result.status
        if status is None:
            problem = result.error or "unreachable"
            reach = "no" if problem.startswith("unreachable") else "-"
            live[view.member.node_id] = Live(reach, "-", None, "-", problem)
            continue
        verdict = evaluate(result, 0)
        names = sorted({g.name for g in status.gpus})
        gpus = ", ".join(f"{sum(g.name == n for g in status.gpus)}x {n}" for n in names) or "none"
        free = max((g.available for g in status.gpus), default=None)
        # Busy means GPUMesh jobs there, whether or not they hold a GPU.
        state = "busy" if verdict.busy else ("idle" if verdict.eligible else "-")
        live[view.member.node_id] = Live(f"yes ({result.rtt_ms:.0f} ms)", gpus, free, state)
    return live


def _live_json(live: Live | None) -> dict[str, Any]:
    if live is None:
        return {"reachable": None, "gpus": None, "free_gpu_memory": None, "state": None}
    return {
        "reachable": live.reach.startswith("yes"),
        "reach": live.problem or live.reach,
        "gpus": live.gpus,
        "free_gpu_memory": live.free,
        "state": live.state,
    }


# --- rendering ------------------------------------------------------------------------

# One entry per table column: header and cell text (Rich markup allowed). A new
# column (reachability, GPUs) is one more entry here and one more key in _member_json.
_MEMBER_COLUMNS: list[tuple[str, Callable[[MemberView], str]]] = [
    ("NAME", lambda v: _escape(v.name)),
    ("ID", lambda v: v.member.node_id.short),
    ("ACCESS", lambda v: _colored(v.access, v.label)),
    ("ADDRESSES", lambda v: _escape(", ".join(_addresses(v)) or "-")),
]


def _member_column(header: str) -> Column:
    from gpumesh.cli._table import Column

    if header == "ADDRESSES":
        return Column(header, gives_way=3, least=12)
    if header == "NAME":
        return Column(header, gives_way=2, least=10)
    return Column(header)


def _print_members(views: list[MemberView], live: dict[str, Live] | None = None) -> None:
    from gpumesh.cli._table import Column, print_table
    from gpumesh.units import format_size

    # With live columns the addresses make way (they stay in --offline and --json).
    columns = [c for c in _MEMBER_COLUMNS if not (live and c[0] == "ADDRESSES")]
    headers = [_member_column(header) for header, _ in columns]
    if live:
        # An unreachable member's reason is advice: it moves under the row, never cut.
        headers += [
            Column("REACHABLE", below=True, named_below=True),
            Column("GPUS", gives_way=1, least=10),
        ]
        headers += [Column("FREE"), Column("STATE")]
    rows = []
    for view in views:
        cells = [cell(view) for _, cell in columns]
        if live:
            found = live.get(view.member.node_id)
            if found is None:
                cells += ["-", "-", "-", "-"]
            else:
                free = "-" if found.free is None else format_size(found.free)
                cells += [_escape(found.reach), _escape(found.gpus), free, found.state]
        rows.append(cells)
    print_table(headers, rows)
    # Plain lines, not table cells: a narrow terminal must not cut the advice.
    todo = [v for v in views if v.hint]
    problems = [(v.name, p.problem) for v in views if (p := (live or {}).get(v.member.node_id))]
    problems = [(name, problem) for name, problem in problems if problem]
    if todo or problems:
        click.echo("")
        for view in todo:
            click.echo(f"  {view.name}: {view.hint}")
        for name, problem in problems:
            click.echo(f"  {name}: {problem}")
        if any(not v.peer for v in todo):
            click.echo(
                "Pairing is mutual: they also run `gpumesh pair` with your `gpumesh pair-code`."
            )


def _member_json(view: MemberView) -> dict[str, Any]:
    return {
        "name": view.name,
        "node_id": view.member.node_id,
        "is_self": view.is_self,
        "access": view.access,
        "paired": view.peer is not None,
        "allowed": view.peer.allowed if view.peer is not None else None,
        "addresses": _addresses(view),
        "relay": (view.peer.relay if view.peer else view.member.relay) or None,
        "hint": view.hint or None,
    }


def _group_json(group: Group) -> dict[str, Any]:
    return {
        "name": group.name,
        "group_id": group.group_id,
        "member_count": group.member_count,
        "created_at": group.created_at,
    }


def _addresses(view: MemberView) -> list[str]:
    # A paired peer's own record is fresher than what an invite said.
    return view.peer.dial_addresses() if view.peer is not None else view.member.addresses


def _colored(access: str, text: str) -> str:
    color = _ACCESS_COLORS.get(access, "yellow")
    return f"[{color}]{_escape(text)}[/{color}]"


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
