"""Application-level flow control for bulk sections of a stream, without I/O.

The receiver tells the sender, in ``CREDIT`` frames, how many bulk bytes it has
consumed; the sender keeps at most ``window`` bytes unconsumed. So a slow
reader bounds what both sides buffer, whatever the transport does.
"""

from __future__ import annotations

from gpumesh.errors import ProtocolError

__all__ = ["DEFAULT_WINDOW", "ReceiveWindow", "SendWindow"]

DEFAULT_WINDOW = 8 * 1024 * 1024


class SendWindow:
    """Sender's view: how much more may be sent now."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self.sent = 0
        self.consumed = 0

    def available(self) -> int:
        return max(0, self.window - (self.sent - self.consumed))

    def on_sent(self, count: int) -> None:
        self.sent += count

    def on_credit(self, consumed_total: int) -> None:
        if consumed_total < self.consumed or consumed_total > self.sent:
            raise ProtocolError("peer sent an impossible flow-control credit")
        self.consumed = consumed_total


class ReceiveWindow:
    """Receiver's view: what has arrived, what was consumed, when to send credit."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self.received = 0
        self.consumed = 0
        self._credited = 0

    def on_received(self, count: int) -> None:
        self.received += count
        if self.received - self.consumed > self.window:
            raise ProtocolError("peer sent more bulk data than its flow-control window")

    def on_consumed(self, count: int) -> int | None:
        """Record consumption; return a credit total to send back, or None yet."""
        self.consumed += count
        if self.consumed - self._credited >= self.window // 4:
            self._credited = self.consumed
            return self.consumed
        return None
