"""Image pulls on the engine, bounded in time, and what a missing image reads as.

The SDK has no deadline for a whole pull (its timeout is per read), so
:func:`pull_image` runs the pull in its own thread and waits at most the
runtime's ``pull_timeout``; Docker finishes an abandoned pull in the
background. A failed pull reaches the peer as its kind only
(:func:`pull_failure`), never in the engine's words.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import docker.errors

from gpumesh.errors import ImageMissingError
from gpumesh.runtime.failures import connection_error, endpoint, explanation, one_line
from gpumesh.runtime.pull import PullProgress, PullTracker

__all__ = ["missing_image", "not_here", "pull_failure", "pull_image"]

logger = logging.getLogger(__name__)


class _PullFailed(Exception):
    """An error message inside Docker's pull progress stream."""


def pull_image(
    api: Any,
    image: str,
    progress: Callable[[PullProgress], None] | None,
    timeout: float,
) -> None:
    """Pull ``image`` through the low-level client ``api``, telling ``progress`` how
    it goes; raise :class:`~gpumesh.errors.ImageMissingError` when it failed or did
    not finish within ``timeout`` seconds."""
    failures: list[Exception] = []
    finished = threading.Event()
    tracker = PullTracker(image)

    def pull() -> None:
        try:
            for message in api.pull(image, stream=True, decode=True):
                if not isinstance(message, dict):
                    continue
                if message.get("error"):
                    raise _PullFailed(str(message["error"]))
                if tracker.feed(message) and progress is not None and not finished.is_set():
                    progress(tracker.progress())
        except Exception as exc:  # handed over to the waiting thread
            failures.append(exc)
        finally:
            finished.set()

    # Waited on here at most ``timeout``: Docker finishes an abandoned pull in
    # the background, and a later ensure_image then finds the image.
    logger.info("pulling image %s", image)
    threading.Thread(target=pull, name=f"docker pull {image}", daemon=True).start()
    if not finished.wait(timeout):
        reason = f"the pull did not finish within {timeout:g} s (pull_timeout)"
        raise ImageMissingError(missing_image(image, reason))
    if failures:
        failure = failures[0]
        if isinstance(failure, _PullFailed):
            detail = one_line(str(failure))
        elif isinstance(failure, docker.errors.APIError):
            detail = explanation(failure)
        else:
            raise connection_error(failure, endpoint(api)) from failure
        # The engine's words may name this machine's resolver, proxy or
        # addresses: the peer hears only what kind of failure it was.
        logger.info("pulling %s failed: %s", image, detail)
        raise ImageMissingError(missing_image(image, pull_failure(detail))) from failure


def not_here(image: str) -> str:
    """An image a container was to be made from is not on this machine."""
    return (
        f"image {image!r} is not on this machine; on the provider run "
        f"`docker pull {image}` or `docker load -i FILE`"
    )


def pull_failure(detail: str) -> str:
    """What a peer may hear of a failed pull: its kind, never the engine's words
    (which name resolvers, proxies and addresses of the provider's network)."""
    text = detail.lower()
    if any(word in text for word in ("not found", "manifest unknown", "does not exist")):
        return "the registry has no such image or tag"
    if any(word in text for word in ("unauthorized", "denied", "authentication required")):
        return "the registry refused it: a private image, or it needs a login on the provider"
    if "toomanyrequests" in text or "rate limit" in text:
        return "the registry's pull rate limit was reached; try again later"
    if "invalid reference" in text or "invalid reference format" in text:
        return "that is not a valid image name"
    if any(word in text for word in ("no space left", "disk quota")):
        return "the provider's disk is full"
    network = (
        "lookup",
        "dial tcp",
        "no such host",
        "timeout",
        "connection refused",
        "tls",
        "i/o timeout",
        "network",
        "proxy",
        "eof",
        "certificate",
    )
    if any(word in text for word in network):
        return "the provider cannot reach the registry"
    return "the pull failed"


def missing_image(image: str, reason: str) -> str:
    """An image is not on this machine and ``reason`` says why a pull cannot help."""
    return (
        f"image {image!r} is not on this machine and cannot be pulled ({reason}); "
        f"on the provider run `docker pull {image}` or `docker load -i FILE`"
    )
