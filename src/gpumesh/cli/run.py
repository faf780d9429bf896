"""``gpumesh run``"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumesh.cli._common import print_error
from gpumesh.cli._complete import complete_group
from gpumesh.cli._node import job_options, peer_option
from gpumesh.errors import AgentError, ExitCode, GPUMeshError

if TYPE_CHECKING:
    from gpumesh.client.bodies import JobBody


@click.command(
    context_settings={"allow_interspersed_args": False},
    epilog="""\b
Examples:
  gpumesh run --peer alice-pc nvidia-smi
  gpumesh run --peer alice-pc --image pytorch/pytorch -- python -c 'import torch'
  gpumesh run --peer alice-pc --workdir ./train --env WANDB_MODE=offline -- python train.py
  gpumesh run -f job.yaml                    # flags override the file's fields
  gpumesh run --peer alice-pc --detach -- ./long.sh && gpumesh logs -f
  gpumesh run --group research --gpu-memory 8GB --explain -- python train.py
  gpumesh cp ./dataset alice-pc:/datasets   # once; then in every job:
  gpumesh run --peer alice-pc --mount /datasets:/data -- ls /data
  gpumesh run --peer alice-pc --mount /out:/out:rw -- sh -c 'date > /out/t'
  gpumesh run --peer alice-pc --outputs /workspace/out -- python train.py
                            # its finished files arrive in ./gpumesh-outputs/JOB_ID/
  gpumesh run --group lab --outputs /out --outputs-to ./results -- ./sweep.sh
  gpumesh run --group lab --outputs /out --wait 30m --max-moves 5 -- ./train.sh
                            # moves when a provider is paused or lost, resuming
                            # from the outputs already home
\b
Exit status: the job's own exit code (125 when it could not run, 130 when cancelled).
""",
)
@peer_option("Provider to run on.")
@click.option(
    "--group",
    shell_complete=complete_group,
    help="Run on the best member of this group (idle GPU, most memory).",
)
@click.option("--explain", is_flag=True, help="With --group: show every member's verdict.")
@click.option(
    "--wait",
    metavar="DURATION",
    help="When no provider can take the job now (busy, paused, unreachable), wait up to "
    "this long in the queue, e.g. 10m (default 0: refuse at once); a group's job that "
    "must move waits as long.",
)
@click.option(
    "--max-moves",
    type=int,
    metavar="N",
    help="With --group: move the job to another member at most N times when its "
    "provider preempts it, denies you or goes silent (default 3, at most 10).",
)
@click.option("--image", help="Container image (default: config `image` / $GPUMESH_IMAGE).")
@click.option("--gpu-memory", metavar="SIZE", help="GPU memory the job needs, e.g. 8GB.")
@click.option("--workdir", type=click.Path(), help="Local folder to upload as the working dir.")
@click.option(
    "--mount",
    "mounts",
    multiple=True,
    metavar="FOLDER:PATH[:rw]",
    help="Mount FOLDER of your sandbox on the peer (what you copied there with "
    "`gpumesh cp`) at PATH in the job; read-only unless :rw. Repeatable.",
)
@click.option(
    "--outputs",
    metavar="PATH",
    help="A folder in the job (e.g. /workspace/out) whose finished files come home as "
    "the job runs; the job finds it in $GPUMESH_OUTPUTS (write, then rename).",
)
@click.option(
    "--outputs-to",
    metavar="DIR",
    help="Where --outputs go here (default ./gpumesh-outputs/JOB_ID).",
)
@click.option("-f", "--file", "job_file", type=click.Path(), help="job.yaml with the same fields.")
@click.option("--retries", type=int, help="Re-run a failed attempt up to N times (backoff).")
@click.option("--timeout", metavar="DURATION", help="Stop an attempt after e.g. 30m or 2h.")
@click.option("-e", "--env", "env_items", multiple=True, metavar="KEY=VAL", help="Set a variable.")
@click.option("-d", "--detach", is_flag=True, help="Start the job, print its id, and return.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the job's own output.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(
    peer: str | None,
    group: str | None,
    explain: bool,
    wait: str | None,
    max_moves: int | None,
    image: str | None,
    gpu_memory: str | None,
    workdir: str | None,
    job_file: str | None,
    retries: int | None,
    timeout: str | None,
    env_items: tuple[str, ...],
    mounts: tuple[str, ...],
    outputs: str | None,
    outputs_to: str | None,
    detach: bool,
    quiet: bool,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND in a container on a peer, streaming its output live.

    stdout and stderr stay apart, and gpumesh exits with the job's exit code,
    so it composes in scripts like `docker run`. Ctrl-C asks whether to cancel
    the remote job or leave it running.
    """
    from gpumesh.client import bodies

    # Local folders are this process's: the node process works elsewhere.
    absolute_to = _absolute(outputs_to) if outputs_to else None
    under = _absolute("gpumesh-outputs") if not outputs_to else None
    simple = not job_file and not workdir and all("=" in item for item in env_items)
    if simple and (peer or group):
        # Checked by the node process, with the same messages: this process
        # need not load the job file reader (YAML) or the runtime's rules.
        body = bodies.JobBody(
            command=list(command),
            peer=peer,
            group=group,
            **job_options(image, env_items, gpu_memory, retries, timeout, mounts),
            wait=wait or 0.0,
            max_moves=max_moves,
            outputs=outputs or "",
            outputs_to=absolute_to,
            outputs_under=under,
        )
        _through_node(body, detach=detach, quiet=quiet, explain=explain)
        return
    from gpumesh.client.jobspec import build_spec

    spec = build_spec(
        Path(job_file) if job_file else None,
        image=image,
        command=list(command) if command else None,
        env_items=list(env_items),
        workdir=Path(workdir) if workdir else None,
        gpu_memory=gpu_memory,
        retries=retries,
        timeout=timeout,
        peer=peer,
        group=group,
        mounts=list(mounts),
        outputs=outputs,
        outputs_to=absolute_to,
        outputs_under=under,
        max_moves=max_moves,
    )
    spec_body = bodies.job_body(spec, wait=wait or 0.0)
    _through_node(spec_body, detach=detach, quiet=quiet, explain=explain)


def _absolute(path: str) -> str:
    """``path`` from this process's working folder, ``~`` expanded."""
    import os

    return os.path.abspath(os.path.expanduser(path))


def _through_node(body: JobBody, *, detach: bool, quiet: bool, explain: bool = False) -> None:
    """``run`` as a thin client of the node process. Detached, it returns once the
    provider accepted the job (and the workdir is uploaded); else the node process
    streams the run (placement, pull, acceptance, upload, then the job's events),
    and a stream its node process dropped after acceptance resumes as `logs -f`."""
    from gpumesh.cli._node import follow, node_client
    from gpumesh.cli._notes import RESTARTS_ON_MOVE, RunReader, ViewPrinter, exit_status_of
    from gpumesh.client.views.jobs import JobResultView
    from gpumesh.client.views.runs import RUN_EVENTS
    from gpumesh.daemon.client import NodeUnavailableError

    client = node_client()
    restarts = bool(body.group) and not body.outputs and body.max_moves != 0
    if detach:
        job_id = client.call("POST", "/api/v1/jobs", JobResultView, body).job_id
        if restarts and not quiet:
            click.echo(f"gpumesh: {RESTARTS_ON_MOVE}", err=True)
        click.echo(job_id)
        return
    reader = RunReader(ViewPrinter("", quiet=quiet, explain=explain))
    reader.printer.steps.restarts_on_move = restarts
    try:
        try:
            answer = client.send("POST", "/api/v1/jobs?stream=true", body)
            result = reader.read(answer.events(RUN_EVENTS))
        except NodeUnavailableError:
            if reader.job_id is None:
                raise AgentError(
                    "the node process stopped while it submitted the job: `gpumesh jobs` "
                    "shows whether the job started"
                ) from None
            result = follow(reader.job_id, reader.printer, after=reader.after)
    except KeyboardInterrupt:
        if reader.job_id is None or reader.provider is None:
            click.echo("Interrupted before the job started.", err=True)
        else:
            _interrupted(reader.job_id, reader.provider)
        raise SystemExit(ExitCode.INTERRUPTED) from None
    raise SystemExit(exit_status_of(result.state, result.exit_code))


def _interrupted(job_id: str, peer: str) -> None:
    """Ctrl-C: cancel the remote job, or leave it running when the user says so."""
    from urllib.parse import quote

    from gpumesh.cli._node import node_client

    # Without a terminal to ask, the job is cancelled.
    cancel = not sys.stdin.isatty() or click.confirm(
        f"\nCancel job {job_id} {f'on {peer}' if peer else 'waiting in the queue'}? "
        "(no: it keeps running)",
        default=True,
    )
    if not cancel:
        click.echo(f"Detached. Follow it with: gpumesh logs -f {job_id}", err=True)
        return
    try:
        path = f"/api/v1/jobs/{quote(job_id, safe='')}/cancel"
        from gpumesh.client.bodies import CancelBody
        from gpumesh.client.views.jobs import JobResultView

        result = node_client().call("POST", path, JobResultView, CancelBody())
    except GPUMeshError as exc:
        print_error(f"could not cancel {job_id}: {exc.message}")
        return
    click.echo(f"Job {job_id} {result.state}.", err=True)
