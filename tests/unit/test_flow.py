"""protocol/flow: the sender never exceeds the window; credits come back every window/4."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.errors import ProtocolError
from gpumesh.protocol.flow import DEFAULT_WINDOW, ReceiveWindow, SendWindow


def test_default_window_is_8_mib() -> None:
    assert DEFAULT_WINDOW == 8 * 1024 * 1024
    assert SendWindow().available() == DEFAULT_WINDOW


def test_available_shrinks_with_sends_and_grows_with_credit() -> None:
    window = SendWindow(100)
    window.on_sent(60)
    assert window.available() == 40
    window.on_sent(40)
    assert window.available() == 0
    window.on_credit(30)
    assert window.available() == 30


def test_available_is_never_negative() -> None:
    window = SendWindow(10)
    window.on_sent(15)
    assert window.available() == 0


def test_credit_beyond_what_was_sent_is_impossible() -> None:
    window = SendWindow(100)
    window.on_sent(50)
    with pytest.raises(ProtocolError, match="impossible flow-control credit"):
        window.on_credit(51)


def test_credit_going_backwards_is_impossible() -> None:
    window = SendWindow(100)
    window.on_sent(50)
    window.on_credit(40)
    with pytest.raises(ProtocolError, match="impossible"):
        window.on_credit(39)


def test_repeated_credit_is_harmless() -> None:
    window = SendWindow(100)
    window.on_sent(50)
    window.on_credit(40)
    window.on_credit(40)
    assert window.available() == 90


def test_receiving_up_to_the_window_is_fine() -> None:
    window = ReceiveWindow(100)
    window.on_received(60)
    window.on_received(40)
    assert window.received == 100


def test_receiving_beyond_the_window_is_a_protocol_error() -> None:
    window = ReceiveWindow(100)
    window.on_received(100)
    with pytest.raises(ProtocolError, match="more bulk data than its flow-control window"):
        window.on_received(1)


def test_consumption_frees_receive_window() -> None:
    window = ReceiveWindow(100)
    window.on_received(100)
    window.on_consumed(30)
    window.on_received(30)
    with pytest.raises(ProtocolError):
        window.on_received(1)


def test_credit_is_sent_after_a_quarter_window_is_consumed() -> None:
    window = ReceiveWindow(100)
    window.on_received(100)
    assert window.on_consumed(24) is None
    assert window.on_consumed(1) == 25
    assert window.on_consumed(10) is None
    assert window.on_consumed(15) == 50
    assert window.on_consumed(25) == 75


def test_one_large_consumption_sends_one_credit_with_the_total() -> None:
    window = ReceiveWindow(100)
    window.on_received(90)
    assert window.on_consumed(90) == 90


@given(
    window_size=st.integers(min_value=4, max_value=5000),
    total=st.integers(min_value=1, max_value=100_000),
    reads=st.lists(st.integers(min_value=1, max_value=2000), min_size=1, max_size=60),
)
def test_sender_and_receiver_together_never_overflow(
    window_size: int, total: int, reads: list[int]
) -> None:
    """A sender that only sends what available() allows never trips the receiver."""
    sender, receiver = SendWindow(window_size), ReceiveWindow(window_size)
    unread = 0
    reads_iter = itertools.cycle(reads)
    sent = 0
    while sent < total:
        count = min(total - sent, sender.available())
        if count:
            sender.on_sent(count)
            receiver.on_received(count)  # raises on overflow
            sent += count
            unread += count
            assert sender.sent - sender.consumed <= window_size
            continue
        # Stalled: the reader consumes, and its credit unblocks the sender.
        take = min(next(reads_iter), unread)
        credit = receiver.on_consumed(take)
        unread -= take
        if credit is not None:
            sender.on_credit(credit)
    assert receiver.received == total
