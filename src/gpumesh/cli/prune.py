"""``gpumesh prune``"""

from __future__ import annotations

import click


@click.command(
    epilog="""\b
Examples:
  gpumesh prune                       # finished jobs older than 7 days
  gpumesh prune --older-than 0 --dry-run
"""
)
@click.option(
    "--older-than",
    "older_than",
    default="7d",
    show_default=True,
    metavar="DURATION",
    help="Only jobs created longer ago than this (e.g. 12h, 7d, 0).",
)
@click.option("--dry-run", is_flag=True, help="List what would go, remove nothing.")
def prune(older_than: str, dry_run: bool) -> None:
    """Remove finished jobs with their logs (and, for hosted jobs, their workdirs)."""
    from gpumesh.cli._node import node_client
    from gpumesh.client.bodies import PruneBody
    from gpumesh.client.views.joblist import PrunedJob
    from gpumesh.units import parse_duration

    body = PruneBody(older_than=parse_duration(older_than), dry_run=dry_run)
    removed = node_client().call("POST", "/api/v1/jobs/prune", list[PrunedJob], body)
    verb = "Would remove" if dry_run else "Removed"
    for job in removed:
        click.echo(f"{verb} {job.job_id} ({job.role}, {job.state})")
    click.echo(f"{verb} {len(removed)} finished job(s).")
