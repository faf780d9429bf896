"""Routes of groups: the list, and a group's members probed live."""

from __future__ import annotations

from gpumesh.client.groups import group_status, summaries
from gpumesh.client.views.groups import GroupListEntry, MemberStatusEntry
from gpumesh.control.call import Call

__all__ = ["get_groups", "get_members"]


async def get_groups(call: Call) -> object:
    return [GroupListEntry.of_summary(s) for s in summaries(call.node)]


async def get_members(call: Call) -> object:
    statuses = await group_status(call.node, call.param("group"), live=not call.flag("offline"))
    return [MemberStatusEntry.of_status(s) for s in statuses]
