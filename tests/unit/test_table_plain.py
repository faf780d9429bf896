"""Piped tables are written without Rich, byte for byte as Rich writes them.

Rich itself is the reference: every table here is printed both ways (Rich's
console on a non-terminal, and the plain writer) and the bytes compared."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.markup import escape as rich_escape

from gpumesh.cli._table import Column, _plain_lines, _print_rich, escape, print_table

COLUMNS = [Column("ID"), Column("PEER", gives_way=1), Column("STATE"), Column("COMMAND", 2)]


def _rich(columns: list[Column], rows: list[list[str]]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _print_rich(columns, rows)
    return out.getvalue()


def _plain(columns: list[Column], rows: list[list[str]]) -> str | None:
    lines = _plain_lines(columns, rows)
    return None if lines is None else "".join(f"{line}\n" for line in lines)


def test_a_jobs_table_reads_the_same_as_rich_prints_it() -> None:
    rows = [
        ["a1b2c3", escape("→ alice-pc"), "[green]succeeded[/green]", escape("echo hi")],
        ["ffee00", escape("← bob [x]"), "[yellow]unknown since 10:02[/yellow]", escape("a\\")],
        ["0", escape("← b\\[y]"), "[red]failed[/red]", escape("sh -c 'x\ny'")],
    ]
    plain = _plain(COLUMNS, rows)
    assert plain is not None
    assert plain == _rich(COLUMNS, rows)
    assert plain.splitlines()[0] == "ID      PEER        STATE                COMMAND"


def test_escape_is_riches() -> None:
    for text in ["plain", "[b]", "\\[b]", "a\\", "a\\\\", "[/]", "x[@click]y", "[[a]]"]:
        assert escape(text) == rich_escape(text)


def test_what_the_plain_writer_cannot_vouch_for_goes_to_rich() -> None:
    assert _plain_lines(COLUMNS, [["1", "x", ":smile:", "y"]]) is None  # an emoji code
    assert _plain_lines(COLUMNS, [["1", "x", "宽", "y"]]) is None  # two cells wide
    assert _plain_lines(COLUMNS, [["1", "x", "[/red]", "y"]]) is None  # Rich refuses it


_PIECES = st.sampled_from(
    [*"ab [/]\\=:@#→←é宽\n\t-", "[red]", "[/red]", "[/]", "[bold red]", "[/bold red]", ":+1:"]
)
_CELLS = st.lists(_PIECES, max_size=8).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.lists(_CELLS, min_size=4, max_size=4),
        min_size=0,
        max_size=3,
    ),
    st.booleans(),
)
def test_any_cells_read_the_same_as_rich_prints_them(rows: list[list[str]], escaped: bool) -> None:
    if escaped:
        rows = [[escape(cell) for cell in row] for row in rows]
    plain = _plain(COLUMNS, rows)
    if plain is None:
        return
    assert plain == _rich(COLUMNS, rows)


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
