"""``gpumesh completion``"""

from __future__ import annotations

import click


@click.command(
    epilog="""\b
Examples:
  gpumesh completion bash > ~/.local/share/bash-completion/completions/gpumesh
  gpumesh completion zsh > "${fpath[1]}/_gpumesh"
  gpumesh completion fish > ~/.config/fish/completions/gpumesh.fish
"""
)
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the completion script for SHELL."""
    from click.shell_completion import get_completion_class

    from gpumesh.cli.main import cli

    completion_class = get_completion_class(shell)
    assert completion_class is not None
    click.echo(completion_class(cli, {}, "gpumesh", "_GPUMESH_COMPLETE").source())
