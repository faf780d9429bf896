"""Routes of this node and its node process: status, GPUs, settings."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import msgspec
from starlette.responses import Response

from gpumesh.client.bodies import ConfigBody, TcpBody
from gpumesh.client.jobrefresh import refresh_jobs
from gpumesh.client.views.node import ConfigChangeView, GpusView, StatusView
from gpumesh.control.call import Call
from gpumesh.errors import AgentError
from gpumesh.gpu.inventory import detect_inventory
from gpumesh.settings import API_ADDR_DEFAULT, ENV_API_ADDR, env
from gpumesh.version import VERSION_HEADER

if TYPE_CHECKING:
    from gpumesh.daemon.process import NodeProcess

__all__ = [
    "delete_config",
    "get_gpu_history",
    "get_gpus",
    "get_node",
    "get_status",
    "node_process",
    "post_node_stop",
    "post_node_tcp",
    "put_config",
]


async def get_status(call: Call) -> object:
    node = call.node
    unknown: set[str] = set()
    if not call.flag("offline") and node.home.store.unconfirmed_submitted_jobs():
        for answer in await refresh_jobs(node):
            unknown |= answer.job_ids
    return StatusView.of(node.status(), submitted_unknown=len(unknown))


async def get_gpus(call: Call) -> object:
    inventory = detect_inventory()
    agent = call.node.home.agent_info()
    return GpusView.of(inventory, inventory.gpus(), agent.reclaimed if agent else None)


async def put_config(call: Call) -> object:
    """Set one setting (``config set``): a running share sees it at once."""

    body: ConfigBody = call.body
    key, config = call.param("key"), call.node.home.config
    config.set(key, body.value)
    config.save()
    call.node.home.agent_changed()
    return ConfigChangeView.of(call.node.home, key)


async def delete_config(call: Call) -> object:
    """Return one setting to its default (``config unset``)."""

    key, config = call.param("key"), call.node.home.config
    config.unset(key)
    config.save()
    call.node.home.agent_changed()
    return ConfigChangeView.of(call.node.home, key)


async def get_gpu_history(call: Call) -> object:
    """The last hour of this machine's GPU readings, sampled by this process."""
    call.state.gpu_history.start()
    return call.state.gpu_history.view()


def node_process(call: Call) -> NodeProcess:
    if call.state.process is None:
        raise AgentError("this control API is not served by a node process")
    return call.state.process


async def get_node(call: Call) -> object:
    view = node_process(call).view()
    # The version in a header too: a command's check of it reads no body.
    return Response(
        msgspec.json.encode(view),
        media_type="application/json",
        headers={VERSION_HEADER: view.version},
    )


async def post_node_stop(call: Call) -> object:
    """Stop the node process once this answer is sent (open streams end; a share
    it runs stops first)."""
    process = node_process(call)
    why = "the node process was stopped (`gpumesh daemon stop`)"
    asyncio.get_running_loop().call_soon(process.end, why)
    return process.view()


async def post_node_tcp(call: Call) -> object:
    """Serve this API on TCP too (a dashboard's way in); the node process then stays
    until stopped. Nothing changes when it serves TCP already."""

    process = node_process(call)
    if process.serve_tcp is None:
        raise AgentError("this node process is stopping: run the command again")
    body: TcpBody = call.body
    await process.serve_tcp(body.listen or env(ENV_API_ADDR) or API_ADDR_DEFAULT)
    return process.view()
