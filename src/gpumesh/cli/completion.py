"""``gpumesh completion``"""

from __future__ import annotations

import click

from gpumesh.cli._complete import SHELLS


@click.command(
    epilog="""\b
Examples:
  gpumesh completion bash > ~/.local/share/bash-completion/completions/gpumesh
  gpumesh completion zsh > "${fpath[1]}/_gpumesh"
  gpumesh completion fish > ~/.config/fish/completions/gpumesh.fish
  gpumesh completion powershell >> $PROFILE
\b
Besides commands and options, Tab completes the names of paired peers
(connect, exec, run --peer, cp PEER:, allow, deny, group add), group names
(run --group, group invite|add|members) and job ids (logs, cancel,
app pull --job), all read from this node's own state: nothing goes over the
network, and a missing or busy home just gives no suggestions.
"""
)
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print the completion script for SHELL."""
    from click.shell_completion import get_completion_class

    import gpumesh.cli._powershell  # noqa: F401  (registers PowerShell's class)
    from gpumesh.cli.main import COMPLETE_VAR, cli

    completion_class = get_completion_class(shell)
    assert completion_class is not None
    click.echo(completion_class(cli, {}, "gpumesh", COMPLETE_VAR).source())
