"""What the node process's share routes answer: the share, and the lines it says.

The node process's :class:`~gpumesh.daemon.sharing.Sharing` fills these in. A
share's view holds its options and what its agent says of itself, so these live
apart from the process's own views (:mod:`gpumesh.control.views`), which the thin
CLI reads.
"""

from __future__ import annotations

import msgspec

from gpumesh.client.bodies import ShareOptions
from gpumesh.store.home import AgentInfo

__all__ = ["PauseView", "ShareEnd", "ShareLine", "ShareView"]


class ShareLine(msgspec.Struct):
    """One line a share printed: numbered from the node process's start."""

    seq: int
    text: str
    err: bool = False
    """Printed on stderr (warnings, how it stopped)."""
    tone: str = ""
    """``warn`` (yellow), ``alarm`` (red, bold) or empty."""


class PauseView(msgspec.Struct):
    """``POST /api/v1/share/pause`` and ``/resume``: whether the owner has the machine."""

    paused: bool
    """Now: peers get nothing until ``gpumesh resume``."""
    changed: bool
    """The request changed it (False: it was paused, or not paused, already)."""
    since: float | None = None
    """When the pause began (None: not paused)."""
    grace: float = 0.0
    """Seconds guest jobs had between SIGTERM and SIGKILL."""
    jobs: list[str] = []
    """Guest jobs this pause preempted."""
    sessions: int = 0
    """Guest shells and CUDA sessions it ended."""


class ShareEnd(msgspec.Struct):
    """When and how this home's last share ended."""

    at: float
    how: str


class ShareView(msgspec.Struct):
    """``GET /api/v1/share``: whether this home shares, since when, with what."""

    sharing: bool
    since: float | None = None
    options: ShareOptions | None = None
    udp: str | None = None
    """``host:port`` the share listens on."""
    first_line: int = 0
    """The sequence number of this share's first line of output (``after`` it - 1)."""
    ended: ShareEnd | None = None
    """How the last share ended, while none runs."""
    agent: AgentInfo | None = None
    """What the running share's agent says of itself: its links, relay and open
    sessions (``status`` and the owner's views of commands run elsewhere)."""
    paused_since: float | None = None
    """When the owner paused sharing (``gpumesh pause``), shared or not; None: not
    paused."""
