"""``gpumesh app sync|run|pull``"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpumesh.cli._common import emit_json, fail, json_option
from gpumesh.cli._complete import complete_submitted_job
from gpumesh.cli._node import job_options, node_client, peer_option
from gpumesh.cli._notes import exit_status_of
from gpumesh.errors import ExitCode
from gpumesh.units import format_size

if TYPE_CHECKING:
    from gpumesh.client.bodies import AppRunBody
    from gpumesh.client.views.apps import AppRunView, SyncView


def _dir_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--dir DIRECTORY``, required, as each `app` command takes it."""
    return click.option(
        "--dir", "folder", type=click.Path(file_okay=False), required=True, help=help
    )


@click.group(
    epilog="""\b
Examples:
  gpumesh app sync --peer alice-pc --dir ./proj
  gpumesh app sync --peer alice-pc --dir ./proj --dry-run
  gpumesh app run --peer alice-pc --dir ./proj --out ./renders -- python render.py
  gpumesh app pull --job JOB_ID --dir ./job-out
\b
An app is a project folder kept in your folder on the peer at /apps/NAME
(NAME: the local folder's name). Each sync sends only the files that changed
(compared by SHA-256) and deletes there the files removed here; files the
jobs wrote there stay. .gpumeshignore and the default ignores apply.
""",
)
def app() -> None:
    """Keep a project folder on a peer and run jobs in it."""


@app.command()
@peer_option("Provider.", required=True)
@_dir_option("The local folder to sync (what its .gpumeshignore names is left out).")
@click.option("--dry-run", is_flag=True, help="List what would be sent and skipped; send nothing.")
@json_option
def sync(peer: str, folder: str, dry_run: bool, as_json: bool) -> None:
    """Sync the folder DIR into /apps/NAME in your folder on PEER."""
    from gpumesh.client.bodies import SyncBody

    body = SyncBody(peer=peer, dir=os.path.abspath(folder), dry_run=dry_run)
    answer = node_client().send("POST", "/api/v1/apps/sync", body)
    from gpumesh.client.views import to_json
    from gpumesh.client.views.apps import SyncView

    view = answer.answer(SyncView)
    if as_json:
        click.echo(to_json(view))
    elif dry_run:
        for path in view.sent:
            click.echo(f"send    {path}")
        for path in view.deleted:
            click.echo(f"delete  {path}")
        for skipped in view.skipped:
            click.echo(f"skip    {skipped.path}  ({skipped.rule})")
        click.echo(
            f"dry run: {len(view.sent)} to send, {len(view.deleted)} to delete, "
            f"{view.files_unchanged} unchanged; nothing sent"
        )
    else:
        click.echo(_summary(view))


def _summary(view: SyncView) -> str:
    """The one line that says what a sync did."""
    return (
        f"synced {view.remote} on {view.peer}: {view.files_sent} sent "
        f"({format_size(view.bytes_sent)}), {view.files_deleted} deleted, "
        f"{view.files_unchanged} unchanged"
    )


@app.command(context_settings={"allow_interspersed_args": False})
@peer_option("Provider.", required=True)
@_dir_option("The local folder to sync first; the job runs in its copy on PEER.")
@click.option("--out", type=click.Path(), help="Pull the app's folder of this name back here.")
@click.option("--image", help="Container image (default: config `image` / $GPUMESH_IMAGE).")
@click.option("--gpu-memory", metavar="SIZE", help="GPU memory the job needs, e.g. 8GB.")
@click.option("--retries", type=int, help="Re-run a failed attempt up to N times (backoff).")
@click.option("--timeout", metavar="DURATION", help="Stop an attempt after e.g. 30m or 2h.")
@click.option("-e", "--env", "env_items", multiple=True, metavar="KEY=VAL", help="Set a variable.")
@click.option(
    "--mount",
    "mounts",
    multiple=True,
    metavar="FOLDER:PATH[:rw]",
    help="Also mount FOLDER of your sandbox on the peer (e.g. a dataset copied there "
    "with `gpumesh cp`) at PATH; read-only unless :rw. Repeatable.",
)
@click.option("-q", "--quiet", is_flag=True, help="Print only the job's own output.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print what the run did as JSON at its end (the job's output goes to stderr).",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(
    peer: str,
    folder: str,
    out: str | None,
    image: str | None,
    gpu_memory: str | None,
    retries: int | None,
    timeout: str | None,
    env_items: tuple[str, ...],
    mounts: tuple[str, ...],
    quiet: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Sync DIR, run COMMAND in it (mounted at /workspace), stream its output.

    With --out LOCAL_DIR, the folder named like LOCAL_DIR inside the app
    (--out ./renders: /apps/NAME/renders) is pulled back into LOCAL_DIR.
    Exits with the job's exit code.
    """
    out_name = ""
    if out is not None:
        out_name = Path(os.path.abspath(out)).name
        if not out_name or out_name.startswith("."):
            fail(f"--out {out}: give a folder name, like ./renders")
    from gpumesh.client.bodies import AppRunBody

    body = AppRunBody(
        peer=peer,
        dir=os.path.abspath(folder),
        out=None if out is None else os.path.abspath(out),
        command=list(command),
        **job_options(image, env_items, gpu_memory, retries, timeout, mounts),
    )
    view = _run_through_node(body, quiet=quiet or as_json, json_out=as_json)
    status = exit_status_of(view.job.state, view.job.exit_code)
    if as_json:
        emit_json(view)
        missing = out is not None and not view.pulled
        raise SystemExit(status or (ExitCode.FAILED if missing else 0))
    _pulled(view, out, out_name, status, quiet)
    raise SystemExit(status)


def _pulled(view: AppRunView, out: str | None, out_name: str, status: int, quiet: bool) -> None:
    """What ``app run --out`` says of the folder it pulled back, or failed to."""
    if out is None:
        return
    peer = view.sync.peer
    if not view.pulled:
        fail(
            f"the job produced no folder {out_name}/ in {view.sync.remote} on "
            f"{peer}: nothing to pull into {out}",
            status or ExitCode.FAILED,
        )
    if not quiet:
        click.echo(f"pulled {peer}:{view.out_remote} -> {out}", err=True)


def _run_through_node(body: AppRunBody, *, quiet: bool, json_out: bool) -> AppRunView:
    """``app run`` done by the node process, its steps and output printed here as
    ``gpumesh run`` prints them; the app run's view. A node process that dies once
    the job was accepted is replaced and the job's output resumes where it stopped."""
    from gpumesh.cli._notes import ViewPrinter
    from gpumesh.client.views.apps import SyncView
    from gpumesh.daemon.apprun import NodeAppRun

    printer = ViewPrinter("", quiet=quiet, output_to_stderr=json_out)
    run = NodeAppRun(node_client, body)
    for event in run.events():
        if isinstance(event.view, SyncView):
            if not quiet:
                click.echo(_summary(event.view), err=True)
        else:
            printer.show(event.view)
    assert run.view is not None  # the events ran out: the view is there
    return run.view


@app.command()
@peer_option("Provider (default: the one this node's record of the job names).", default="")
@click.option(
    "--job",
    "job_id",
    required=True,
    shell_complete=complete_submitted_job,
    help="A job started with `gpumesh app run`: its id, or a prefix of it (4+ characters).",
)
@_dir_option("The local folder the job's app folder is copied into (made if missing).")
@json_option
def pull(peer: str, job_id: str, folder: str, as_json: bool) -> None:
    """Copy the working folder of a past job (its app folder) into DIR."""
    from gpumesh.client.bodies import AppPullBody
    from gpumesh.client.views.apps import AppPullView

    body = AppPullBody(job=job_id, dir=os.path.abspath(folder), peer=peer)
    view = node_client().call("POST", "/api/v1/apps/pull", AppPullView, body)
    if as_json:
        emit_json(view)
        return
    click.echo(f"pulled {view.peer}:{view.remote} -> {folder}")
