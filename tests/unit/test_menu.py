"""The menu of ``gpumesh start`` without a terminal: bytes to keys, keys to a choice."""

from __future__ import annotations

import pytest

from gpumesh.cli._menu import Choice, Item, Key, KeyDecoder, Menu

UP, DOWN = b"\x1b[A", b"\x1b[B"


def _items(count: int = 4) -> list[Item]:
    return [Item(f"entry {n}", f"action-{n}") for n in range(1, count + 1)]


def test_decoder_reads_arrows_enter_digits_and_leaving_keys() -> None:
    decoder = KeyDecoder()
    keys = decoder.feed(UP + DOWN + b"\x1bOA\x1bOB" + b"\r\n" + b"37" + b"q" + b"\x03")
    assert keys == [
        Key.UP,
        Key.DOWN,
        Key.UP,
        Key.DOWN,
        Key.ENTER,
        Key.ENTER,
        Key.DIGIT_3,
        Key.DIGIT_7,
        Key.QUIT,
        Key.INTERRUPT,
    ]
    assert not decoder.pending


def test_decoder_ignores_other_bytes_and_sequences() -> None:
    decoder = KeyDecoder()
    # letters, 0, Home (ESC [ H), F5 (ESC [ 1 5 ~), Right arrow, a UTF-8 character
    assert decoder.feed(b"xz0\x1b[H\x1b[15~\x1b[C\xc3\xa9") == []
    assert decoder.feed(b"2") == [Key.DIGIT_2]


def test_decoder_keeps_a_sequence_cut_between_reads() -> None:
    decoder = KeyDecoder()
    assert decoder.feed(b"\x1b") == []
    assert decoder.pending
    assert decoder.feed(b"[") == []
    assert decoder.pending
    assert decoder.feed(b"B1") == [Key.DOWN, Key.DIGIT_1]
    assert not decoder.pending


def test_lone_esc_is_quit_only_once_nothing_follows() -> None:
    decoder = KeyDecoder()
    assert decoder.feed(b"\x1b") == []
    assert decoder.flush() == [Key.QUIT]
    assert not decoder.pending
    assert decoder.flush() == []
    # Esc followed by an ordinary key: Esc was pressed on its own, then the key.
    assert decoder.feed(b"\x1b2") == [Key.QUIT, Key.DIGIT_2]


def test_flush_does_not_turn_a_cut_sequence_into_esc() -> None:
    decoder = KeyDecoder()
    decoder.feed(b"\x1b[1;")
    assert decoder.flush() == []


def test_arrows_move_and_wrap_and_enter_chooses() -> None:
    items = _items(3)
    menu = Menu(items)
    assert menu.press(Key.UP) is None
    assert menu.selected == 2  # wrapped to the last
    assert menu.press(Key.DOWN) is None
    assert menu.selected == 0
    assert menu.press(Key.DOWN) is None
    assert menu.press(Key.ENTER) == Choice(items[1])


def test_a_digit_chooses_its_entry_at_once() -> None:
    items = _items(4)
    menu = Menu(items)
    assert menu.press(Key.DIGIT_3) == Choice(items[2])
    assert menu.selected == 2


def test_a_digit_past_the_last_entry_does_nothing() -> None:
    menu = Menu(_items(4), selected=1)
    assert menu.press(Key.DIGIT_9) is None
    assert menu.selected == 1


def test_quit_and_interrupt_leave_without_a_choice() -> None:
    assert Menu(_items()).press(Key.QUIT) == Choice(None)
    assert Menu(_items()).press(Key.INTERRUPT) == Choice(None, interrupted=True)


def test_lines_mark_the_selection_and_number_from_one() -> None:
    items = _items(3)
    menu = Menu(items, selected=1)
    assert menu.lines() == [(False, 1, items[0]), (True, 2, items[1]), (False, 3, items[2])]


def test_selection_starts_inside_the_list() -> None:
    assert Menu(_items(2), selected=7).selected == 1
    with pytest.raises(ValueError):
        Menu([])


def test_a_whole_session_from_bytes() -> None:
    """Bytes as a terminal sends them, through both machines, to the third entry."""
    decoder, menu = KeyDecoder(), Menu(_items(4))
    choice = None
    for chunk in (b"\x1b", b"[B\x1b[", b"B", b"\r"):
        for key in decoder.feed(chunk):
            choice = choice or menu.press(key)
    assert choice == Choice(menu.items[2])
