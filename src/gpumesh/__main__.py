"""``python -m gpumesh`` runs the CLI."""

from gpumesh.cli.main import entry

entry()
