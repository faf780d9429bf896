"""The suite's tiers: markers that come from the fixtures a test requests, and the
fast tier (``pytest --fast``, ``scripts/test.sh --fast``) that leaves out what is
slow to run while working. CI runs everything.

A test is marked by what it requests, directly or through other fixtures:

    docker      ``docker_daemon``: a real Docker engine
    runtime     ``runtime_engine``: the job runtime's own tests against that engine
    browser     ``browser``: Playwright driving chromium
    desktop     ``desktop_programs``: Xvfb, x11vnc, FreeRDP
    postgres    the registry database fixture's ``postgresql`` case
    wan         ``network_lab``: network namespaces, NAT, emulated links
    subprocess  ``gpumesh_processes``: the CLI or a node process in processes of
                their own (what makes the integration tests slow)
    smoke       set by hand on the few end-to-end tests the fast tier keeps

A test that starts ``gpumesh`` or a node process without requesting
``gpumesh_processes`` fails, saying so: the ``subprocess`` marker cannot lie.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

MARKS_FROM_FIXTURES = {
    "docker": "docker_daemon",
    "runtime": "runtime_engine",
    "browser": "browser",
    "desktop": "desktop_programs",
    "wan": "network_lab",
    "subprocess": "gpumesh_processes",
}

MARKERS = {
    "docker": "needs a running Docker daemon (from the docker_daemon fixture)",
    "runtime": "the job runtime's tests against the engine (from runtime_engine)",
    "browser": "drives chromium (from the browser fixture)",
    "desktop": "drives real desktop servers and clients (from desktop_programs)",
    "postgres": "needs PostgreSQL (the registry database fixture's postgresql case)",
    "wan": "builds network namespaces (from the network_lab fixture)",
    "subprocess": "starts the CLI or a node process (from gpumesh_processes)",
    "smoke": "an end-to-end test the fast tier keeps although it is slow",
    "gpu": "needs an NVIDIA GPU whose driver loads (skipped elsewhere)",
}

NOT_FAST = ("browser", "desktop", "postgres", "wan", "subprocess", "docker")
"""What the fast tier leaves out, unless a test is marked ``smoke`` (and ``docker``
unless it is marked ``runtime``: the runtime's own tests against the engine stay)."""

ALWAYS_FAST = ("unit", "fuzz")
"""Folders of ``tests/`` the fast tier runs whole."""

_GUARDED_MODULES = ("gpumesh", "gpumesh.__main__", "gpumesh.daemon", "gpumesh.daemon.main")
_GUARDED_SCRIPTS = ("gpumesh", "gpumesh-control")
_may_spawn = True
_left_out: Counter[str] = Counter()
_selected: list[int] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="run the fast tier: tests/unit, tests/fuzz, the smoke tests and what is not "
        f"marked {', '.join(NOT_FAST)} (tests/tiers.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    sys.addaudithook(_audit)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        requested = set(getattr(item, "fixturenames", ()))
        for marker, fixture in MARKS_FROM_FIXTURES.items():
            if fixture in requested:
                item.add_marker(marker)
    if not config.getoption("fast"):
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        reason = _why_not_fast(item)
        if reason:
            dropped.append(item)
            _left_out[reason] += 1
        else:
            kept.append(item)
    _selected[:] = [len(kept), len(items)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Set before the test's own fixtures start: whether it may start gpumesh."""
    global _may_spawn
    _may_spawn = item.get_closest_marker("subprocess") is not None


def pytest_unconfigure(config: pytest.Config) -> None:
    """The fast tier's last line, after pytest's own summary (``scripts/test.sh``
    prints it last again, from ``$GPUMESH_TEST_FAST_SUMMARY``)."""
    if not _selected:
        return
    kept, total = _selected
    left = ", ".join(f"{count} {marker}" for marker, count in _left_out.most_common())
    line = f"fast: {kept} of {total} items; not run: {left or 'nothing'}"
    print(line, flush=True)
    where = os.environ.get("GPUMESH_TEST_FAST_SUMMARY")
    if where:
        Path(where).write_text(line + "\n")


def _why_not_fast(item: pytest.Item) -> str | None:
    """The first marker of :data:`NOT_FAST` that ``item`` has; None: it is fast."""
    if item.get_closest_marker("smoke") is not None:
        return None
    if Path(str(item.path)).parent.name in ALWAYS_FAST:
        return None
    kept = ("docker",) if item.get_closest_marker("runtime") is not None else ()
    return next(
        (m for m in NOT_FAST if m not in kept and item.get_closest_marker(m) is not None), None
    )


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "subprocess.Popen" or _may_spawn:
        return
    argv = args[1]
    if _starts_gpumesh([argv] if isinstance(argv, (str, bytes)) else list(argv)):
        raise RuntimeError(
            "this test starts gpumesh or a node process in a process of its own: "
            "request the gpumesh_processes fixture (tests/tiers.py), so that its "
            "subprocess marker is true"
        )


def _starts_gpumesh(argv: Sequence[Any]) -> bool:
    words = [w.decode() if isinstance(w, bytes) else str(w) for w in argv]
    if words and Path(words[0]).name in _GUARDED_SCRIPTS:
        return True
    return any(
        word == "-m" and following in _GUARDED_MODULES
        for word, following in itertools.pairwise(words)
    )


@pytest.fixture
def gpumesh_processes() -> None:
    """Declares that a test starts the CLI or a node process in processes of their
    own; it gets the ``subprocess`` marker, and the fast tier leaves it out."""
