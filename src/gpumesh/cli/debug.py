"""``gpumesh debug``"""

from __future__ import annotations

import click

from gpumesh.cli._complete import complete_submitted_job
from gpumesh.cli._node import env_of
from gpumesh.cli.exec import gpu_memory_of, open_shell


@click.command(
    "debug",
    context_settings={"allow_interspersed_args": False},
    epilog="""\b
Examples:
  gpumesh debug 3f9a                       # a shell where the failed job was
  gpumesh debug 3f9a -- cat /workspace/train.log
  gpumesh debug 3f9a -- sh -c 'ls -l "$GPUMESH_OUTPUTS"'
  gpumesh debug --gpu-memory 8GB 3f9a -- python -c 'import torch; print(torch.cuda.is_available())'
\b
What survives an attempt: its workdir (/workspace) and outputs folder as it
left them, and the mounts and environment the job had; the provider keeps the
workdir and outputs for its debug_ttl (default 30m) after the job ends,
counted in your file_quota there. A job's root file system is read-only and
its /tmp and HOME are in memory, so nothing it wrote anywhere else survives;
where the provider lets jobs write their root (job_root on), it keeps the
attempt's stopped container too, and the twin starts from a copy of it.
\b
The twin runs as the job did (its image by digest, its user, limits and
network), with no GPU unless --gpu-memory; it is removed when the shell
ends. Only the job's submitter may debug it, and only once it has ended:
`gpumesh exec --job JOB` enters a job that still runs.
\b
Exit status: the program's exit code, as `gpumesh exec`.
""",
)
@click.option("-e", "--env", "env_items", multiple=True, metavar="KEY=VAL", help="Set a variable.")
@click.option(
    "--gpu-memory",
    metavar="SIZE",
    help="Give the twin a GPU with this much free memory (e.g. 8GB), held while it is open.",
)
@click.argument("job_id", metavar="JOB", shell_complete=complete_submitted_job)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def debug(
    job_id: str, env_items: tuple[str, ...], gpu_memory: str | None, command: tuple[str, ...]
) -> None:
    """Open a shell (or COMMAND) in a twin of JOB's last attempt, on its provider.

    JOB is a job you submitted that has ended (an id or a unique prefix). The
    twin sees what the attempt left; before the prompt, gpumesh says how the
    attempt exited and when.
    """
    if command[:1] == ("--",):  # `gpumesh debug JOB -- CMD`: the separator is not the command
        command = command[1:]
    from gpumesh.client.bodies import ShellRequest

    request = ShellRequest(
        command=list(command),
        env=env_of(env_items),
        gpu_memory=gpu_memory_of(gpu_memory),
        job=job_id,
        twin=True,
    )
    open_shell(request)
