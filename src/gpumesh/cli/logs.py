"""``gpumesh logs``"""

from __future__ import annotations

import contextlib

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
    from gpumesh.cli.run import exit_status
    from gpumesh.client.jobs import JobResult
    from gpumesh.client.jobs import logs as job_logs

    events = job_logs(get_node(), job_id, follow=follow)
    printer = JobPrinter(numbered=True)

    async def show() -> JobResult:
        async with contextlib.aclosing(events):
            async for event in events:
                printer.show(event)
        return events.result

    result = run_async(show())
    if result.final:
        raise SystemExit(exit_status(result))
