"""The CLI run inside the test process, as users run it: through the home's node
process (the command starts one in the background when none runs).

A command in a process of its own pays Python's start and the CLI's imports each
time; most of the suite's time went there. :func:`run_cli` calls the CLI's
``main`` here instead, with the command's environment, an empty stdin and its
output captured, and answers what :func:`subprocess.run` would. Where a process
of its own is the point (signals, terminals, a process's lifetime or imports),
tests start one themselves. It falls back to a subprocess where the CLI cannot
run here: inside a running event loop or off the main thread (a command runs
its own loop and signal handlers), and for ``exec`` (:data:`OWN_PROCESS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping

__all__ = ["run_cli"]


def run_cli(
    args: list[str], env: Mapping[str, str], *, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``gpumesh ARGS`` with ``env`` as its whole environment; what it printed and its
    exit code, as :func:`subprocess.run` with ``capture_output`` and ``text`` gives them."""
    if not _can_run_here() or _command(args) in OWN_PROCESS:
        return subprocess.run(
            [sys.executable, "-m", "gpumesh", *args],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    from gpumesh.cli.main import main

    out, err = io.BytesIO(), io.BytesIO()
    with _environment(env), _streams(out, err), own_logging():
        code = main(list(args))
    return subprocess.CompletedProcess(
        ["gpumesh", *args], code, out.getvalue().decode(), err.getvalue().decode()
    )


OWN_PROCESS = {"exec"}
"""Commands that read and write file descriptors 0 and 1 themselves (a terminal's
raw bytes): their output is captured in a process of their own."""


def _command(args: list[str]) -> str | None:
    """The command's name: the first argument that is not an option (``--home H``
    takes the one after it)."""
    words = iter(args)
    for word in words:
        if word == "--home":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _can_run_here() -> bool:
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    _forget_browsers()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        _forget_browsers()


def _forget_browsers() -> None:
    """The standard library's :mod:`webbrowser` reads ``$BROWSER`` once per process:
    each command here reads its own, as in a process of its own."""
    browsers = sys.modules.get("webbrowser")
    if browsers is not None:
        browsers._tryorder = None  # type: ignore[attr-defined]


@contextlib.contextmanager
def _streams(out: io.BytesIO, err: io.BytesIO) -> Iterator[None]:
    saved = sys.stdin, sys.stdout, sys.stderr
    stdout = io.TextIOWrapper(out, encoding="utf-8", errors="replace", write_through=True)
    stderr = io.TextIOWrapper(err, encoding="utf-8", errors="replace", write_through=True)
    with open(os.devnull) as nothing:
        sys.stdin, sys.stdout, sys.stderr = nothing, stdout, stderr
        try:
            yield
        finally:
            sys.stdin, sys.stdout, sys.stderr = saved
            stdout.detach()
            stderr.detach()


@contextlib.contextmanager
def own_logging() -> Iterator[None]:
    """A command sets up the ``gpumesh`` logger once per process (a console handler on
    its stderr, the home's debug log): undone after each, as its process's end would."""
    root = logging.getLogger("gpumesh")
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)
        if hasattr(root, "_gpumesh_configured"):
            del root._gpumesh_configured
        common = sys.modules.get("gpumesh.cli._common")
        if common is not None:
            common._LogState.file = None
