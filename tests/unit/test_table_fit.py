"""How a table is fitted to the terminal: only columns that give way are cut."""

from __future__ import annotations

import re

import pytest

from gpumesh.cli._table import Column, _fit, print_table

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


def test_jobs_keep_a_20_character_peer_whole_at_80_columns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The jobs table as cli/jobs.py makes it: the command and the creation time
    # go under the row before a peer's name of 20 characters is cut.
    from gpumesh.cli import jobs

    columns = jobs.COLUMNS
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "80")
    peer = "alice-workstation-01"
    command = "python train.py --epochs 10 --data /data/imagenet"
    row = ["3f9a1b2c4d5e", f"→ {peer}", "succeeded", "0", "1/1", "-", command, "2m ago", "1.2s"]
    print_table(columns, [row])
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in capsys.readouterr().out.splitlines()]
    assert all(len(line) <= 80 for line in lines), lines
    header, shown, below, created = lines
    assert header.split() == ["ID", "PEER", "STATE", "EXIT", "ATTEMPT", "GPU", "TIME"]
    assert f"→ {peer} " in shown and "…" not in shown and shown.endswith(" 1.2s")
    assert below.strip() == command and created.strip() == "created: 2m ago"
    # Wide enough, it is one line, the command whole.
    monkeypatch.setenv("COLUMNS", "160")
    print_table(columns, [row])
    [header, shown] = capsys.readouterr().out.splitlines()
    assert command in shown and "CREATED" in header


def test_peers_show_the_first_address_whole_and_how_many_more(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpumesh.cli.peers import first_and_count

    assert first_and_count("a:1") == "a:1"
    assert first_and_count("a:1, b:2, c:3") == "a:1 +2"
    assert first_and_count("a:1, b:2 (relay r:4799)") == "a:1 +2"  # the relay counts
    columns = [
        Column("NAME", gives_way=1, least=10),
        Column("ID"),
        Column("ADDRESSES", gives_way=2, least=12, compact=first_and_count),
    ]
    many = "192.168.1.20:47000, 10.0.0.5:47000, 203.0.113.3:47000 (relay r.example.org:4799)"
    rows = [["alice-pc", "abcdefabcdef", many], ["bob", "abcdefabcdeg", "127.0.0.1:47000"]]
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "60")
    print_table(columns, rows)
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in capsys.readouterr().out.splitlines()]
    assert lines[1].endswith("  192.168.1.20:47000 +3") and "…" not in lines[1]
    assert lines[2].endswith("  127.0.0.1:47000")
    monkeypatch.setenv("COLUMNS", "200")  # room for all: every address
    print_table(columns, rows)
    assert many in capsys.readouterr().out


def test_search_moves_the_contact_below_before_cutting_a_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpumesh.cli import search

    name = "lab-workstation-0042"  # 20 characters
    row = [name, "abcdefabcdef", "RTX 4090 20GB/24GB", "idle", "us-west", "matrix:@a:example.org"]
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "80")
    print_table(search.COLUMNS, [row])
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in capsys.readouterr().out.splitlines()]
    assert all(len(line) <= 80 for line in lines), lines
    header, shown, contact = lines
    assert "CONTACT" not in header and shown.startswith(f"{name}  ")
    assert contact.strip() == "contact: matrix:@a:example.org"
