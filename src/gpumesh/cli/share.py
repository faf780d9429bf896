"""``gpumesh share`` and ``gpumesh share stop``"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import click

from gpumesh.cli._common import fail, get_node, setup_logging
from gpumesh.errors import ExitCode, InUseError


@click.group(
    invoke_without_command=True,
    epilog="""\b
Examples:
  gpumesh share                        # foreground; Ctrl-C stops it
  gpumesh share --port 47001
  gpumesh share --public --region us-west --contact 'matrix:@alice:example.org'
                                       # also list the GPUs in the registry (rendezvous_url)
  gpumesh share stop                   # stop the one running for this home
  gpumesh share --print-systemd-unit > gpumesh-share.service
                                       # keep sharing across reboots (see the unit's header)
""",
)
@click.option("--host", help="Address to listen on (config listen_host, default 0.0.0.0).")
@click.option("--port", type=int, help="UDP port to listen on (config listen_port, default 47000).")
@click.option("--max-vram", metavar="SIZE", help="Most GPU memory one job may ask for, e.g. 16GB.")
@click.option(
    "--public",
    is_flag=True,
    help="List this node's GPUs (metadata only) in the registry at rendezvous_url "
    "while sharing; withdrawn when sharing stops. A listing grants nothing.",
)
@click.option("--region", metavar="R", help="Region shown in the listing (config region).")
@click.option("--contact", metavar="TEXT", default="", help="How people reach you, e.g. an email.")
@click.option(
    "--show-addresses",
    is_flag=True,
    help="With --public: put this node's public addresses in the listing (default: none; "
    "paired peers find them through the address record anyway).",
)
@click.option(
    "--print-systemd-unit",
    "print_unit",
    is_flag=True,
    help="Print a systemd unit that runs this `gpumesh share` (same home, user and flags) "
    "at boot, and exit.",
)
@click.pass_context
def share(
    ctx: click.Context,
    host: str | None,
    port: int | None,
    max_vram: str | None,
    public: bool,
    region: str | None,
    contact: str,
    show_addresses: bool,
    print_unit: bool,
) -> None:
    """Share this machine with paired, allowed peers (runs in the foreground).

    Prints this node's pairing code, then serves requests from peers on the
    allowlist only; everyone else gets a typed refusal. It is also this home's
    node process (the control API on $GPUMESH_HOME/control.sock, which commands
    use), taking over from one running in the background; `gpumesh daemon stop`
    stops it too. Sharing needs Linux; macOS and Windows machines work as
    consumers.

    Jobs reach what config job_network says: by default (internet) DNS and the
    internet, never this machine, other containers, link-local or private
    addresses. That takes firewall rules only root installs: as another user,
    share refuses it until you choose job_network none or bridge.
    """
    if ctx.invoked_subcommand is not None:
        return
    _require_linux()
    node = get_node()
    node.home.require_initialized()
    if print_unit:
        _print_unit(node.home.path, host, port, max_vram)
        return
    running = node.home.read_agent_info()
    if running is not None:
        raise InUseError(
            f"`gpumesh share` is already running for {node.home.path} (pid {running.pid}, "
            f"udp {running.host}:{running.port}); stop it with `gpumesh share stop`"
        )
    from gpumesh.cli import _publish
    from gpumesh.units import parse_size

    cap = parse_size(max_vram) if max_vram else None
    _publish.check(node.home.config, public, show_addresses)
    setup_logging(node.home.logs_dir, console_level="info")
    asyncio.run(_serve(node, host, port, cap, (public, region, contact, show_addresses)))


def _require_linux() -> None:
    """The provider runs Docker jobs with NVIDIA's runtime and Linux's sandboxing
    (openat2, /proc, unix sockets): elsewhere, say so before anything starts."""
    from gpumesh import platform
    from gpumesh.errors import RuntimeUnavailableError

    if platform.system() != "linux":
        raise RuntimeUnavailableError(
            f"`gpumesh share` needs Linux (this is {platform.system_name()}): a provider "
            "runs jobs in Docker with NVIDIA's runtime on Linux. This machine works as a consumer "
            "(pair, run, cp, exec, app); share from a Linux machine"
        )


def _print_unit(home: Path, host: str | None, port: int | None, max_vram: str | None) -> None:
    import getpass

    from gpumesh.client.service import share_command, systemd_unit

    extra: list[str] = []
    for flag, value in (("--host", host), ("--port", port), ("--max-vram", max_vram)):
        if value is not None:
            extra += [flag, str(value)]
    unit = systemd_unit(
        home.resolve(), user=getpass.getuser(), command=share_command(), extra_args=extra
    )
    click.echo(unit, nl=False)


async def _report_relay(relay: object) -> None:
    from gpumesh.errors import GPUMeshError
    from gpumesh.transport.relayclient import RelayClient

    assert isinstance(relay, RelayClient)
    with contextlib.suppress(GPUMeshError):
        await relay.wait_registered(3.0)
    if relay.registered.is_set():
        click.echo(f"  relay {relay.label}: registered, seen as {relay.observed}")
        return
    why = relay.error.message if relay.error else "no answer yet"
    click.echo(
        click.style(f"  relay {relay.label}: not registered ({why}); retrying", fg="yellow"),
        err=True,
    )


async def _report_job_user(agent: object) -> None:
    """Who peers' jobs run as here; loudly when it is root (job_root on)."""
    from gpumesh.agent.server import Agent
    from gpumesh.errors import ConfigError, GPUMeshError

    assert isinstance(agent, Agent)
    try:
        who = await agent.containers.who_runs(str(agent.home.config.get("image")))
    except ConfigError as exc:
        click.echo(click.style(f"WARNING: {exc.message}", fg="yellow", bold=True), err=True)
        return
    except GPUMeshError:
        return  # no Docker: jobs are refused with their own clear message
    if who.user.startswith("0:") and who.owner == (0, 0):
        click.echo(
            click.style(
                "WARNING: job_root is on: peers' jobs run as ROOT in their containers, with a "
                "writable root filesystem"
                + ("" if who.storage_size else " of unbounded size")
                + "; root in a container shares this machine's kernel. Turn it off with "
                "`gpumesh config set job_root off`, or use Docker's userns-remap",
                fg="red",
                bold=True,
            ),
            err=True,
        )
        return
    inside = "root in a remapped user namespace" if who.user.startswith("0:") else who.user
    if not who.writable_root:
        root = "read-only"
    else:
        root = "writable, bounded" if who.storage_size else "writable, unbounded"
    click.echo(f"  jobs run as {inside} (host uid {who.owner[0]}), root filesystem {root}")


async def _serve(
    node: object,
    host: str | None,
    port: int | None,
    max_vram: int | None,
    public: tuple[bool, str | None, str, bool] = (False, None, "", False),
) -> None:
    from gpumesh.agent.server import Agent
    from gpumesh.cli import _publish
    from gpumesh.client.node import Node
    from gpumesh.runtime.jobnet import describe_mode
    from gpumesh.units import format_size

    assert isinstance(node, Node)
    agent = Agent(node.home, host=host, port=port, max_vram=max_vram)
    bound_host, bound_port = await agent.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, agent.stop)
    info = node.info()
    where = f"udp {bound_host}:{bound_port}"
    click.echo(f"Sharing {click.style(info.name, bold=True)} ({info.node_id.short}) on {where}")
    inventory = agent.gpus.inventory
    gpus = inventory.gpus()
    if inventory.source == "simulated":
        click.echo(
            click.style(
                "WARNING: SIMULATED GPUs (test mode, not real hardware)", fg="red", bold=True
            )
        )
    if gpus:
        for gpu in gpus:
            click.echo(
                f"  GPU {gpu.index}: {gpu.name}, {format_size(gpu.memory_total)} "
                f"({format_size(gpu.memory_free)} free)"
            )
        if agent.gpus.max_vram:
            click.echo(
                f"  jobs may ask for at most {format_size(agent.gpus.max_vram)} of GPU memory"
            )
    else:
        click.echo("  no NVIDIA GPU here: peers can run CPU-only jobs (without --gpu-memory)")
    await _report_job_user(agent)
    network = agent.containers.network()
    click.echo(
        f"  limits: {agent.share_limits().describe()}; job network {network.mode} "
        f"({describe_mode(network.mode)})"
    )
    if agent.relay is not None:
        await _report_relay(agent.relay)
    publishing = await _publish.start(
        node,
        agent,
        public=public[0],
        region=public[1],
        contact=public[2],
        show_addresses=public[3],
    )
    click.echo("Only paired, allowed peers are served. Pairing code for a new peer (valid 1 hour):")
    click.echo(node.pairing_code())
    click.echo("Press Ctrl-C or run `gpumesh share stop` to stop.", err=True)
    api = await _become_node(node, agent)
    try:
        await agent.wait_stopped()
    finally:
        agent.stop()
        if publishing is not None:
            await publishing.stop()
        if api is not None:
            await api
    click.echo("Stopped sharing.", err=True)


async def _become_node(node: object, agent: object) -> asyncio.Future[object] | None:
    """Serve this home's control API from this process too: `share` is then the
    home's node process (a background one hands over to it), which commands talk
    to and `gpumesh daemon stop` stops, sharing included. When another foreground
    process (`gpumesh-control`) holds the home, sharing goes on beside it."""
    from gpumesh.agent.server import Agent
    from gpumesh.client.node import Node
    from gpumesh.daemon import enabled
    from gpumesh.daemon.process import run_node
    from gpumesh.errors import GPUMeshError

    assert isinstance(node, Node) and isinstance(agent, Agent)
    if not enabled():
        return None
    stop = asyncio.Event()
    socket_path = node.home.path / "control.sock"

    def announce(line: str) -> None:
        if "the control API of" in line:
            click.echo(f"  control API: {socket_path} (this process is the home's node process)")

    async def serve() -> object:
        try:
            await run_node(
                node,
                listen=None,
                allow_remote=False,
                hosts=[],
                detached=False,
                announce=announce,
                stop=stop,
            )
        except GPUMeshError as exc:
            click.echo(
                click.style(f"  control API: not served here ({exc.message})", fg="yellow"),
                err=True,
            )
            return None
        agent.stop()  # `gpumesh daemon stop` ends sharing too
        return None

    task = asyncio.ensure_future(serve())
    agent_stopped = asyncio.ensure_future(agent.wait_stopped())
    agent_stopped.add_done_callback(lambda _: stop.set())
    return task


@share.command()
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds to wait.")
def stop(timeout: float) -> None:
    """Stop the `gpumesh share` running for this home."""
    node = get_node()
    running = node.home.read_agent_info()
    if running is None:
        fail(f"no `gpumesh share` is running for {node.home.path}", ExitCode.FAILED)
    os.kill(running.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.home.read_agent_info() is None:
            click.echo(f"Stopped `gpumesh share` (pid {running.pid}).")
            return
        time.sleep(0.05)
    fail(
        f"`gpumesh share` (pid {running.pid}) did not stop within {timeout:.0f}s",
        ExitCode.FAILED,
    )
