"""What an image pull has done so far, from the engine's progress stream (no I/O).

Docker reports a pull as one JSON object per event, most of them about one layer
(``id``): ``Pulling fs layer`` / ``Waiting`` when it is known, ``Downloading`` with
``progressDetail.current``/``total`` (compressed bytes), ``Download complete``,
``Extracting``, ``Pull complete``, or ``Already exists`` for a layer that is here.
:class:`PullTracker` folds those into one :class:`PullProgress` a consumer can
show: layers done of layers known, and bytes fetched of bytes known. Totals grow
while the pull runs (a layer's size is known only once its download starts), so
a view must not treat them as final until ``done``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PullProgress", "PullTracker"]

_KNOWN = frozenset({"Pulling fs layer", "Waiting"})
_FETCHED = frozenset({"Download complete", "Verifying Checksum", "Extracting"})
_DONE = frozenset({"Pull complete", "Already exists"})


@dataclass(frozen=True)
class PullProgress:
    """One moment of a pull."""

    image: str
    layers: int
    """Layers known so far (those already here count, as done)."""
    layers_done: int
    downloaded: int
    """Compressed bytes fetched so far."""
    total: int
    """Compressed bytes of the layers whose size is known so far."""
    done: bool = False


@dataclass
class _Layer:
    fetched: int = 0
    size: int = 0
    complete: bool = False


class PullTracker:
    """Feed the engine's events in order; read :meth:`progress` whenever."""

    def __init__(self, image: str) -> None:
        self.image = image
        self._layers: dict[str, _Layer] = {}
        self._done = False

    def feed(self, event: Mapping[str, object]) -> bool:
        """Take one event; whether the figures changed."""
        before = self.progress()
        self._take(event)
        return self.progress() != before

    def _take(self, event: Mapping[str, object]) -> None:
        status, ident = event.get("status"), event.get("id")
        if not isinstance(status, str):
            return
        if status.startswith(("Digest:", "Status:")):
            self._done = True
            return
        known = status in _KNOWN or status in _FETCHED or status in _DONE
        if not isinstance(ident, str) or not ident or not (known or status == "Downloading"):
            return  # "Pulling from ...": about the image, not a layer
        layer = self._layers.setdefault(ident, _Layer())
        detail = event.get("progressDetail")
        if status == "Downloading" and isinstance(detail, Mapping):
            current, total = detail.get("current"), detail.get("total")
            if isinstance(total, int) and total > 0:
                layer.size = total
            if isinstance(current, int) and current >= 0:
                layer.fetched = min(current, layer.size) if layer.size else current
        elif status in _FETCHED or status in _DONE:
            layer.complete = layer.complete or status in _DONE
            layer.fetched = max(layer.fetched, layer.size)

    def progress(self) -> PullProgress:
        layers = self._layers.values()
        return PullProgress(
            image=self.image,
            layers=len(self._layers),
            layers_done=sum(1 for layer in layers if layer.complete),
            downloaded=sum(layer.fetched for layer in layers),
            total=sum(layer.size for layer in layers),
            done=self._done,
        )
