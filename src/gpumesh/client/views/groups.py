"""The shapes of ``gpumesh group … --json``: groups, their members and where they stand."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from gpumesh.client.groups import Added, GroupSummary, Joined, MemberStatus, MemberView
    from gpumesh.store.groups import Group

__all__ = [
    "ACCESS_LABELS",
    "AddedView",
    "GroupListEntry",
    "GroupView",
    "InviteView",
    "JoinedView",
    "MemberEntry",
    "MemberStatusEntry",
]


ACCESS_LABELS = {
    "self": "this node",
    "allowed": "paired, allowed",
    "denied": "paired, denied",
    "not paired": "not paired",
    "key differs": "not paired (key differs)",
}
"""A member's ``access`` in a few words, for tables."""


class GroupView(msgspec.Struct):
    """A group (``group create``), and the first keys of every shape below that is one."""

    name: str
    group_id: str
    member_count: int
    created_at: float

    @classmethod
    def of(cls, group: Group) -> GroupView:
        return cls(*_group_fields(group))


class GroupListEntry(GroupView):
    """One row of ``group list``."""

    usable: int
    """Other members that are paired and allowed."""
    others: int
    joined_via: str | None
    """The member whose invite this node joined with; None when created here."""

    @classmethod
    def of_summary(cls, summary: GroupSummary) -> GroupListEntry:
        return cls(
            *_group_fields(summary.group),
            usable=summary.usable,
            others=summary.others,
            joined_via=summary.inviter or None,
        )


class MemberEntry(msgspec.Struct):
    """A member as this node sees it from local state (``group join``, ``group add``)."""

    name: str
    node_id: str
    is_self: bool
    access: str
    paired: bool
    allowed: bool | None
    """None when not paired."""
    addresses: list[str]
    relay: str | None
    hint: str | None

    @classmethod
    def of(cls, view: MemberView) -> MemberEntry:
        return cls(*_member_fields(view))


class MemberStatusEntry(MemberEntry):
    """One row of ``group members``: a member and what a probe found (null: not asked)."""

    reachable: bool | None
    """Whether it answered; None when it was not asked."""
    reach: str | msgspec.UnsetType = msgspec.UNSET
    """``yes (N ms)``, or why it did not answer; absent when it was not asked."""
    gpus: str | None = None
    """``2x L4, 1x A100``, ``none``, or ``-`` without an answer."""
    free_gpu_memory: int | None = None
    """Bytes free on its roomiest GPU."""
    state: str | None = None
    """``busy``, ``idle`` or ``-``."""
    probe: str | None = None
    """What the probe found: ``idle``, ``busy``, ``not sharing``, ``refused`` or
    ``unreachable``; None when it was not asked."""

    @classmethod
    def of_status(cls, status: MemberStatus) -> MemberStatusEntry:
        fields = _member_fields(status.view)
        live = status.live
        if live is None:
            return cls(*fields, reachable=None)
        shown = live.state if live.state in ("busy", "idle") else "-"
        return cls(
            *fields,
            reachable=live.answered,
            reach=f"yes ({live.rtt_ms:.0f} ms)" if live.answered else live.reason,
            gpus=live.gpu_summary,
            free_gpu_memory=live.free_gpu_memory,
            state=str(shown),
            probe=str(live.state),
        )


class InviteView(msgspec.Struct):
    """``group invite``: the signed invite, and how long it stays valid."""

    code: str
    expires_in: float
    """Seconds."""


class JoinedView(GroupView):
    """``group join``."""

    inviter: str
    already_member: bool
    members: list[MemberEntry]

    @classmethod
    def of_joined(cls, joined: Joined) -> JoinedView:
        return cls(
            *_group_fields(joined.group),
            inviter=joined.inviter,
            already_member=joined.already_member,
            members=[MemberEntry.of(v) for v in joined.members],
        )


class AddedView(GroupView):
    """``group add``."""

    already_member: bool
    member: MemberEntry

    @classmethod
    def of_added(cls, added: Added) -> AddedView:
        return cls(
            *_group_fields(added.group),
            already_member=added.already_member,
            member=MemberEntry.of(added.member),
        )


# The fields of a group and of a member in order, the first ones of several shapes.


def _group_fields(group: Group) -> tuple[str, str, int, float]:
    return group.name, group.group_id, group.member_count, group.created_at


def _member_fields(
    view: MemberView,
) -> tuple[str, str, bool, str, bool, bool | None, list[str], str | None, str | None]:
    peer = view.peer
    return (
        view.name,
        str(view.member.node_id),
        view.is_self,
        view.access,
        peer is not None,
        peer.allowed if peer is not None else None,
        view.addresses,
        (peer.relay if peer is not None else view.member.relay) or None,
        view.hint or None,
    )
