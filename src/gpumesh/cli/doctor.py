"""``gpumesh doctor``"""

from __future__ import annotations

import click

from gpumesh.cli._common import emit_json, get_node
from gpumesh.errors import ExitCode

_MARK = {"ok": ("✓", "green"), "warn": ("!", "yellow"), "fail": ("✗", "red")}
_INDENT = 17
"""Where a check's text starts: after its mark and its name."""


def _terminal_width() -> int | None:
    """The terminal's width when stdout is one; None when piped (lines stay whole)."""
    import shutil
    import sys

    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def _echo_wrapped(head: str, text: str, width: int | None) -> None:
    """``head`` (:data:`_INDENT` columns wide) then ``text``, wrapped to ``width``
    under the text's own start."""
    if width is None or _INDENT + len(text) <= width:
        click.echo(head + text)
        return
    import textwrap

    lines = textwrap.wrap(text, max(width - _INDENT, 20), break_on_hyphens=False)
    click.echo(head + lines[0])
    for line in lines[1:]:
        click.echo(" " * _INDENT + line)


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
        width = _terminal_width()
        for check in checks:
            mark, color = _MARK[check.status]
            head = f"{click.style(mark, fg=color, bold=True)} {check.name:<14} "
            _echo_wrapped(head, check.detail, width)
            if check.fix:
                _echo_wrapped(" " * _INDENT, f"fix: {check.fix}", width)
    if any(c.status == "fail" for c in checks):
        raise SystemExit(ExitCode.FAILED)
