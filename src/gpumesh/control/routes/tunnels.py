"""Routes that bring a peer's desktop or GPU to this machine: a desktop tunnel and a
CUDA bridge (loopback listeners the node process keeps while the caller's event
stream lasts: leaving the stream closes them), and CUDA's demo and bench, run here
on a session of the node process's own."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from typing import TypeVar

from gpumesh.client.bodies import CudaBody, TunnelBody
from gpumesh.client.cuda import bench, demo
from gpumesh.client.cudadevice import RemoteDevice, local_pair
from gpumesh.client.cudaremote import DEFAULT_MEMORY, Bridge, carry_socket
from gpumesh.client.desktop import check_desktop, desktop_tunnel, parse_bind
from gpumesh.client.node import Node
from gpumesh.client.views.desktop import (
    CudaBridgeView,
    DesktopDoctorView,
    TunnelConnectionView,
    TunnelRefusedView,
    TunnelView,
    TunnelWarningView,
)
from gpumesh.control.call import Call
from gpumesh.control.streams import EventStream, Feed, feed_events
from gpumesh.errors import BadRequestError

__all__ = [
    "get_desktop_doctor",
    "post_cuda_bench",
    "post_cuda_bridge",
    "post_cuda_demo",
    "post_desktop_connect",
]

T = TypeVar("T")

_LINK_BYTES = 64 * 1024 * 1024
"""What ``cuda bench`` pushes over the link to show its own throughput beside the copies'."""


async def get_desktop_doctor(call: Call) -> object:
    """The desktop servers on 127.0.0.1, the share, who may use it, who is connected."""
    return DesktopDoctorView.of(await check_desktop(call.node))


async def post_desktop_connect(call: Call) -> object:
    """Tunnel a peer's shared desktop to a loopback port here, as Server-Sent Events:
    ``tunnelview`` once it listens, then ``tunnelconnectionview`` for each local
    connection opened (``tunnelrefusedview``: another user's process, refused;
    ``tunnelwarningview``: one the provider refused), until the stream is left
    (the tunnel closes) or an ``error`` says why it ended."""
    body: TunnelBody = call.body
    bind = parse_bind(body.bind) if body.bind else ("127.0.0.1", None)

    async def work(feed: Feed) -> object:
        opened = 0

        def put(view: object) -> None:  # named as TUNNEL_EVENTS names it
            feed.put(type(view).__name__.lower(), view)

        def carried(path: str) -> None:
            nonlocal opened
            opened += 1
            put(TunnelConnectionView(opened, path))

        await desktop_tunnel(
            call.node,
            body.peer,
            bind=bind,
            ready=lambda ready: put(TunnelView.of(ready)),
            refused_local=lambda uid: put(TunnelRefusedView(uid)),
            connection_refused=lambda error: put(TunnelWarningView(error.message)),
            carried=carried,
        )
        return None  # it ends by raising why

    return EventStream(feed_events(work))


async def post_cuda_bridge(call: Call) -> object:
    """Serve programs here a CUDA session on a peer each, at ``bind``, as Server-Sent
    Events: ``cudabridgeview`` (where it listens) once it does, until the stream is
    left (the bridge closes) or an ``error``."""
    body: CudaBody = call.body
    if body.bind is None:
        raise BadRequestError("a bridge needs bind: HOST:PORT on loopback, or unix:PATH")
    if body.bind.startswith("unix:") and not body.bind[5:].startswith("/"):
        raise BadRequestError("bind unix:PATH needs an absolute path")
    bridge = Bridge(call.node, body.peer, body.bind, body.memory or DEFAULT_MEMORY)

    async def work(feed: Feed) -> object:
        try:
            feed.put("cudabridgeview", CudaBridgeView(await bridge.start()))
            await bridge.serve_forever()
        finally:
            bridge.close()
        return None

    return EventStream(feed_events(work))


async def post_cuda_demo(call: Call) -> object:
    """Add two vectors on the peer's device and check the result."""
    body: CudaBody = call.body
    return await _on_device(call.node, body, demo)


async def post_cuda_bench(call: Call) -> object:
    """Call latency and copy bandwidth on the peer's device, beside the link's own."""
    body: CudaBody = call.body
    link = await call.node.connect(body.peer)
    raw = await call.node.throughput(body.peer, _LINK_BYTES)
    result = await _on_device(call.node, body, bench)
    return dataclasses.replace(result, link_rtt_ms=link.rtt_ms, link_mb_per_s=raw.mb_per_s)


async def _on_device(node: Node, body: CudaBody, work: Callable[[RemoteDevice], T]) -> T:
    """``work`` on a session on ``body.peer``'s device, carried by this process's
    loop; the calls themselves block, so they run in a thread."""
    node.peer(body.peer)  # an unknown peer is refused before anything opens
    mine, theirs = local_pair()
    carrying = asyncio.ensure_future(
        carry_socket(node, body.peer, body.memory or DEFAULT_MEMORY, theirs)
    )

    def run() -> T:
        with RemoteDevice.over_socket(mine, body.peer) as device:
            return work(device)

    try:
        return await asyncio.to_thread(run)
    finally:
        carrying.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await carrying
