"""A job's events on the wire, paced by the reader, and what a reader missed; no I/O.

A job can print far faster than a consumer reads. Sent as plain messages, its
events would pile up at the consumer, which refuses to hold more than a few
hundred KiB of unread messages per stream. So a consumer that asks for it
(``credited`` in ``JobSubmit``/``JobLogs``) gets the events as one bulk
section instead: DATA frames whose bytes are the same ``MESSAGE`` frames one
after another. DATA is sent only within the consumer's credit, which it returns
as it reads, so the provider waits for a slow consumer and the consumer never
holds more than the credit window; the job itself is never slowed, since the
provider keeps writing its output to the store regardless. An empty DATA frame
ends the section; a refusal, if any, follows as a plain message.

The provider keeps at most ``job_log_limit`` of a job's output and drops the
oldest beyond it. Every piece of output carries its offset in the job's output
(stdout and stderr together), so a reader tells a gap from its own position:
:class:`OutputPosition`.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpumesh.errors import ProtocolError
from gpumesh.protocol.framing import FrameDecoder, FrameKind, encode_frame
from gpumesh.protocol.messages import JobOutput, JobStatus, Message, decode_message, encode_message

__all__ = ["UNKNOWN", "EventSection", "OutputPosition", "encode_events"]

UNKNOWN = -1
"""An offset nobody knows (an older provider, or output stored before offsets were kept)."""


def encode_events(messages: Iterable[JobOutput | JobStatus]) -> bytes:
    """The bytes of a credited section that carry ``messages``, in order."""
    return b"".join(encode_frame(FrameKind.MESSAGE, encode_message(m)) for m in messages)


class EventSection:
    """The consumer's side: messages out of a credited section's DATA bytes.

    Holds at most one partial message (64 KiB) between DATA frames.
    """

    def __init__(self) -> None:
        self._decoder = FrameDecoder()

    def feed(self, data: bytes) -> list[Message]:
        messages: list[Message] = []
        for frame in self._decoder.feed(data):
            if frame.kind is not FrameKind.MESSAGE:
                raise ProtocolError("peer sent a non-message frame inside a job's events")
            messages.append(decode_message(frame.body))
        return messages

    def end(self) -> None:
        """The section ended (an empty DATA frame): nothing may be left half-sent."""
        if not self._decoder.at_frame_boundary():
            raise ProtocolError("peer ended a job's events in the middle of a message")


class OutputPosition:
    """Where a reader is in a job's output, and what it was never sent.

    ``next`` is the offset of the output byte the reader expects next. A piece
    further on means the provider dropped what lay between: the drop is always
    of the oldest output, so a gap that ends at offset N also says that at
    least N bytes were dropped in all (:attr:`known_dropped`).
    """

    def __init__(self, next_offset: int = 0) -> None:
        self.next = next_offset
        self.known_dropped = 0

    def on_output(self, offset: int, size: int) -> int:
        """A piece of ``size`` bytes at ``offset`` arrived: the bytes dropped before it."""
        if offset < 0:  # not known: neither can the next gap be
            self.next = UNKNOWN
            return 0
        dropped = offset - self.next if self.next >= 0 and offset > self.next else 0
        if dropped:
            self.known_dropped = max(self.known_dropped, offset)
        self.next = offset + size
        return dropped
