"""What the owner shares besides jobs: the desktop and CUDA remoting, each
with its own allowlist (empty until the owner adds a peer); and whether the
owner paused sharing (``gpumesh pause``), which outlives a restart."""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpumesh.protocol.desktop import DesktopKind
from gpumesh.store.tables import Tables

__all__ = ["DesktopShare", "Pause", "ShareTables"]


@dataclass(frozen=True)
class DesktopShare:
    """The desktop this node's owner shares: peers on the desktop allowlist reach
    exactly this local port, nothing else."""

    kind: DesktopKind
    port: int
    """The TCP port on 127.0.0.1 the provider forwards to."""
    shared_at: float


@dataclass(frozen=True)
class Pause:
    """The owner took the machine back: guests get nothing until ``gpumesh resume``."""

    since: float
    grace: float
    """Seconds guest jobs were given between SIGTERM and SIGKILL."""


class ShareTables(Tables):
    """The store's methods on the desktop share, CUDA sharing and their allowlists."""

    # --- the desktop share and its allowlist -----------------------------------------

    def desktop_share(self) -> DesktopShare | None:
        """The desktop the owner shares, or None (not shared)."""
        rows = self._query("SELECT kind, port, shared_at FROM desktop_share WHERE id = 1")
        if not rows:
            return None
        row = rows[0]
        return DesktopShare(DesktopKind.parse(row["kind"]), int(row["port"]), row["shared_at"])

    def set_desktop_share(
        self, kind: DesktopKind, port: int, now: float | None = None
    ) -> DesktopShare:
        when = now or time.time()
        self._execute(
            "INSERT INTO desktop_share (id, kind, port, shared_at) VALUES (1, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET kind = excluded.kind, port = excluded.port, "
            "shared_at = excluded.shared_at",
            (str(kind), port, when),
        )
        return DesktopShare(kind, port, when)

    def clear_desktop_share(self) -> bool:
        """Stop sharing the desktop; False when it was not shared."""
        return self._execute("DELETE FROM desktop_share WHERE id = 1") > 0

    def set_desktop_allowed(self, node_id: str, allowed: bool, now: float | None = None) -> None:
        if allowed:
            self._execute(
                "INSERT OR IGNORE INTO desktop_allowed (node_id, allowed_at) VALUES (?, ?)",
                (node_id, now or time.time()),
            )
        else:
            self._execute("DELETE FROM desktop_allowed WHERE node_id = ?", (node_id,))

    def desktop_allowed_ids(self) -> set[str]:
        """Peers that may use the desktop: on its allowlist and not denied altogether."""
        rows = self._query(
            "SELECT d.node_id FROM desktop_allowed d JOIN peers p ON p.node_id = d.node_id "
            "WHERE p.allowed = 1"
        )
        return {str(r["node_id"]) for r in rows}

    # --- CUDA remoting: its allowlist and whether it is shared ------------------------

    def cuda_allow(self, node_id: str, now: float | None = None) -> None:
        """Let a paired peer open CUDA sessions here (besides the peer allowlist)."""
        self._execute(
            "INSERT OR IGNORE INTO cuda_allowed (node_id, allowed_at) VALUES (?, ?)",
            (node_id, time.time() if now is None else now),
        )

    def cuda_deny(self, node_id: str) -> bool:
        """Take a peer off the CUDA allowlist; False when it was not on it."""
        return self._execute("DELETE FROM cuda_allowed WHERE node_id = ?", (node_id,)) > 0

    def cuda_allowed(self) -> set[str]:
        """The node ids on the CUDA allowlist."""
        return {r["node_id"] for r in self._query("SELECT node_id FROM cuda_allowed")}

    def set_cuda_share(self, sharing: bool, now: float | None = None) -> None:
        """Remember whether this node offers CUDA sessions whenever it shares."""
        self._execute(
            "INSERT INTO cuda_share (id, sharing, changed_at) VALUES (1, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET sharing = excluded.sharing, "
            "changed_at = excluded.changed_at",
            (int(sharing), time.time() if now is None else now),
        )

    def cuda_share(self) -> bool:
        """Whether this node offers CUDA sessions (off until `cuda share`)."""
        rows = self._query("SELECT sharing FROM cuda_share WHERE id = 1")
        return bool(rows and rows[0]["sharing"])

    # --- the owner's pause ----------------------------------------------------------------

    def pause(self, grace: float, now: float | None = None) -> Pause:
        """Remember that the owner paused sharing (kept from the first pause on)."""
        self._execute(
            "INSERT OR IGNORE INTO owner_pause (id, since, grace) VALUES (1, ?, ?)",
            (time.time() if now is None else now, grace),
        )
        paused = self.paused()
        assert paused is not None
        return paused

    def resume(self) -> bool:
        """Sharing is the guests' again; False when it was not paused."""
        return self._execute("DELETE FROM owner_pause WHERE id = 1") > 0

    def paused(self) -> Pause | None:
        """Since when the owner paused sharing, or None."""
        rows = self._query("SELECT since, grace FROM owner_pause WHERE id = 1")
        return Pause(rows[0]["since"], rows[0]["grace"]) if rows else None
