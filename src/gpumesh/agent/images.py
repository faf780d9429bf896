"""Which images peers may run here, and how much disk the ones pulled for them may take.

A peer names any image; the provider's owner decides which it accepts
(``allowed_images``: glob patterns, ``*`` by default), how long a pull may take
(``pull_timeout``), and how much disk the images GPUMesh pulled for peers may
take together (``image_disk``): past it, the least recently used of those
images are removed (never one a container still uses, never one the owner
pulled or built). Images that were on the machine before a peer asked are the
owner's and are never counted or removed.

The rules (:func:`image_names`, :func:`check_allowed`, :func:`to_prune`) are
pure; :class:`ImageKeeper` applies them through the runtime and the store.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpumesh.errors import AccessDeniedError, LimitError
from gpumesh.runtime.base import JobRuntime
from gpumesh.store.db import Store
from gpumesh.units import format_size

__all__ = ["ImageKeeper", "check_allowed", "image_names", "to_prune"]

logger = logging.getLogger(__name__)

_DEFAULT_REGISTRY = "docker.io"


def image_names(image: str) -> list[str]:
    """The ways one image reference can be written: as given, with its tag made
    explicit, and with Docker Hub's registry and ``library/`` spelled out.

    ``busybox`` -> ``busybox``, ``busybox:latest``, ``library/busybox:latest``,
    ``docker.io/library/busybox:latest``; a pattern matching any of them allows it.
    """
    names = [image]
    name, digest = image.split("@", 1) if "@" in image else (image, "")
    last = name.rsplit("/", 1)[-1]
    tagged = name if ":" in last or digest else f"{name}:latest"
    full = tagged + (f"@{digest}" if digest else "")
    first = name.split("/", 1)[0]
    has_registry = "/" in name and ("." in first or ":" in first or first == "localhost")
    forms = [full]
    if not has_registry:
        hub = full if "/" in name else f"library/{full}"
        forms += [hub, f"{_DEFAULT_REGISTRY}/{hub}"]
    for form in forms:
        if form not in names:
            names.append(form)
    return names


def check_allowed(image: str, patterns: str, provider: str) -> None:
    """Refuse ``image`` unless one of the space-separated glob ``patterns`` matches it."""
    allowed = patterns.split()
    if "*" in allowed:
        return
    names = image_names(image)
    if any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in allowed):
        return
    raise AccessDeniedError(
        f"{provider} refused image {image!r}: it runs only images matching "
        f"{', '.join(allowed)} (its allowed_images); pick one of those, or ask its owner"
    )


@dataclass(frozen=True)
class Pulled:
    image: str
    size: int
    last_used: float


def to_prune(pulled: list[Pulled], budget: int, keep: str) -> tuple[int, list[Pulled]]:
    """How many bytes are over ``budget``, and the images that may go to free them,
    least recently used first; ``keep`` (the image a job is about to use) is never
    among them. The caller removes them in that order until the excess is gone,
    skipping those it cannot remove (a container uses them)."""
    excess = sum(item.size for item in pulled) - budget
    if excess <= 0:
        return 0, []
    order = sorted((item for item in pulled if item.image != keep), key=lambda e: e.last_used)
    return excess, order


class ImageKeeper:
    """Applies ``allowed_images`` and ``image_disk`` for one agent (blocking calls)."""

    def __init__(
        self,
        store: Store,
        runtime: Callable[[], JobRuntime],
        *,
        provider: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._runtime = runtime
        self._provider = provider
        self._clock = clock

    def used(self, image: str, pulled: bool, budget: int) -> None:
        """Account for a job about to use ``image`` (``pulled`` now for it): record
        it, then remove the least recently used pulled images past ``budget``.

        Refuses (and removes again) an image that alone is larger than the budget.
        """
        runtime = self._runtime()
        now = self._clock()
        if pulled:
            size = runtime.image_size(image) or 0
            if size > budget:
                runtime.remove_image(image)
                raise LimitError(
                    f"{self._provider} refused image {image!r}: it is {format_size(size)}, "
                    f"more than the {format_size(budget)} its owner lets images pulled for "
                    "peers take (image_disk)"
                )
            self._store.record_pulled_image(image, size, now)
        else:
            self._store.touch_pulled_image(image, now)
        excess, order = to_prune(
            [Pulled(*row) for row in self._store.pulled_images()], budget, keep=image
        )
        for victim in order:
            if excess <= 0:
                break
            if runtime.remove_image(victim.image):  # never one a container uses
                logger.info("removed image %s, pulled for peers, unused the longest", victim.image)
                self._store.forget_pulled_image(victim.image)
                excess -= victim.size
