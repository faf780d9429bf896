"""Groups: named sets of nodes, created here or joined with a member's invite.

A group is bookkeeping, not access: it tells a node who its group's members
are and where to find them, while running on a member still needs mutual
pairing. So the members view says, for each member, whether it is this node,
a paired peer this node allows, a paired peer it denies, or not paired yet.

Everything here is local (the store and the identity) except
:func:`group_status`, which asks the paired members where they stand through
:func:`gpumesh.client.placement.probe`. Invites carry the inviter's view of the
group, and joining merges it in: a new group from anyone's invite, a known group
only from a known member's.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumesh.client.placement import evaluate, probe
from gpumesh.client.views.groups import ACCESS_LABELS
from gpumesh.errors import (
    ConfigError,
    NotFoundError,
    PairingCodeError,
    PeerError,
    UnknownPeerError,
)
from gpumesh.identity.invites import (
    INVITE_LIFETIME,
    MAX_INVITE_LIFETIME,
    InviteMember,
    check_group_name,
    make_invite,
    new_group_id,
    verify_invite,
)
from gpumesh.store.db import Store
from gpumesh.store.groups import Group, GroupMember
from gpumesh.store.peers import Peer
from gpumesh.units import format_duration

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.client.placement import Probe
    from gpumesh.protocol.messages import GpuReport

__all__ = [
    "ACCESS_ALLOWED",
    "ACCESS_DENIED",
    "ACCESS_KEY_DIFFERS",
    "ACCESS_NOT_PAIRED",
    "ACCESS_SELF",
    "Added",
    "GroupSummary",
    "Joined",
    "MemberLive",
    "MemberState",
    "MemberStatus",
    "MemberView",
    "add_member",
    "create_group",
    "find_group",
    "group_status",
    "groups",
    "invite_code",
    "join_group",
    "member_view",
    "members",
    "summaries",
]

ACCESS_SELF = "self"
ACCESS_ALLOWED = "allowed"
ACCESS_DENIED = "denied"
ACCESS_NOT_PAIRED = "not paired"
ACCESS_KEY_DIFFERS = "key differs"
"""Not paired, and a paired peer of the same name has another key (reinstalled, or not them)."""


@dataclass(frozen=True)
class MemberView:
    """One member of a group as this node sees it.

    Built by :func:`member_view` from local state only; live columns
    (reachability, GPUs) belong in a richer view built from this one.
    """

    member: GroupMember
    is_self: bool
    peer: Peer | None
    """The paired peer with this member's key, or None."""
    access: str
    """``self``, ``allowed``, ``denied``, ``not paired`` or ``key differs``."""

    @property
    def name(self) -> str:
        return self.member.name

    @property
    def usable(self) -> bool:
        """Whether this node may use the member (it must also have paired this node)."""
        return self.access == ACCESS_ALLOWED

    @property
    def addresses(self) -> list[str]:
        """Where to dial it: a paired peer's own record is fresher than an invite."""
        return self.peer.dial_addresses() if self.peer is not None else self.member.addresses

    @property
    def label(self) -> str:
        """The access state in a few words, for tables."""
        return ACCESS_LABELS[self.access]

    @property
    def hint(self) -> str:
        """What to do next about this member, or empty when nothing."""
        if self.access == ACCESS_DENIED:
            return f"paired, denied: `gpumesh allow {self.name}` lets them use this node again"
        if self.access == ACCESS_NOT_PAIRED:
            return "not paired: ask for their `gpumesh pair-code`"
        if self.access == ACCESS_KEY_DIFFERS:
            return (
                f"not paired: another key is paired as {self.name!r}; check with them, then "
                "`gpumesh pair --rekey '<their code>'`"
            )
        return ""


@dataclass(frozen=True)
class GroupSummary:
    """A group and its members, for listings."""

    group: Group
    members: list[MemberView]

    @property
    def others(self) -> int:
        return sum(not m.is_self for m in self.members)

    @property
    def usable(self) -> int:
        """How many other members are paired and allowed."""
        return sum(m.usable for m in self.members)

    @property
    def inviter(self) -> str:
        """Name of the member whose invite this node joined with; empty if created here."""
        for view in self.members:
            if view.member.node_id == self.group.joined_via:
                return view.name
        return self.group.joined_via[:12]


@dataclass(frozen=True)
class Joined:
    group: Group
    inviter: str
    """The name of the member who signed the invite."""
    already_member: bool
    """This node was in the group already; the invite refreshed its members."""
    members: list[MemberView]


@dataclass(frozen=True)
class Added:
    group: Group
    member: MemberView
    already_member: bool


class MemberState(enum.StrEnum):
    """Where a member stands, as a probe found it."""

    IDLE = "idle"
    """It answered, and has no GPUMesh jobs and an idle GPU (or only CPUs)."""
    BUSY = "busy"
    """It answered, and runs GPUMesh jobs (on a GPU or not) or all its GPUs are busy."""
    NOT_SHARING = "not sharing"
    """It answered, and takes no jobs."""
    REFUSED = "refused"
    """It would not say: it has not paired this node, or the probe failed there."""
    UNREACHABLE = "unreachable"
    """No answer came: no path to it, or it was too slow."""


_ANSWERED = frozenset({MemberState.IDLE, MemberState.BUSY, MemberState.NOT_SHARING})


@dataclass(frozen=True)
class MemberLive:
    """What a probe found out about one member."""

    state: MemberState
    reason: str = ""
    """Why it did not answer, in full (advice included); empty when it answered."""
    rtt_ms: float = 0.0
    """How long its answer took, in milliseconds (0 without an answer)."""
    gpus: list[GpuReport] | None = None
    """Its GPUs as it reported them; None when it did not answer."""
    simulated: bool = False
    """Its GPUs are simulated (a test mode), not real hardware."""

    @property
    def answered(self) -> bool:
        return self.state in _ANSWERED

    @property
    def free_gpu_memory(self) -> int | None:
        """Bytes free on its roomiest GPU; None without GPUs or an answer."""
        return max((g.available for g in self.gpus or []), default=None)

    @property
    def gpu_summary(self) -> str:
        """Its GPUs in a few words (``2x L4, 1x A100``), ``none``, or ``-`` without an answer."""
        if self.gpus is None:
            return "-"
        names = sorted({g.name for g in self.gpus})
        summary = ", ".join(f"{sum(g.name == n for g in self.gpus)}x {n}" for n in names)
        return f"{summary} (SIMULATED)" if summary and self.simulated else summary or "none"

    @classmethod
    def of(cls, probe_result: Probe) -> MemberLive:
        status = probe_result.status
        if status is None:
            reason = probe_result.error or "unreachable"
            unreachable = probe_result.unreachable or not probe_result.error
            state = MemberState.UNREACHABLE if unreachable else MemberState.REFUSED
            return cls(state, reason)
        # As placement sees it with no GPU memory asked: busy means GPUMesh jobs
        # there, whether or not they hold a GPU.
        verdict = evaluate(probe_result, 0)
        if verdict.busy:
            state = MemberState.BUSY
        elif verdict.eligible:
            state = MemberState.IDLE
        else:
            state = MemberState.NOT_SHARING
        return cls(
            state,
            rtt_ms=probe_result.rtt_ms,
            gpus=list(status.gpus),
            simulated=status.gpu_source == "simulated",
        )


@dataclass(frozen=True)
class MemberStatus:
    """One member: how this node stands with it, and what a probe found."""

    view: MemberView
    live: MemberLive | None
    """None when it was not asked: this node, a member it may not use, or offline."""


def create_group(node: Node, name: str, *, clock: Callable[[], float] = time.time) -> Group:
    """A new group with this node as its only member."""
    check_group_name(name)
    store = node.home.store
    existing = store.group_by_name(name)
    if existing is not None:
        raise ConfigError(
            f"a group named {name!r} already exists on this node ({existing.short_id}): pick "
            f"another name, or invite others to it with `gpumesh group invite {name}`"
        )
    return store.add_group(new_group_id(), name, [_self_member(node)], now=clock())


def groups(node: Node) -> list[Group]:
    return node.home.store.groups()


def find_group(node: Node, query: str) -> Group:
    """A group by name or id prefix; unknown groups raise NotFoundError."""
    return node.home.store.find_group(query)


def summaries(node: Node) -> list[GroupSummary]:
    return [GroupSummary(g, _views(node, g)) for g in node.home.store.groups()]


def members(node: Node, query: str) -> list[MemberView]:
    """Every member of a group, by name, with this node's pairing state for each."""
    return _views(node, find_group(node, query))


async def group_status(node: Node, query: str, *, live: bool = True) -> list[MemberStatus]:
    """Every member of a group, and where the paired ones this node may use stand now.

    They are asked in parallel, each within
    :data:`gpumesh.client.placement.PROBE_TIMEOUT`; with ``live`` false none is.
    """

    views = members(node, query)
    targets = [v for v in views if live and not v.is_self and v.usable]
    results = await probe(node, [(v.name, v.peer) for v in targets]) if targets else []
    found = {v.member.node_id: MemberLive.of(r) for v, r in zip(targets, results, strict=True)}
    return [MemberStatus(v, found.get(v.member.node_id)) for v in views]


def member_view(node: Node, member: GroupMember) -> MemberView:
    """How this node stands with one member (matched by key, never by name)."""
    store = node.home.store
    if member.public_key == node.home.identity.public_key:
        return MemberView(member, is_self=True, peer=None, access=ACCESS_SELF)
    peer = store.peer_by_key(member.public_key)
    if peer is not None:
        return MemberView(member, False, peer, ACCESS_ALLOWED if peer.allowed else ACCESS_DENIED)
    clash = any(p.name == member.name for p in store.peers())
    return MemberView(member, False, None, ACCESS_KEY_DIFFERS if clash else ACCESS_NOT_PAIRED)


def invite_code(
    node: Node,
    query: str,
    *,
    lifetime: float = INVITE_LIFETIME,
    clock: Callable[[], float] = time.time,
) -> str:
    """A signed invite to a group, carrying every member this node knows."""
    if not 0 < lifetime <= MAX_INVITE_LIFETIME:
        raise ConfigError(
            f"an invite must expire after more than 0 seconds and at most "
            f"{format_duration(MAX_INVITE_LIFETIME)}; use a duration such as 1h or 2d"
        )
    group = find_group(node, query)
    store = node.home.store
    me = _self_member(node)
    # Refresh our own entry: the addresses we listen on may have changed since.
    store.save_group_members(group.group_id, [me], now=clock())
    listed = [me]
    for member in store.group_members(group.group_id):
        if member.public_key == me.public_key:
            continue
        peer = store.peer_by_key(member.public_key)
        # A paired peer's addresses are fresher: the one that last worked comes first.
        addresses, relay = (
            (peer.dial_addresses(), peer.relay)
            if peer is not None
            else (member.addresses, member.relay)
        )
        listed.append(InviteMember(member.name, member.public_key, addresses, relay))
    return make_invite(
        node.home.identity, group.group_id, group.name, listed, clock=clock, lifetime=lifetime
    )


def join_group(node: Node, code: str, *, clock: Callable[[], float] = time.time) -> Joined:
    """Verify an invite and record its group and members here.

    Joining again (a newer invite to the same group) refreshes the members,
    but only with an invite signed by a key this node already knows as a
    member of that group: anyone can sign an invite with a known group's id,
    so a stranger's is refused and changes nothing. Members this node paired
    keep the name, addresses and relay of their pairing, whatever any invite
    says (the store sees to that); invites only fill in the others.
    """
    invite = verify_invite(code, clock=clock)
    store = node.home.store
    me = _self_member(node)
    if invite.inviter == me.public_key:
        raise PeerError(
            f"that is this node's own invite to {invite.group_name!r}: send it to the node "
            "that should join, and run `gpumesh group join` there"
        )
    same_name = store.group_by_name(invite.group_name)
    if same_name is not None and same_name.group_id != invite.group_id:
        raise ConfigError(
            f"this node already has a different group named {invite.group_name!r} "
            f"({same_name.short_id}; the invite is for {invite.group_id[:12]}): group names "
            "are unique on a node, so check with "
            f"{invite.inviter_member.name} which group they meant"
        )
    # Our own entry comes from us, not from the inviter's possibly older view of us.
    listed = [m for m in invite.members if m.public_key != me.public_key] + [me]
    known = None
    with contextlib.suppress(NotFoundError):
        known = store.group_by_id(invite.group_id)
    if known is not None:
        if not any(m.public_key == invite.inviter for m in store.group_members(known.group_id)):
            raise PairingCodeError(
                f"that invite to group {known.name} ({known.short_id}) is signed by "
                f"{_signer(store, invite.inviter_member)}, not a member of {known.name} this "
                "node knows, so it was refused; ask a member you know for an invite "
                f"(`gpumesh group members {known.name}` lists them)"
            )
        store.save_group_members(invite.group_id, listed, now=clock())
        group = store.group_by_id(invite.group_id)
    else:
        group = store.add_group(
            invite.group_id,
            invite.group_name,
            listed,
            joined_via=invite.inviter_member.node_id,
            now=clock(),
        )
    views = _views(node, group)
    # The name this node knows the inviter by (its pairing's, if paired), not the invite's.
    inviter = next(v.name for v in views if v.member.public_key == invite.inviter)
    return Joined(group, inviter, known is not None, views)


def add_member(
    node: Node, query: str, peer_query: str, *, clock: Callable[[], float] = time.time
) -> Added:
    """Add a paired peer (by name or id prefix) to a group on this node.

    Only this node's record changes: the peer learns of the group from an invite.
    """
    group = find_group(node, query)
    store = node.home.store
    try:
        peer = store.find_peer(peer_query)
    except UnknownPeerError:
        raise UnknownPeerError(
            f"no paired peer named {peer_query!r}: only paired peers can be added to a "
            f"group; pair first (`gpumesh pair '<code>'`), or send them "
            f"`gpumesh group invite {group.name}`"
        ) from None
    already = any(m.node_id == peer.node_id for m in store.group_members(group.group_id))
    store.save_group_members(group.group_id, [peer], now=clock())
    group = store.group_by_id(group.group_id)
    added = next(m for m in store.group_members(group.group_id) if m.node_id == peer.node_id)
    return Added(group, member_view(node, added), already)


def _views(node: Node, group: Group) -> list[MemberView]:
    return [member_view(node, m) for m in node.home.store.group_members(group.group_id)]


def _signer(store: Store, member: InviteMember) -> str:
    """The signer of an invite in a message: its paired name if any, and its id."""
    peer = store.peer_by_key(member.public_key)
    name = peer.name if peer is not None else member.name
    return f"{name} ({member.node_id.short})"


def _self_member(node: Node) -> InviteMember:
    """This node as a group member: its name, key, and where it listens now."""
    config = node.home.config
    return InviteMember(
        config.node_name, node.home.identity.public_key, node.advertised_addresses(), config.relay
    )
