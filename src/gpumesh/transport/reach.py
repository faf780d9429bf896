"""The one wording of a peer that could not be reached.

``connect``, ``run``, ``group members`` and ``run --group --explain`` all report
an unreachable peer; they use these words, so each says where it tried (host and
port) and what to check there.
"""

from __future__ import annotations

from gpumesh.errors import UnreachableError

__all__ = ["unreachable"]

_SHARING = "is `gpumesh share` running there"


def unreachable(
    where: str, *, refused: bool = False, waited: float | None = None, reason: str = ""
) -> UnreachableError:
    """Nobody answered at ``where`` (``host:port``, or several joined by commas).

    ``refused``: the host said nothing listens on that port (ICMP); ``waited``:
    seconds without any answer; ``reason``: the system's words for a failure
    before anything was sent (no route, say).
    """
    if refused:
        what = f"nothing is listening on {where} (connection refused)"
        return UnreachableError(f"{what}: {_SHARING}?", refused=True, why=what)
    if waited is not None:
        what = f"no answer from {where} within {waited:.0f}s"
    else:
        what = f"cannot reach {where}" + (f" ({reason})" if reason else "")
    return UnreachableError(f"{what}: {_SHARING} and is its UDP port reachable?", why=what)
