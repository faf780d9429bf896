"""Routes of the owner: who uses this machine, ending their sessions, the
desktop and CUDA shares, shells opened from here."""

from __future__ import annotations

from gpumesh.client.bodies import DesktopShareBody, ShellRequest
from gpumesh.client.cuda import share
from gpumesh.client.desktop import share_desktop, stop_desktop_share
from gpumesh.client.jobspec import parse_env
from gpumesh.client.owner import SessionKind, end_session, owner_view
from gpumesh.client.views.owner import (
    CudaShareView,
    DesktopShareView,
    EndedSessionView,
    OwnerStatusView,
)
from gpumesh.control.call import Call
from gpumesh.errors import AgentError, BadRequestError
from gpumesh.protocol.desktop import DesktopKind

__all__ = [
    "delete_cuda_share",
    "delete_desktop_share",
    "get_owner",
    "post_cuda_share",
    "post_desktop_share",
    "post_end_cuda",
    "post_end_desktop",
    "post_end_shell",
    "post_shell",
]


async def post_desktop_share(call: Call) -> object:
    """Offer the desktop server on 127.0.0.1:``port`` (a new port cuts the old one's
    connections)."""

    body: DesktopShareBody = call.body
    shared = share_desktop(call.node, DesktopKind(body.kind), body.port)
    sharing = call.node.home.agent is not None
    return DesktopShareView(True, str(shared.kind), shared.port, sharing)


async def delete_desktop_share(call: Call) -> object:
    """Stop offering the desktop; its open connections are cut."""

    stopped = stop_desktop_share(call.node)
    return DesktopShareView(stopped, sharing=call.node.home.agent is not None)


async def post_cuda_share(call: Call) -> object:
    return _set_cuda_share(call, True)


async def delete_cuda_share(call: Call) -> object:
    """Stop offering CUDA sessions; open ones end."""
    return _set_cuda_share(call, False)


def _set_cuda_share(call: Call, on: bool) -> object:
    share(call.node, on)
    return CudaShareView(on, sharing=call.node.home.agent is not None)


async def post_shell(call: Call) -> object:
    """A shell on a peer, run by this process: where to connect for its bytes
    (:mod:`gpumesh.daemon.shells`)."""

    state = call.state
    body: ShellRequest = call.body

    call.node.peer(body.peer)  # an unknown peer is refused now, not on the socket
    parse_env([f"{key}={value}" for key, value in body.env.items()])  # `--env`'s checks
    if body.gpu_memory < 0 or body.rows < 0 or body.cols < 0:
        raise BadRequestError("gpu_memory, rows and cols cannot be negative")
    if state.shells is None:
        raise AgentError("this control API is not served by a node process")
    return await state.shells.offer(call.node, body)


async def get_owner(call: Call) -> object:
    return OwnerStatusView.of(owner_view(call.node, limit=call.number("limit", 50, least=1)))


async def _end_session(call: Call, kind: str) -> object:
    ended = await end_session(call.node, SessionKind(kind), call.param("session"))
    return EndedSessionView.of(ended)


async def post_end_shell(call: Call) -> object:
    return await _end_session(call, "shell")


async def post_end_desktop(call: Call) -> object:
    return await _end_session(call, "desktop")


async def post_end_cuda(call: Call) -> object:
    return await _end_session(call, "cuda")
