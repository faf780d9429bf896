"""``gpumesh logs``"""

from __future__ import annotations

import click

from gpumesh.cli._complete import complete_job


@click.command(
    epilog="""\b
Examples:
  gpumesh logs                 # the most recent job
  gpumesh logs 3f9a -f         # follow by id prefix; reconnects if the link drops
"""
)
@click.argument("job_id", required=False, shell_complete=complete_job)
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the job ends.")
def logs(job_id: str | None, follow: bool) -> None:
    """Print a job's output (stdout and stderr kept apart), attempts numbered.

    Works for jobs this node submitted (fetched from the provider) and jobs it
    hosts (read locally). Exits with the job's exit code once it has ended.
    """
    # The node process gives the job's events; a follow resumes across its restart.
    from gpumesh.cli._node import follow as follow_job
    from gpumesh.cli._node import node_client
    from gpumesh.cli._notes import ViewPrinter, exit_status_of
    from gpumesh.errors import NotFoundError

    if job_id is None:
        from gpumesh.client.views.joblist import JobListEntry

        path = "/api/v1/jobs?limit=1&offline=true"
        recent = node_client().call("GET", path, list[JobListEntry])
        if not recent:
            raise NotFoundError("no jobs yet: start one with `gpumesh run`")
        job_id = recent[0].job_id
    result = follow_job(job_id, ViewPrinter(job_id, numbered=True), live=follow)
    if result.final:
        raise SystemExit(exit_status_of(result.state, result.exit_code))
