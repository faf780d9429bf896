"""Tables that fit: what every listing command prints its rows with.

On a terminal a table fits its width: columns marked as giving way (a command,
a name, a list of addresses) are cut with an ellipsis, the most expendable
first, and never below their header; the other columns (times, ids, states,
values) are never cut, and a column that would be too narrow to read can move
under its row instead. Piped output is never cut: a script or `grep` gets every
cell whole, one row per line (a newline in a cell shows as ``\\n``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.text import Text

from gpumesh.cli._text import escape_controls

__all__ = ["Column", "print_table"]

_GAP = 2
_INDENT = 4


@dataclass(frozen=True)
class Column:
    header: str
    gives_way: int = 0
    """0: never cut. Higher numbers are cut first when the terminal is too narrow."""
    least: int = 8
    """The narrowest a column that gives way becomes while that is enough; when it
    is not, it goes on down to its header's width (never narrower)."""
    below: bool = False
    """Never cut: when the row does not fit once the others have given way, the
    column leaves the table and each of its cells is printed under its row."""
    named_below: bool = False
    """Under its row, the cell starts with the header (``reachable: yes (3 ms)``)."""


def print_table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` (cells in Rich markup, escaped by the caller) under ``columns``."""
    console = Console()
    # A newline or a terminal control in a cell (a command, a peer's text) would
    # break the one-line rows or drive the terminal: shown escaped instead.
    cells = [[Text.from_markup(escape_controls(cell)) for cell in row] for row in rows]
    natural = [
        max([len(column.header), *(row[index].cell_len for row in cells)])
        for index, column in enumerate(columns)
    ]
    limit = console.width if console.is_terminal else None
    inline = list(range(len(columns)))
    widths, fits = _fit(columns, natural, inline, limit)
    if not fits and any(column.below for column in columns):
        inline = [i for i, column in enumerate(columns) if not column.below]
        widths, _ = _fit(columns, natural, inline, limit)
    below = [i for i in range(len(columns)) if i not in inline]
    header = [Text(columns[i].header, style="bold") for i in inline]
    console.print(_line(header, widths), soft_wrap=True)
    for row in cells:
        console.print(_line([row[i] for i in inline], widths), soft_wrap=True)
        for index in (i for i in below if row[i].plain):
            text = row[index]
            if columns[index].named_below:
                text = Text(f"{columns[index].header.lower()}: ") + text
            for part in text.wrap(console, max(console.width - _INDENT, 20)):
                part.rstrip()
                console.print(Text(" " * _INDENT) + part, style="dim", soft_wrap=True)


def _fit(
    columns: Sequence[Column], natural: list[int], inline: list[int], limit: int | None
) -> tuple[list[int], bool]:
    """Widths of the ``inline`` columns within ``limit``, and whether they fit.

    When even the columns that give way at their narrowest do not fit, the line
    runs past the terminal's edge: that wraps, but it cuts nothing that must stay.
    """
    widths = [natural[i] for i in inline]
    excess = sum(widths) + _GAP * (len(widths) - 1) - (limit or 0)
    if limit is None or excess <= 0:
        return widths, True
    order = sorted(
        (pos for pos, i in enumerate(inline) if columns[i].gives_way),
        key=lambda pos: -columns[inline[pos]].gives_way,
    )
    # First down to each column's readable width, then, if that is not enough,
    # down to its header: a cell cut short still beats a line past the edge.
    for floor_of in (lambda c: max(len(c.header), c.least), lambda c: len(c.header)):
        for pos in order:
            if excess <= 0:
                break
            floor = min(widths[pos], floor_of(columns[inline[pos]]))
            cut = min(excess, widths[pos] - floor)
            widths[pos] -= cut
            excess -= cut
    return widths, excess <= 0


def _line(cells: list[Text], widths: list[int]) -> Text:
    parts = []
    for position, (cell, width) in enumerate(zip(cells, widths, strict=True)):
        part = cell.copy()
        last = position == len(cells) - 1
        part.truncate(width, overflow="ellipsis", pad=not last)
        parts.append(part)
    return Text(" " * _GAP).join(parts)
