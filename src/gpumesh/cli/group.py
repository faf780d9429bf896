"""``gpumesh group``: create, list, invite, join, add and members."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote

import click

from gpumesh.cli._common import emit_json
from gpumesh.cli._complete import complete_group, complete_peer
from gpumesh.cli._node import node_client
from gpumesh.cli._table import Column, escape, print_table
from gpumesh.units import format_duration

if TYPE_CHECKING:
    from gpumesh.client.views.groups import MemberEntry, MemberStatusEntry

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
    from gpumesh.client.bodies import GroupBody
    from gpumesh.client.views.groups import GroupView

    created = node_client().call("POST", "/api/v1/groups", GroupView, GroupBody(name=name))
    if as_json:
        emit_json(created)
        return
    click.echo(f"Created group {click.style(created.name, bold=True)} ({created.group_id[:12]}).")
    click.echo(f"Invite others with `gpumesh group invite {created.name}`.")


@group.command(
    name="list", epilog="\b\nExamples:\n  gpumesh group list\n  gpumesh group list --json"
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def list_groups(as_json: bool) -> None:
    """List the groups this node created or joined."""
    from gpumesh.client.views.groups import GroupListEntry

    rows = node_client().call("GET", "/api/v1/groups", list[GroupListEntry])
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo(
            "No groups yet. Create one with `gpumesh group create NAME`, or join one with "
            "`gpumesh group join '<invite>'`."
        )
        return
    now = time.time()
    shown = []
    for s in rows:
        origin = f"joined via {escape(s.joined_via)}" if s.joined_via else "created here"
        shown.append(
            [
                escape(s.name),
                s.group_id[:12],
                str(s.member_count),
                f"{s.usable}/{s.others}",
                f"{format_duration(now - s.created_at)} ago, {origin}",
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
    from gpumesh.client.bodies import InviteBody
    from gpumesh.client.views.groups import InviteView
    from gpumesh.units import parse_duration

    lifetime = parse_duration(expires)
    path = f"/api/v1/groups/{quote(name, safe='')}/invite"
    code = node_client().call("POST", path, InviteView, InviteBody(expires=lifetime)).code
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
    from gpumesh.client.bodies import JoinBody
    from gpumesh.client.views.groups import JoinedView

    joined = node_client().call("POST", "/api/v1/groups/join", JoinedView, JoinBody(code=code))
    if as_json:
        emit_json(joined)
        return
    verb = "Refreshed" if joined.already_member else "Joined"
    click.echo(
        f"{verb} group {click.style(joined.name, bold=True)} ({joined.group_id[:12]}) "
        f"via {joined.inviter}: {joined.member_count} members."
    )
    _print_members([_unprobed(m) for m in joined.members])


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
    from gpumesh.client.bodies import MemberBody
    from gpumesh.client.views.groups import AddedView

    path = f"/api/v1/groups/{quote(name, safe='')}/members"
    added = node_client().call("POST", path, AddedView, MemberBody(peer=peer))
    if as_json:
        emit_json(added)
        return
    who = added.member.name
    if added.already_member:
        click.echo(f"{who} is already a member of {added.name}.")
    else:
        click.echo(f"Added {who} to {added.name} ({added.member_count} members).")
    click.echo(f"To let {who} see the group, send them `gpumesh group invite {added.name}`.")


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
    from gpumesh.client.views.groups import MemberStatusEntry

    path = f"/api/v1/groups/{quote(name, safe='')}/members?offline={'true' if offline else 'false'}"
    statuses = node_client().call("GET", path, list[MemberStatusEntry])
    if as_json:
        emit_json(statuses)
        return
    _print_members(statuses)


# --- rendering ------------------------------------------------------------------------

# One entry per table column: the column and its cell text (Rich markup allowed). A
# new column (reachability, GPUs) is one more entry here and one more field in
# gpumesh.client.views.groups.MemberEntry.
_MEMBER_COLUMNS: list[tuple[Column, Callable[[MemberStatusEntry], str]]] = [
    (Column("NAME", gives_way=2, least=10), lambda v: escape(v.name)),
    (Column("ID"), lambda v: v.node_id[:12]),
    (Column("ACCESS"), lambda v: _access(v.access)),
    (Column("ADDRESSES", gives_way=3, least=12), lambda v: escape(", ".join(v.addresses) or "-")),
]


def _unprobed(member: MemberEntry) -> MemberStatusEntry:
    """A member as ``group members --offline`` shows it: not asked."""
    import msgspec

    from gpumesh.client.views.groups import MemberStatusEntry

    return MemberStatusEntry(**msgspec.structs.asdict(member), reachable=None)


def _print_members(statuses: list[MemberStatusEntry]) -> None:
    # Live columns only when some member was asked; the addresses then make way
    # (they stay in --offline and --json).
    live = any(s.probe is not None for s in statuses)
    columns = [c for c in _MEMBER_COLUMNS if not (live and c[0].header == "ADDRESSES")]
    headers = [column for column, _ in columns]
    if live:
        # An unreachable member's reason is advice: it moves under the row, never cut.
        headers += [
            Column("REACHABLE", below=True, named_below=True),
            Column("GPUS", gives_way=1, least=10),
        ]
        headers += [Column("FREE"), Column("STATE")]
    rows = [
        [cell(status) for _, cell in columns] + (_live_cells(status) if live else [])
        for status in statuses
    ]
    print_table(headers, rows)
    # Plain lines, not table cells: a narrow terminal must not cut the advice.
    todo = [s for s in statuses if s.hint]
    problems = [(s.name, _reason(s)) for s in statuses if _reason(s)]
    if todo or problems:
        click.echo("")
        for view in todo:
            click.echo(f"  {view.name}: {view.hint}")
        for name, problem in problems:
            click.echo(f"  {name}: {problem}")
        if any(not v.paired for v in todo):
            click.echo(
                "Pairing is mutual: they also run `gpumesh pair` with your `gpumesh pair-code`."
            )


def _reason(entry: MemberStatusEntry) -> str:
    """Why a member that was asked did not answer, in full; empty otherwise."""
    if entry.probe is None or entry.reachable or not isinstance(entry.reach, str):
        return ""
    return entry.reach


def _live_cells(entry: MemberStatusEntry) -> list[str]:
    """REACHABLE, GPUS, FREE and STATE of one member; dashes when it was not asked
    (this node says so, so that it does not read as one that did not answer)."""
    from gpumesh.units import format_size

    if entry.probe is None:
        return ["this node" if entry.is_self else "not asked", "-", "-", "-"]
    if entry.reachable and isinstance(entry.reach, str):
        reach = entry.reach
    else:
        reach = "no" if entry.probe == "unreachable" else "refused"
    free = entry.free_gpu_memory
    return [
        escape(reach),
        escape(entry.gpus or "-"),
        "-" if free is None else format_size(free),
        entry.probe,
    ]


def _access(access: str) -> str:
    """A member's access, labelled and colored."""
    from gpumesh.client.views.groups import ACCESS_LABELS

    color = _ACCESS_COLORS.get(access, "yellow")
    return f"[{color}]{escape(ACCESS_LABELS.get(access, access))}[/{color}]"
