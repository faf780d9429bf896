"""``gpumesh cancel``"""

from __future__ import annotations

from urllib.parse import quote

import click

from gpumesh.cli._common import get_node, run_async
from gpumesh.cli._complete import complete_peer, complete_submitted_job
from gpumesh.cli._node import node_enabled


@click.command(
    epilog="""\b
Examples:
  gpumesh cancel --peer alice-pc 3f9a2c1b7d0e
  gpumesh cancel 3f9a                  # the peer is known for jobs you submitted
  gpumesh cancel 7c21                  # a job a peer runs here: this node's share stops it
"""
)
@click.option(
    "--peer",
    envvar="GPUMESH_PEER",
    show_envvar=True,
    shell_complete=complete_peer,
    help="The job's provider.",
)
@click.argument("job_id", shell_complete=complete_submitted_job)
def cancel(peer: str | None, job_id: str) -> None:
    """Cancel a job: one you submitted (its provider stops it), or one a peer runs
    here (`gpumesh share` stops it). Its container is stopped; it is never retried."""
    from gpumesh.client.views.jobs import JobResultView
    from gpumesh.protocol.states import JobRole

    if node_enabled():
        import msgspec

        from gpumesh.cli._node import node_client

        path = f"/api/v1/jobs/{quote(job_id, safe='')}/cancel"
        data = node_client().call("POST", path, {"peer": peer})
        result = msgspec.convert(data, JobResultView)
    else:
        from gpumesh.client.jobs import cancel as cancel_by_id

        result = JobResultView.of(run_async(cancel_by_id(get_node(), job_id, peer=peer)))
    if result.role == JobRole.HOSTED:
        click.echo(f"Job {result.job_id} of {result.peer}: {result.state} ({result.message})")
        return
    code = "" if result.exit_code is None else f" (exit {result.exit_code})"
    click.echo(f"Job {result.job_id} on {result.peer}: {result.state}{code}")
