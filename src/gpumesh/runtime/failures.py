"""The Docker engine's failures as :mod:`gpumesh.errors` exceptions.

Every Docker, requests and socket failure reads as one line that says what to
do: an engine that is not there or not ours to use, one that did not answer,
or the engine's own explanation of an answer, cut to one line.
"""

from __future__ import annotations

from typing import Any

import docker.errors
import requests.exceptions
import urllib3.exceptions

from gpumesh.errors import RuntimeUnavailableError

__all__ = ["CONNECTION_ERRORS", "connection_error", "endpoint", "explanation", "one_line"]

_START_HINT = "start it with `sudo systemctl start docker`"

CONNECTION_ERRORS = (
    docker.errors.DockerException,
    requests.exceptions.RequestException,
    urllib3.exceptions.HTTPError,
    OSError,
)
"""Failures of the connection to the engine, as opposed to answers from it."""


def explanation(exc: docker.errors.APIError) -> str:
    """The engine's explanation of an error answer, on one line."""
    return one_line(str(exc.explanation or exc))


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line of at most ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def endpoint(api: Any) -> str:
    """Where the low-level client ``api`` reaches the engine, for messages."""
    adapter = getattr(api, "_custom_adapter", None)
    socket_path = getattr(adapter, "socket_path", None)
    if isinstance(socket_path, str):
        return f"unix://{socket_path}"
    return str(getattr(api, "base_url", "") or "the Docker socket")


def _root_reason(exc: BaseException) -> str:
    """The innermost OS error's text (e.g. "Connection refused"), else the message."""
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            return current.strerror
        pending.extend(arg for arg in current.args if isinstance(arg, BaseException))
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return one_line(str(exc), 200)


def connection_error(exc: BaseException, where: str) -> RuntimeUnavailableError:
    """A failure to reach the engine at ``where``, with what to do about it."""
    if isinstance(exc, requests.exceptions.Timeout):
        return RuntimeUnavailableError(
            f"Docker did not answer in time ({where}): check it with `docker info`, "
            "restart it with `sudo systemctl restart docker`"
        )
    reason = _root_reason(exc)
    if "permission denied" in reason.lower():
        return RuntimeUnavailableError(
            f"Docker is running but this user may not use it ({where}: permission denied): "
            "add the user to the docker group (`sudo usermod -aG docker $USER`) and log in again"
        )
    return RuntimeUnavailableError(
        f"Docker is not reachable on this machine ({where}: {reason}): {_START_HINT}"
    )
