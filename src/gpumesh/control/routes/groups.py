"""Routes of groups: create, list, invite, join, add a member, and the members probed live."""

from __future__ import annotations

from gpumesh.client.bodies import GroupBody, InviteBody, JoinBody, MemberBody
from gpumesh.client.groups import (
    add_member,
    create_group,
    group_status,
    invite_code,
    join_group,
    summaries,
)
from gpumesh.client.views.groups import (
    AddedView,
    GroupListEntry,
    GroupView,
    InviteView,
    JoinedView,
    MemberStatusEntry,
)
from gpumesh.control.call import Call

__all__ = [
    "get_groups",
    "get_members",
    "post_group",
    "post_invite",
    "post_join",
    "post_member",
]


async def get_groups(call: Call) -> object:
    return [GroupListEntry.of_summary(s) for s in summaries(call.node)]


async def post_group(call: Call) -> object:
    body: GroupBody = call.body
    return GroupView.of(create_group(call.node, body.name))


async def post_invite(call: Call) -> object:
    body: InviteBody = call.body
    code = invite_code(call.node, call.param("group"), lifetime=body.expires)
    return InviteView(code, body.expires)


async def post_join(call: Call) -> object:
    body: JoinBody = call.body
    return JoinedView.of_joined(join_group(call.node, body.code))


async def post_member(call: Call) -> object:
    body: MemberBody = call.body
    return AddedView.of_added(add_member(call.node, call.param("group"), body.peer))


async def get_members(call: Call) -> object:
    statuses = await group_status(call.node, call.param("group"), live=not call.flag("offline"))
    return [MemberStatusEntry.of_status(s) for s in statuses]
