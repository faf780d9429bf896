"""Browser tests: Playwright driving Debian's chromium (``/usr/bin/chromium``, never
a downloaded browser) against real ``gpumesh-control`` processes.

``scripts/ensure-browser.sh`` installs chromium and zbar-tools; without them the
tests are skipped on a laptop (``GPUMESH_TEST_NO_BROWSER=1``), never in CI.
Screenshots go to ``$GPUMESH_TEST_ARTIFACTS`` (or a folder of the test run's
temporary directory, printed at the end).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # Module scope, not session: Playwright's sync API keeps an event loop running
    # in this thread while it is open, and the in-process tests that follow the
    # browser tests in the same run call asyncio.run(), which refuses to start
    # inside a running loop.
    if not _in_ci() and (
        os.environ.get("GPUMESH_TEST_NO_BROWSER") == "1" or not Path(CHROMIUM).exists()
    ):
        pytest.skip("no chromium (scripts/ensure-browser.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: ``$GPUMESH_TEST_ARTIFACTS`` or the run's temporary folder."""
    given = os.environ.get("GPUMESH_TEST_ARTIFACTS")
    folder = Path(given) if given else tmp_path_factory.mktemp("artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
