"""``gpumesh cancel``"""

from __future__ import annotations

from urllib.parse import quote

import click

from gpumesh.cli._common import emit_json, json_option
from gpumesh.cli._complete import complete_submitted_job
from gpumesh.cli._node import node_client, peer_option
from gpumesh.protocol.states import JobRole


@click.command(
    epilog="""\b
Examples:
  gpumesh cancel --peer alice-pc 3f9a2c1b7d0e
  gpumesh cancel 3f9a                  # the peer is known for jobs you submitted
  gpumesh cancel 7c21                  # a job a peer runs here: this node's share stops it
  gpumesh cancel shell-5d1e0b9a4c2f    # a peer's open shell here (`gpumesh status` lists
  gpumesh cancel desktop-0a4e2c9d1b3f  #   each open shell, desktop connection and CUDA
  gpumesh cancel cuda-9b2f6d0c3e1a     #   session with its id)
"""
)
@peer_option("The job's provider.")
@click.argument("job_id", shell_complete=complete_submitted_job)
@json_option
def cancel(peer: str | None, job_id: str, as_json: bool) -> None:
    """Cancel a job: one you submitted (its provider stops it), or one a peer runs
    here (`gpumesh share` stops it). Its container is stopped; it is never retried.

    Given the id of a peer's open shell, desktop connection or CUDA session here
    (as `gpumesh status` shows it), `gpumesh share` ends that session; the peer is
    told its owner ended it."""
    kind = _session_kind(job_id)
    if kind is not None:
        _end_session(kind, job_id, as_json)
        return

    # The node process runs this home's share, which carries out a hosted job's cancel.
    path = f"/api/v1/jobs/{quote(job_id, safe='')}/cancel"
    from gpumesh.client.bodies import CancelBody
    from gpumesh.client.views.jobs import JobResultView

    view = node_client().call("POST", path, JobResultView, CancelBody(peer=peer))
    if as_json:
        emit_json(view)
    elif view.role == JobRole.HOSTED:
        click.echo(f"Job {view.job_id} of {view.peer}: {view.state} ({view.message})")
    else:
        code = "" if view.exit_code is None else f" (exit {view.exit_code})"
        click.echo(f"Job {view.job_id} on {view.peer}: {view.state}{code}")


_SESSION_ROUTES = {"shell": "shells", "desktop": "desktop", "cuda": "cuda"}


def _session_kind(given: str) -> str | None:
    """``shell``, ``desktop`` or ``cuda`` for a session's id (job ids are hex only)."""
    kind, dash, rest = given.partition("-")
    return kind if dash and rest and kind in _SESSION_ROUTES else None


def _end_session(kind: str, session_id: str, as_json: bool) -> None:
    from gpumesh.client.views.owner import EndedSessionView

    # The node process runs this home's share, and its sessions.
    path = f"/api/v1/owner/{_SESSION_ROUTES[kind]}/{quote(session_id, safe='')}/stop"
    ended = node_client().call("POST", path, EndedSessionView)
    if as_json:
        emit_json(ended)
        return
    what = {"shell": "shell", "desktop": "desktop connection", "cuda": "CUDA session"}[kind]
    click.echo(f"Ended {ended.peer}'s {what} {ended.id}")
