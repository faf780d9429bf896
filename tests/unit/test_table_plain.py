"""Piped tables are plain text of their own, written without Rich: the header and
one line per row, every cell whole and without its markup, the columns aligned as
a terminal counts cells. On a terminal (or forced), Rich lays the table out."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.markup import escape as rich_escape

from gpumesh.cli._table import Column, _plain_lines, cell_width, escape, plain_text, print_table
from gpumesh.cli._text import escape_controls

COLUMNS = [Column("ID"), Column("PEER", gives_way=1), Column("STATE"), Column("COMMAND", 2)]


def test_a_jobs_table_is_its_rows_aligned_under_the_headers() -> None:
    rows = [
        ["a1b2c3", escape("→ alice-pc"), "[green]succeeded[/green]", escape("echo hi")],
        ["ffee00", escape("← bob [x]"), "[yellow]unknown since 10:02[/yellow]", escape("a\\")],
        ["0", escape("← b\\[y]"), "[red]failed[/red]", escape("sh -c 'x\ny'")],
    ]
    assert _plain_lines(COLUMNS, rows) == [
        "ID      PEER        STATE                COMMAND",
        "a1b2c3  → alice-pc  succeeded            echo hi",
        "ffee00  ← bob [x]   unknown since 10:02  a\\\\",
        "0       ← b\\[y]     failed               sh -c 'x\\ny'",
    ]


def test_wide_characters_and_emoji_codes_are_text_of_their_own() -> None:
    rows = [["1", escape("宽宽"), ":smile:", "é"], ["22", "x", "[bold]ok[/bold]", "e\u0301"]]
    assert _plain_lines(COLUMNS, rows) == [
        "ID  PEER  STATE    COMMAND",
        "1   宽宽  :smile:  é",
        "22  x     ok       e\u0301",
    ]
    assert cell_width("宽") == 2 and cell_width("e\u0301") == 1 and cell_width("→") == 1


def test_markup_that_is_not_ours_to_read_is_still_one_line_of_text() -> None:
    # A closing tag that closes nothing, a handler, unbalanced: tags go, text stays.
    assert plain_text("[/red]a[@click]b[/]") == "ab"
    assert plain_text("\\\\[b]x") == "\\x"  # an even run of backslashes: the tag goes
    assert plain_text("\\\\\\[b]x") == "\\[b]x"  # an odd run: the tag is text


def test_escape_is_riches() -> None:
    for text in ["plain", "[b]", "\\[b]", "a\\", "a\\\\", "[/]", "x[@click]y", "[[a]]"]:
        assert escape(text) == rich_escape(text)


_PIECES = st.sampled_from(
    [*"ab [/]\\=:@#→←é宽\n\t-", "[red]", "[/red]", "[/]", "[bold red]", ":+1:", "\\[b]"]
)
_TEXTS = st.lists(_PIECES, max_size=8).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_TEXTS, min_size=4, max_size=4), max_size=3))
def test_any_text_escaped_comes_out_whole_one_row_a_line_in_aligned_columns(
    texts: list[list[str]],
) -> None:
    # Text as commands escape it (escape doubles a lone trailing backslash, as Rich's).
    texts = [[text.rstrip("\\") for text in row] for row in texts]
    lines = _plain_lines(COLUMNS, [[escape(text) for text in row] for row in texts])
    assert len(lines) == 1 + len(texts)  # no cell breaks its line
    table = [[c.header for c in COLUMNS], *([escape_controls(t) for t in row] for row in texts)]
    widths = [max(cell_width(row[k]) for row in table) for k in range(len(COLUMNS))]
    for line, row in zip(lines, table, strict=True):
        # Each cell whole, padded to its column's widest, two spaces apart.
        padded = [
            cell + " " * (width - cell_width(cell)) for cell, width in zip(row, widths, strict=True)
        ]
        assert line == "  ".join([*padded[:-1], row[-1]])


def test_a_piped_table_does_not_import_rich() -> None:
    check = (
        "import sys\n"
        "from gpumesh.cli._table import Column, escape, print_table\n"
        "print_table([Column('A'), Column('B')], [['[green]x[/green]', escape('[y]')]])\n"
        "print('rich' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.stdout == "A  B\nx  [y]\nFalse\n", result.stderr


@pytest.mark.parametrize("forced", [{"FORCE_COLOR": "1"}, {"TTY_COMPATIBLE": "1"}])
def test_a_forced_terminal_still_gets_riches_styles(
    forced: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in forced.items():
        monkeypatch.setenv(name, value)
    print_table([Column("A")], [["[green]x[/green]"]])
    assert "\x1b[32mx" in capsys.readouterr().out
