"""Tables that fit: what every listing command prints its rows with.

On a terminal a table fits its width: columns marked as giving way (a command,
a name, a list of addresses) are cut with an ellipsis, the most expendable
first, and never below their header; the other columns (times, ids, states,
values) are never cut, and a column that would be too narrow to read can move
under its row instead. Piped output is never cut: a script or `grep` gets every
cell whole, one row per line (a newline in a cell shows as ``\\n``).

Rich lays the table out on a terminal. Piped, the same lines are plain text
that this module writes itself (:func:`_plain_lines`), byte for byte what Rich
would write, so a listing piped to a script does not import Rich; a cell this
short cut cannot prove it renders alike (emoji codes, wide characters, unusual
markup) sends the whole table to Rich.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumesh.cli._text import escape_controls

if TYPE_CHECKING:
    from rich.text import Text

__all__ = ["Column", "escape", "print_table"]

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
    lines = _plain_lines(columns, rows) if not _styled_output() else None
    if lines is not None:
        sys.stdout.write("".join(f"{line}\n" for line in lines))
        sys.stdout.flush()
        return
    _print_rich(columns, rows)


# rich.markup's tags and escapes, and what its emoji codes look like.
_TAG = re.compile(r"((\\*)\[([a-z#/@][^[]*?)])")
_ESCAPE_TAG = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")
_EMOJI_LIKE = re.compile(r":\S*?:")
# One terminal cell each, as Rich counts them: printable ASCII and the arrows of PEER.
_NARROW = re.compile(r"[\x20-\x7e\u2190\u2192]*")


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


def _plain(markup: str) -> str | None:
    """The text of one cell's markup as Rich renders it unstyled, or None when
    this reading is not sure to match Rich's (Rich then prints the table)."""
    if _EMOJI_LIKE.search(markup):
        return None
    parts: list[str] = []
    opened: list[str] = []
    position = 0
    for match in _TAG.finditer(markup):
        full, escapes, tag = match.groups()
        start, end = match.span()
        if start > position:
            parts.append(markup[position:start].replace("\\[", "["))
        position = end
        if escapes:
            backslashes, escaped = divmod(len(escapes), 2)
            parts.append("\\" * backslashes)
            if escaped:
                parts.append(full[len(escapes) :])
                continue
        name = tag.partition("=")[0]
        if name.startswith("@"):
            return None
        if not name.startswith("/"):
            opened.append(" ".join(name.split()).lower())
        elif (closing := " ".join(name[1:].split()).lower()) in opened:
            del opened[len(opened) - 1 - opened[::-1].index(closing)]
        elif closing or not opened:
            return None  # Rich refuses it (or closes what this does not follow)
        else:
            opened.pop()
    if position < len(markup):
        parts.append(markup[position:].replace("\\[", "["))
    text = "".join(parts)
    return text if _NARROW.fullmatch(text) else None


def _plain_lines(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[str] | None:
    """The lines Rich prints for the table on a non-terminal (nothing cut, no
    style), or None when a cell is beyond :func:`_plain`."""
    cells: list[list[str]] = []
    for row in rows:
        texts = [_plain(escape_controls(cell)) for cell in row]
        if any(text is None for text in texts):
            return None
        cells.append([text for text in texts if text is not None])
    widths = [
        max([len(column.header), *(len(row[index]) for row in cells)])
        for index, column in enumerate(columns)
    ]
    lines = []
    for row in [[column.header for column in columns], *cells]:
        padded = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=False)]
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
