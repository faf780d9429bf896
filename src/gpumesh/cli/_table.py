"""Tables that fit: what every listing command prints its rows with.

On a terminal a table fits its width: columns marked as giving way (a command,
a name, a list of addresses) are cut with an ellipsis, the most expendable
first, and never below their header; the other columns (times, ids, states,
values) are never cut, and a column that would be too narrow to read can move
under its row instead. Piped output is never cut: a script or `grep` gets every
cell whole, one row per line (a newline in a cell shows as ``\\n``).

Rich lays the table out on a terminal. Piped, the table is plain text of its
own (:func:`_plain_lines`, no Rich imported): the header, then one line per
row; each cell's text without its markup (a style tag goes, an escaped ``[``
stays, an emoji code stays as typed); the columns padded to their widest cell,
as a terminal counts cells (wide characters two, combining marks none), two
spaces apart; the last column not padded.
"""

from __future__ import annotations

import os
import re
import sys
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumesh.cli._text import escape_controls

if TYPE_CHECKING:
    from rich.text import Text

__all__ = ["Column", "cell_width", "escape", "plain_text", "print_table"]

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
    """When the row does not fit once every column that gives way is down to its
    readable width, the column leaves the table and each of its cells is printed
    whole under its row (a column that also gives way is cut only while that is
    enough)."""
    named_below: bool = False
    """Under its row, the cell starts with the header (``reachable: yes (3 ms)``)."""
    compact: Callable[[str], str] | None = None
    """A cell's shorter form (markup to markup), used when the column gives way and
    the cell is too wide for it: ``a, b, c`` becomes ``a +2``. Cut after that only
    if still too wide."""


def escape(text: str) -> str:
    """``text`` safe in a cell's markup: ``rich.markup.escape``, without importing Rich."""

    def double(match: re.Match[str]) -> str:
        backslashes, tag = match.groups()
        return f"{backslashes}{backslashes}\\{tag}"

    text = _ESCAPE_TAG.sub(double, text)
    if text.endswith("\\") and not text.endswith("\\\\"):
        return text + "\\"
    return text


def print_table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` (cells in Rich markup, escaped by the caller) under ``columns``."""
    if _styled_output():
        _print_rich(columns, rows)
        return
    sys.stdout.write("".join(f"{line}\n" for line in _plain_lines(columns, rows)))
    sys.stdout.flush()


# rich.markup's tags, and the escapes before them.
_TAG = re.compile(r"((\\*)\[([a-z#/@][^[]*?)])")
_ESCAPE_TAG = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


def _styled_output() -> bool:
    """Whether Rich would treat standard output as a terminal (styles, a width):
    its own test, from ``TTY_COMPATIBLE``, ``FORCE_COLOR`` and ``isatty()``."""
    import builtins

    if hasattr(builtins, "get_ipython"):
        return True  # IPython or a notebook: Rich's own rules
    compatible = os.environ.get("TTY_COMPATIBLE", "")
    if compatible in ("0", "1"):
        return compatible == "1"
    force = os.environ.get("FORCE_COLOR")
    if force is not None:
        return force != ""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def plain_text(markup: str) -> str:
    """A cell's text without its markup: tags go, each run of backslashes before a
    tag is halved and an odd one keeps the tag as text (:func:`escape` undone)."""
    parts: list[str] = []
    position = 0
    for match in _TAG.finditer(markup):
        full, escapes, _tag = match.groups()
        start, end = match.span()
        parts.append(markup[position:start])
        position = end
        backslashes, escaped = divmod(len(escapes), 2)
        parts.append("\\" * backslashes)
        if escaped:
            parts.append(full[len(escapes) :])
    parts.append(markup[position:])
    return "".join(parts)


def cell_width(text: str) -> int:
    """Terminal cells ``text`` takes: two for a wide character, none for a combining
    mark, one for any other."""
    return sum(
        2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
        for char in text
        if not unicodedata.combining(char)
    )


def _plain_lines(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[str]:
    """The table as plain lines: nothing cut, no style (see the module's docstring)."""
    cells = [[plain_text(escape_controls(cell)) for cell in row] for row in rows]
    table = [[column.header for column in columns], *cells]
    widths = [max(cell_width(row[index]) for row in table) for index in range(len(columns))]
    lines = []
    for row in table:
        padded = [
            cell + " " * (width - cell_width(cell))
            for cell, width in zip(row[:-1], widths, strict=False)
        ]
        lines.append("  ".join([*padded, row[-1]]) if row else "")
    return lines


def _print_rich(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    from rich.console import Console
    from rich.text import Text

    console = Console()
    # A newline or a terminal control in a cell (a command, a peer's text) would
    # break the one-line rows or drive the terminal: shown escaped instead.
    cells = [[Text.from_markup(escape_controls(cell)) for cell in row] for row in rows]
    limit = console.width if console.is_terminal else None
    inline, widths = _layout(columns, cells, limit)
    # A column that gave way shows its cells' shorter forms where they are too wide,
    # and the table is laid out again with them.
    compacted = False
    for pos, index in enumerate(inline):
        compact = columns[index].compact
        if compact is None:
            continue
        for row, markup in zip(cells, rows, strict=True):
            if row[index].cell_len > widths[pos]:
                row[index] = Text.from_markup(escape_controls(compact(markup[index])))
                compacted = True
    if compacted:
        inline, widths = _layout(columns, cells, limit)
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


def _layout(
    columns: Sequence[Column], cells: list[list[Text]], limit: int | None
) -> tuple[list[int], list[int]]:
    """The columns that stay in the table's line, and their widths within ``limit``:
    cut at most to readable widths; then the columns that may go below leave it;
    only then cut further, down to the headers."""
    natural = [
        max([len(column.header), *(row[index].cell_len for row in cells)])
        for index, column in enumerate(columns)
    ]
    inline = list(range(len(columns)))
    widths, fits = _fit(columns, natural, inline, limit, readable=True)
    if not fits and any(column.below for column in columns):
        inline = [i for i, column in enumerate(columns) if not column.below]
        widths, fits = _fit(columns, natural, inline, limit, readable=True)
    if not fits:
        widths, _ = _fit(columns, natural, inline, limit)
    return inline, widths


def _fit(
    columns: Sequence[Column],
    natural: list[int],
    inline: list[int],
    limit: int | None,
    *,
    readable: bool = False,
) -> tuple[list[int], bool]:
    """Widths of the ``inline`` columns within ``limit``, and whether they fit;
    ``readable``: cut none below its readable width (``least``).

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
    floors: list[Callable[[Column], int]] = [lambda c: max(len(c.header), c.least)]
    if not readable:
        floors.append(lambda c: len(c.header))
    for floor_of in floors:
        for pos in order:
            if excess <= 0:
                break
            floor = min(widths[pos], floor_of(columns[inline[pos]]))
            cut = min(excess, widths[pos] - floor)
            widths[pos] -= cut
            excess -= cut
    return widths, excess <= 0


def _line(cells: list[Text], widths: list[int]) -> Text:
    from rich.text import Text

    parts = []
    for position, (cell, width) in enumerate(zip(cells, widths, strict=True)):
        part = cell.copy()
        last = position == len(cells) - 1
        part.truncate(width, overflow="ellipsis", pad=not last)
        parts.append(part)
    return Text(" " * _GAP).join(parts)
