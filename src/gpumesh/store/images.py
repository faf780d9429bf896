"""The images this node pulled for peers' jobs (the ones ``image_disk`` may prune)."""

from __future__ import annotations

import time

from gpumesh.store.tables import Tables

__all__ = ["ImageTables"]


class ImageTables(Tables):
    """The store's methods on the images pulled for peers."""

    def record_pulled_image(self, image: str, size: int, now: float | None = None) -> None:
        stamp = time.time() if now is None else now
        self._execute(
            "INSERT INTO pulled_images (image, size, pulled_at, last_used) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(image) DO UPDATE SET size = excluded.size, last_used = excluded.last_used",
            (image, size, stamp, stamp),
        )

    def touch_pulled_image(self, image: str, now: float | None = None) -> None:
        stamp = time.time() if now is None else now
        self._execute("UPDATE pulled_images SET last_used = ? WHERE image = ?", (stamp, image))

    def pulled_images(self) -> list[tuple[str, int, float]]:
        """(image, size, last used) of the images pulled for peers, least recently used first."""
        rows = self._query("SELECT image, size, last_used FROM pulled_images ORDER BY last_used")
        return [(str(r["image"]), int(r["size"]), float(r["last_used"])) for r in rows]

    def forget_pulled_image(self, image: str) -> None:
        self._execute("DELETE FROM pulled_images WHERE image = ?", (image,))
