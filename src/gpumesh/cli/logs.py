"""``gpumesh logs``"""

from __future__ import annotations

import click

from gpumesh.cli._common import get_node, run_async
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
    from gpumesh.cli._jobview import JobPrinter
    from gpumesh.client.jobs import SUBMITTED, follow_hosted, follow_job
    from gpumesh.errors import NotFoundError

    node = get_node()
    store = node.home.store
    if job_id is None:
        recent = store.jobs(limit=1)
        if not recent:
            raise NotFoundError("no jobs yet: start one with `gpumesh run`")
        job = recent[0]
    else:
        job = store.find_job(job_id)
    printer = JobPrinter(numbered=True)
    if job.role == SUBMITTED:
        result = run_async(
            follow_job(node, job.job_id, follow=follow, callbacks=printer.callbacks())
        )
    else:
        result = run_async(
            follow_hosted(node, job.job_id, follow=follow, callbacks=printer.callbacks())
        )
    if result.final:
        from gpumesh.cli.run import exit_status

        raise SystemExit(exit_status(result))
