"""``gpumesh cuda``: share, allow, deny, doctor, demo, bench and bridge."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from gpumesh.cli._common import emit_json, fail, get_node, json_option
from gpumesh.cli._complete import complete_peer
from gpumesh.cli._node import node_client, peer_change
from gpumesh.units import format_size


def _session_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--peer`` (default $GPUMESH_PEER) and ``--gpu-memory`` (as ``run`` names it;
    ``--memory``, its first name, stays as a hidden alias) of a CUDA session."""
    for option in reversed(
        (
            click.option(
                "--peer",
                envvar="GPUMESH_PEER",
                show_envvar=True,
                required=True,
                shell_complete=complete_peer,
                help="The provider.",
            ),
            click.option(
                "--gpu-memory",
                "memory",
                metavar="SIZE",
                help="Device memory to hold for the session (e.g. 2GB; default 1GiB).",
            ),
            click.option("--memory", "memory_alias", metavar="SIZE", hidden=True),
        )
    ):
        command = option(command)
    return command


def _memory(memory: str | None, memory_alias: str | None) -> int | None:
    """The bytes of ``--gpu-memory`` (or its alias ``--memory``), if given."""
    text = memory if memory is not None else memory_alias
    if text is None:
        return None
    from gpumesh.errors import ConfigError
    from gpumesh.units import parse_size

    size = parse_size(text)
    if size <= 0:
        raise ConfigError(f"--gpu-memory {text!r} must be a size above zero, such as 2GB")
    return size


@click.group(
    epilog="""\b
Examples:
  gpumesh cuda doctor                  # on the provider: GPU driver, or the fallback and why
  gpumesh cuda share                   # offer CUDA sessions whenever this node shares
  gpumesh cuda allow bob-laptop        # its own allowlist, empty by default
  gpumesh cuda demo --peer alice-pc    # on the consumer
  gpumesh cuda bench --peer alice-pc
  gpumesh cuda bridge --peer alice-pc --bind 127.0.0.1:17999
\b
An experimental subset of the CUDA driver API (device query, memory, copies,
kernels from PTX, synchronize) run on a peer's GPU, or in its host memory
when no GPU driver loads there. Not a drop-in for PyTorch; from Python:
`from gpumesh.cuda import RemoteDevice`.
"""
)
def cuda() -> None:
    """Use a peer's GPU from your programs over the LAN (experimental)."""


@cuda.command(epilog="\b\nExamples:\n  gpumesh cuda doctor\n  gpumesh cuda doctor --json")
@json_option
def doctor(as_json: bool) -> None:
    """Say what a CUDA session on this node runs on, and who may open one."""
    from gpumesh.client.cuda import doctor as check

    report = check(get_node())
    if as_json:
        emit_json(report)
        return
    if report.backend == "driver":
        click.echo(click.style(f"Driver   libcuda loads: {report.detail}", fg="green"))
        for index, info in enumerate(report.devices):
            click.echo(
                f"GPU {index}    {info.name}, {format_size(info.memory_total)}, "
                f"compute {info.major}.{info.minor}, {info.multiprocessors} SMs"
            )
    else:
        click.echo(click.style("Driver   host-memory fallback: ", fg="yellow") + report.detail)
        click.echo("         sessions get memory calls and GPUMesh's own kernels only")
    shared = "yes (when this node shares)" if report.sharing else "no (`gpumesh cuda share`)"
    click.echo(f"Shared   {shared}")
    allowed = ", ".join(report.allowed) or "nobody (`gpumesh cuda allow PEER`)"
    click.echo(f"Allowed  {allowed}")
    click.echo(f"Worker   {report.worker or 'runs as job_user, without privileges or groups'}")
    for session in report.sessions:
        click.echo(
            f"Session  {session.peer}: {format_size(session.memory)} on "
            f"{session.device} (worker pid {session.pid})"
        )


@cuda.command(
    epilog="\b\nExamples:\n  gpumesh cuda share\n  gpumesh cuda share stop",
)
@click.argument("action", required=False, type=click.Choice(["stop"]))
def share(action: str | None) -> None:
    """Offer CUDA sessions whenever this node shares (remembered); `stop` ends them.

    Returns at once. Only peers on the CUDA allowlist (`gpumesh cuda allow`) may
    open a session; each one's memory is held like a job's GPU memory.
    """
    from gpumesh.client.owner import worker_user
    from gpumesh.client.views.owner import CudaShareView

    on = action != "stop"
    view = node_client().call("POST" if on else "DELETE", "/api/v1/cuda/share", CudaShareView)
    if not on:
        click.echo("CUDA sessions are no longer offered; open ones were ended")
        return
    if not view.sharing:
        click.echo("CUDA sessions are offered whenever this node shares (`gpumesh share`)")
    else:
        click.echo("CUDA sessions are offered now and whenever this node shares")
    note = worker_user(get_node().home)
    if note is not None:
        click.echo(click.style(note, fg="yellow"))


@cuda.command(epilog="\b\nExamples:\n  gpumesh cuda allow bob-laptop")
@click.argument("peer", shell_complete=complete_peer)
@json_option
def allow(peer: str, as_json: bool) -> None:
    """Let a paired PEER open CUDA sessions here."""
    peer_change(peer, "cuda/allow", as_json, lambda r: f"{r.name} may open CUDA sessions here")


@cuda.command(epilog="\b\nExamples:\n  gpumesh cuda deny bob-laptop")
@click.argument("peer", shell_complete=complete_peer)
@json_option
def deny(peer: str, as_json: bool) -> None:
    """Take PEER off the CUDA allowlist; its open sessions end at once."""
    peer_change(
        peer, "cuda/deny", as_json, lambda r: f"{r.name} may no longer open CUDA sessions here"
    )


@cuda.command(epilog="\b\nExamples:\n  gpumesh cuda demo --peer alice-pc")
@_session_options
def demo(peer: str, memory: str | None, memory_alias: str | None) -> None:
    """Add two vectors on PEER's device and check the result; say where it ran."""
    from gpumesh.client.bodies import CudaBody
    from gpumesh.client.cuda import DemoResult

    body = CudaBody(peer=peer, memory=_memory(memory, memory_alias))
    result = node_client().call("POST", "/api/v1/cuda/demo", DemoResult, body)
    where = (
        f"on {result.device} ({result.detail})"
        if result.backend == "driver"
        else f"on the host-memory fallback ({result.detail})"
    )
    if not result.correct:
        fail(f"vector add on {peer} ran {where} but {result.mismatches} results were wrong")
    click.echo(
        f"vector add of {result.elements:,} floats on {peer}: correct, ran {where}, "
        f"{result.seconds:.2f}s"
    )


@cuda.command(epilog="\b\nExamples:\n  gpumesh cuda bench --peer alice-pc")
@_session_options
@json_option
def bench(peer: str, memory: str | None, memory_alias: str | None, as_json: bool) -> None:
    """Call latency, and copy bandwidth each way 1 MiB ... 256 MiB, next to the link's."""
    from gpumesh.client.bodies import CudaBody
    from gpumesh.client.cuda import BenchResult

    body = CudaBody(peer=peer, memory=_memory(memory, memory_alias))
    result = node_client().call("POST", "/api/v1/cuda/bench", BenchResult, body)
    if as_json:
        emit_json(result)
        return
    where = result.device if result.backend == "driver" else "host-memory fallback"
    click.echo(f"CUDA on {peer} ({where})")
    click.echo(
        f"call latency  p50 {result.call_p50_ms:.2f} ms  (link ping {result.link_rtt_ms:.2f} ms)"
    )
    click.echo(f"small copies  {result.small_copies_per_s:,.0f}/s of 4 KiB")
    click.echo(f"link raw      {result.link_mb_per_s:,.0f} MB/s (64 MiB over QUIC)")
    click.echo("    size   host->device   device->host")
    mib = 1024 * 1024
    for row in result.rows:
        click.echo(
            f"{row.size // mib:>4} MiB  {row.htod_mb_s:>9,.0f} MB/s {row.dtoh_mb_s:>9,.0f} MB/s"
        )
    for size in result.skipped:
        click.echo(f"{size // mib:>4} MiB  skipped: over the session's memory (--gpu-memory)")


@cuda.command(
    epilog="""\b
Examples:
  gpumesh cuda bridge --peer alice-pc --bind unix:~/.gpumesh/cuda.sock
  gpumesh cuda bridge --peer alice-pc --bind 127.0.0.1:17999
\b
Programs on this machine connect and speak the CUDA call protocol (see
docs/architecture.md, "CUDA remoting"); from Python:
RemoteDevice.bridge("unix:/home/me/.gpumesh/cuda.sock"). Each connection is
one session on PEER, authenticated as this node. Prefer unix:PATH: the socket
is made 0600, so only you can open it. On TCP (Linux only) a connection is
served only when the kernel's socket table proves it is your own process's;
any other is refused.
"""
)
@_session_options
@click.option(
    "--bind",
    default="127.0.0.1:17999",
    show_default=True,
    help="Loopback HOST:PORT, or unix:PATH.",
)
def bridge(peer: str, memory: str | None, memory_alias: str | None, bind: str) -> None:
    """Serve a local endpoint through which programs here use PEER's device."""
    import os

    from gpumesh.client.bodies import CudaBody
    from gpumesh.client.views.desktop import CudaBridgeView

    if bind.startswith("unix:"):  # the node process's folder is not this one's
        bind = "unix:" + os.path.abspath(os.path.expanduser(bind[5:]))
    body = CudaBody(peer=peer, memory=_memory(memory, memory_alias), bind=bind)
    bridge = node_client().send("POST", "/api/v1/cuda/bridge", body)
    for event in bridge.events({"cudabridgeview": CudaBridgeView}):
        assert isinstance(event.view, CudaBridgeView)
        click.echo(f"CUDA bridge to {peer} on {event.view.where} (Ctrl-C ends it)", err=True)
