"""The key handling of ``gpumesh start``'s menu, without a terminal.

Two small state machines, both fed plain values and never touching a file
descriptor or the clock: :class:`KeyDecoder` turns the bytes a raw terminal
sends into :class:`Key` values, and :class:`Menu` turns keys into a selection
and, at the end, a :class:`Choice`. The terminal shell in ``cli/start.py``
reads bytes, feeds them here, and draws :meth:`Menu.lines`.

A lone Esc and the start of an arrow key's sequence are the same byte; the
decoder keeps it pending until the next bytes say which, or until the shell
calls :meth:`KeyDecoder.flush` because nothing more came.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Choice", "Item", "Key", "KeyDecoder", "Menu"]


class Key(enum.Enum):
    UP = "up"
    DOWN = "down"
    ENTER = "enter"
    QUIT = "quit"
    """q or Esc: leave the menu."""
    INTERRUPT = "interrupt"
    """Ctrl-C (raw mode delivers it as a byte, not a signal)."""
    DIGIT_1 = "1"
    DIGIT_2 = "2"
    DIGIT_3 = "3"
    DIGIT_4 = "4"
    DIGIT_5 = "5"
    DIGIT_6 = "6"
    DIGIT_7 = "7"
    DIGIT_8 = "8"
    DIGIT_9 = "9"

    @property
    def digit(self) -> int | None:
        return int(self.value) if self.value.isdigit() else None


_ESC = 0x1B
_ARROWS = {ord("A"): Key.UP, ord("B"): Key.DOWN}
_SINGLE = {
    ord("\r"): Key.ENTER,
    ord("\n"): Key.ENTER,
    ord("q"): Key.QUIT,
    ord("Q"): Key.QUIT,
    0x03: Key.INTERRUPT,
    0x04: Key.QUIT,  # Ctrl-D
    ord("k"): Key.UP,
    ord("j"): Key.DOWN,
}
_DIGITS = {ord(str(n)): Key(str(n)) for n in range(1, 10)}


class KeyDecoder:
    """Bytes from a raw terminal in, keys out; unknown bytes are dropped."""

    def __init__(self) -> None:
        self._pending = b""

    @property
    def pending(self) -> bool:
        """True while an Esc waits to learn whether an escape sequence follows."""
        return bool(self._pending)

    def feed(self, data: bytes) -> list[Key]:
        keys: list[Key] = []
        buf = self._pending + data
        i = 0
        while i < len(buf):
            byte = buf[i]
            if byte != _ESC:
                key = _SINGLE.get(byte) or _DIGITS.get(byte)
                if key is not None:
                    keys.append(key)
                i += 1
                continue
            if i + 1 >= len(buf):
                break  # Esc alone so far: wait for more, or for flush()
            if buf[i + 1] not in (ord("["), ord("O")):
                keys.append(Key.QUIT)  # Esc then an ordinary key: Esc was meant alone
                i += 1
                continue
            # CSI or SS3: parameters and intermediates, then one final byte in 0x40..0x7E
            end = i + 2
            while end < len(buf) and not 0x40 <= buf[end] <= 0x7E:
                end += 1
            if end >= len(buf):
                break  # the sequence is cut between reads
            if end == i + 2 and buf[end] in _ARROWS:
                keys.append(_ARROWS[buf[end]])
            i = end + 1  # other sequences (Home, F-keys, mouse) mean nothing here
        self._pending = buf[i:]
        return keys

    def flush(self) -> list[Key]:
        """Nothing more came: a pending lone Esc is the Esc key."""
        pending, self._pending = self._pending, b""
        return [Key.QUIT] if pending == bytes([_ESC]) else []


@dataclass(frozen=True)
class Item:
    """One line of the menu."""

    label: str
    """What the line says."""
    action: str
    """What the shell runs when it is chosen."""


@dataclass(frozen=True)
class Choice:
    """How the menu ended: an item chosen, or the user left."""

    item: Item | None
    """The chosen item, or None when the user left."""
    interrupted: bool = False
    """True when the user left with Ctrl-C."""


class Menu:
    """A numbered list with a selection moved by arrows and chosen by Enter or digit.

    :meth:`press` returns None while the menu stays open.
    """

    def __init__(self, items: list[Item], selected: int = 0) -> None:
        if not items:
            raise ValueError("a menu needs at least one item")
        self.items = items
        self.selected = min(max(selected, 0), len(items) - 1)

    def press(self, key: Key) -> Choice | None:
        if key is Key.UP:
            self.selected = (self.selected - 1) % len(self.items)
        elif key is Key.DOWN:
            self.selected = (self.selected + 1) % len(self.items)
        elif key is Key.ENTER:
            return Choice(self.items[self.selected])
        elif key is Key.QUIT:
            return Choice(None)
        elif key is Key.INTERRUPT:
            return Choice(None, interrupted=True)
        elif key.digit is not None and key.digit <= len(self.items):
            self.selected = key.digit - 1
            return Choice(self.items[self.selected])
        return None

    def lines(self) -> list[tuple[bool, int, Item]]:
        """Each item with whether it is selected and its number (from 1)."""
        return [(i == self.selected, i + 1, item) for i, item in enumerate(self.items)]
