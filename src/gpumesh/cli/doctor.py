"""``gpumesh doctor``"""

from __future__ import annotations

import click

from gpumesh.cli._common import emit_json, get_node
from gpumesh.errors import ExitCode

_MARK = {"ok": ("✓", "green"), "warn": ("!", "yellow"), "fail": ("✗", "red")}


@click.command(epilog="\b\nExamples:\n  gpumesh doctor\n  gpumesh doctor --json")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable output.")
def doctor(as_json: bool) -> None:
    """Check everything this node needs, and say how to fix each failure.

    Exits non-zero when any check fails.
    """
    from gpumesh.client.doctor import run_checks

    node = get_node()
    checks = run_checks(node.home)
    if as_json:
        from gpumesh.client.views.node import CheckView

        emit_json([CheckView.of(c) for c in checks])
    else:
        for check in checks:
            mark, color = _MARK[check.status]
            click.echo(f"{click.style(mark, fg=color, bold=True)} {check.name:<14} {check.detail}")
            if check.fix:
                click.echo(f"  {'':<14} fix: {check.fix}")
    if any(c.status == "fail" for c in checks):
        raise SystemExit(ExitCode.FAILED)
