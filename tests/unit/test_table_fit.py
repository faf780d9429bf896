"""How a table is fitted to the terminal: only columns that give way are cut."""

from __future__ import annotations

from gpumesh.cli._table import Column, _fit

# The jobs table as the consumer prints it: PEER and COMMAND give way, COMMAND first.
JOBS = [
    Column("ID"),
    Column("PEER", gives_way=1),
    Column("STATE"),
    Column("EXIT"),
    Column("ATTEMPT"),
    Column("GPU"),
    Column("COMMAND", gives_way=2),
    Column("CREATED"),
    Column("TIME"),
]


def _line_width(widths: list[int]) -> int:
    return sum(widths) + 2 * (len(widths) - 1)


def test_columns_that_give_way_go_below_their_readable_width_when_that_is_not_enough() -> None:
    # A row seen in CI: at their readable 8 characters PEER and COMMAND left the
    # line one character past 80, and the line ran past the edge.
    natural = [12, 10, 9, 4, 7, 3, 60, 9, 5]
    widths, fits = _fit(JOBS, natural, list(range(len(JOBS))), 80)
    assert fits and _line_width(widths) <= 80
    never_cut = [i for i, column in enumerate(JOBS) if not column.gives_way]
    assert [widths[i] for i in never_cut] == [natural[i] for i in never_cut]
    assert widths[1] >= len("PEER") and widths[6] >= len("COMMAND")


def test_readable_widths_are_kept_when_they_are_enough() -> None:
    natural = [12, 8, 9, 4, 7, 3, 60, 7, 5]
    widths, fits = _fit(JOBS, natural, list(range(len(JOBS))), 80)
    assert fits and _line_width(widths) == 80
    assert widths[1] == 8  # COMMAND gave way first, and enough: PEER kept whole
    assert widths[6] == 60 - (_line_width(natural) - 80) >= 8


def test_nothing_that_must_stay_is_cut_when_even_headers_do_not_fit() -> None:
    natural = [12, 10, 9, 4, 7, 3, 60, 9, 5]
    widths, fits = _fit(JOBS, natural, list(range(len(JOBS))), 40)
    assert not fits
    assert widths[1] == len("PEER") and widths[6] == len("COMMAND")
    assert widths[0] == 12 and widths[-1] == 5
