"""What the engine says of a container, in GPUMesh's terms.

A container's state from its inspection, with a command that could not start
reported the way ``docker run`` does (exit 127 when it is not found, 126 when
it is not executable), and tini's line about such a command (in a job's
stderr, in a shell's first output) replaced by ours:
``gpumesh: nvidia-smi: not found in image busybox:1 (exit 127)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Generator
from typing import Any

from gpumesh.errors import ExitCode
from gpumesh.runtime.base import LABEL_IMAGE, ContainerState, LogLine

__all__ = ["ALIVE", "container_state", "shell_output_in_our_words", "tini_in_our_words"]

ALIVE = frozenset({"running", "paused", "restarting"})
"""Docker's statuses of a container that has not stopped."""

# What tini (Docker's init, PID 1 of every job) writes when it cannot start the
# job's command (tini.c: PRINT_FATAL("exec %s failed: %s", ...), then exit 127
# for ENOENT, 126 for EACCES).
_TINI_EXEC = re.compile(rb"\[FATAL tini \(\d+\)\] exec (.*) failed: (.*?)\r?\n?")
_TINI_REASONS = {
    b"No such file or directory": f"not found in image {{image}} (exit {ExitCode.NOT_FOUND:d})",
    b"Permission denied": f"not executable in image {{image}} (exit {ExitCode.NOT_EXECUTABLE:d})",
}
_START_FAILURES = (ExitCode.NOT_EXECUTABLE, ExitCode.NOT_FOUND)


def container_state(attrs: dict[str, Any]) -> ContainerState:
    """A container as its inspection (``attrs``) describes it."""
    state = attrs.get("State") or {}
    status = str(state.get("Status") or "")
    error = str(state.get("Error") or "")
    exit_code = int(state.get("ExitCode", 0)) if status in ("exited", "dead") else None
    if status == "created" and error:
        # A start that failed for a missing or non-executable command leaves
        # the container "created"; present it the way `docker run` would.
        # Docker sets ExitCode 127/126 for those (128 for any other start
        # failure); an engine that sets none is judged by the message.
        docker_code = int(state.get("ExitCode") or 0)
        if docker_code:
            code = docker_code if docker_code in _START_FAILURES else None
        else:
            code = _start_failure_code(error)
        if code is not None:
            status, exit_code = "exited", code
    config = attrs.get("Config") or {}
    labels = config.get("Labels") or {}
    return ContainerState(
        container_id=str(attrs.get("Id", "")),
        # An empty value is an image's label we overrode: as good as absent.
        labels={str(key): str(value) for key, value in labels.items() if value},
        status=status,
        exit_code=exit_code,
        oom_killed=bool(state.get("OOMKilled")),
        error=error,
        # The name the job gave (the engine only knows the id it was created from).
        image=str(labels.get(LABEL_IMAGE) or config.get("Image") or ""),
    )


def _start_failure_code(message: str) -> int | None:
    """The exit code `docker run` reports for an OCI start error, if it is one."""
    lowered = message.lower()
    # Same order as the daemon: "permission denied" wins over "not found".
    if "permission denied" in lowered:
        return ExitCode.NOT_EXECUTABLE
    if "executable file not found" in lowered or "no such file or directory" in lowered:
        return ExitCode.NOT_FOUND
    return None


def tini_in_our_words(
    lines: Generator[LogLine, None, None], image: str
) -> Generator[LogLine, None, None]:
    """The job's stderr with tini's line about a command it could not start
    replaced by ours: ``gpumesh: nvidia-smi: not found in image busybox:1 (exit 127)``."""
    with contextlib.closing(lines):
        yield from (_reworded(line, image) if line.stream == "stderr" else line for line in lines)


def _reworded(line: LogLine, image: str) -> LogLine:
    if not line.data.startswith(b"[FATAL tini"):
        return line
    match = _TINI_EXEC.fullmatch(line.data)
    if match is None:
        return line
    return dataclasses.replace(line, data=_in_our_words(match, image) + b"\n")


def _in_our_words(match: re.Match[bytes], image: str) -> bytes:
    command = match.group(1).decode("utf-8", "replace")
    where = image or "?"
    reason = _TINI_REASONS.get(match.group(2))
    if reason is not None:
        said = reason.format(image=where)
    else:
        said = f"cannot be started in image {where}: {match.group(2).decode('utf-8', 'replace')}"
    return f"gpumesh: {command}: {said}".encode()


def shell_output_in_our_words(data: bytes, image: str) -> bytes:
    """A shell's first output with tini's line about a command it could not start
    (``[FATAL tini (6)] exec bash failed: No such file or directory``) replaced by
    ours, as a job's stderr has it: ``gpumesh: bash: not found in image IMG (exit
    127)``. A terminal's ``\\r\\n`` is kept."""
    if not data.startswith(b"[FATAL tini"):
        return data
    line, newline, rest = data.partition(b"\n")
    match = _TINI_EXEC.fullmatch(line + newline)
    if match is None:
        return data
    return _in_our_words(match, image) + (b"\r\n" if line.endswith(b"\r") else b"\n") + rest
