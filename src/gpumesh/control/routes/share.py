"""Routes of sharing: start, stop and follow this home's share (the node
process's :class:`~gpumesh.daemon.sharing.Sharing`)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gpumesh.client.views.node import PublishView
from gpumesh.control.call import Call, Credential, Refusal
from gpumesh.control.routes.node import node_process
from gpumesh.control.shareviews import ShareLine
from gpumesh.control.streams import KEEP_ALIVE, EventStream, paced, sse
from gpumesh.errors import AgentError, ConfigError, NotFoundError

if TYPE_CHECKING:
    from gpumesh.client.bodies import PauseBody, ShareOptions
    from gpumesh.daemon.sharing import Sharing

__all__ = [
    "delete_share",
    "get_share",
    "get_share_output",
    "post_pause",
    "post_resume",
    "post_share",
    "post_share_publish",
    "sharing_of",
]


def sharing_of(call: Call) -> Sharing:
    sharing = node_process(call).sharing
    if sharing is None:
        raise AgentError("this node process is stopping: run the command again")
    return sharing


async def get_share(call: Call) -> object:
    return sharing_of(call).view()


async def post_share(call: Call) -> object:
    """Share with the body's options (``{}``: the defaults); the running share when
    it has the same options; 409 when it has others. Answers once peers are served
    and the share's start is reported (its output, from ``first_line``)."""
    options: ShareOptions = call.body
    try:
        options.check()
    except ConfigError as exc:
        raise Refusal(422, exc) from None
    return await sharing_of(call).start(options)


async def delete_share(call: Call) -> object:
    """Stop sharing (withdrawn from the registry, links closed); the share as it ended."""
    sharing = sharing_of(call)
    how = "stopped from the dashboard" if call.credential is Credential.COOKIE else None
    if not await (sharing.stop(how) if how else sharing.stop()):
        raise NotFoundError(f"{call.node.home.path} does not share: start with `gpumesh share`")
    return sharing.view()


async def post_pause(call: Call) -> object:
    """The owner takes the machine back (``gpumesh pause``): answers once the guests
    are stopped."""
    body: PauseBody = call.body
    try:
        return await sharing_of(call).pause(body.grace)
    except ConfigError as exc:
        raise Refusal(422, exc) from None


async def post_resume(call: Call) -> object:
    """Offer the machine to peers again (``gpumesh resume``)."""
    return sharing_of(call).resume()


async def post_share_publish(call: Call) -> object:
    """Refresh the share's registry listing or address record now (``gpumesh sync``)."""
    sharing = sharing_of(call)
    return PublishView(sharing=sharing.active, published=sharing.republish(), pid=os.getpid())


async def get_share_output(call: Call) -> object:
    """What the share says, as Server-Sent Events: a ``line`` per line (its ``seq``
    is the event's id), then ``end`` (the share as it is then) when the share
    stops; without ``follow``, the lines there are now, then ``end``."""
    sharing = sharing_of(call)
    after = call.number("after", 0, most=2**62)
    if not call.flag("follow", True):
        return EventStream(_lines_then(sharing.lines(after), sharing.view()))
    return EventStream(_share_events(sharing.follow(after)))


async def _lines_then(lines: list[Any], view: Any) -> AsyncIterator[bytes]:
    for line in lines:
        yield sse("line", line, line.seq)
    yield sse("end", view)


async def _share_events(follow: Any) -> AsyncIterator[bytes]:
    events = paced(follow)
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
