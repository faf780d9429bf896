"""``gpumesh pause`` and ``gpumesh resume``: the owner takes the machine back, and
offers it again. Requests to the node process, which runs this home's share."""

from __future__ import annotations

import click

from gpumesh.cli._common import DURATION, emit_json, json_option
from gpumesh.cli._node import node_client

__all__ = ["pause", "resume"]

_ANSWER_MARGIN = 60.0
"""Seconds a pause's answer may take past its grace (jobs' ends recorded, shells gone)."""


@click.command(
    epilog="""\b
Examples:
  gpumesh pause                 # guests' jobs get SIGTERM, then are stopped after 30s
  gpumesh pause --grace 5s      # a game is about to start: 5 seconds
  gpumesh resume                # peers may use this machine again
"""
)
@click.option(
    "--grace",
    type=DURATION,
    default=30.0,
    show_default="30s",
    metavar="DURATION",
    help="Time guest jobs get after SIGTERM to save their work before they are stopped.",
)
@json_option
def pause(grace: float, as_json: bool) -> None:
    """Take this machine back from your peers until `gpumesh resume`.

    Guest jobs get SIGTERM and are stopped after the grace; they end `preempted`
    (their submitters are told why). Guest shells and CUDA sessions end; a
    desktop you share stays. Until you resume, peers' jobs, shells and CUDA
    sessions are refused and `run --group` places work elsewhere. The pause
    outlives a restart. Returns once the guests are stopped."""
    from gpumesh.client.bodies import PauseBody
    from gpumesh.control.shareviews import PauseView

    view = node_client().call(
        "POST", "/api/v1/share/pause", PauseView, PauseBody(grace), timeout=grace + _ANSWER_MARGIN
    )
    if as_json:
        emit_json(view)
        return
    jobs = len(view.jobs)
    stopped = (
        f"{jobs} guest job{'s' if jobs != 1 else ''} preempted, {view.sessions} session(s) ended"
    )
    head = "Paused" if view.changed else "Already paused"
    click.echo(f"{head}: {stopped}. Peers get nothing until `gpumesh resume`.")


@click.command(
    epilog="""\b
Examples:
  gpumesh resume
"""
)
@json_option
def resume(as_json: bool) -> None:
    """Offer this machine to your peers again after `gpumesh pause`."""
    from gpumesh.control.shareviews import PauseView

    view = node_client().call("POST", "/api/v1/share/resume", PauseView)
    if as_json:
        emit_json(view)
    elif view.changed:
        click.echo("Resumed: peers may use this machine again.")
    else:
        click.echo("Not paused: peers may use this machine already.")
