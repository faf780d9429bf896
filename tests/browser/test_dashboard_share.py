"""Sharing from the owner's view in a real chromium: a fresh home behind a real
`gpumesh-control` (its node process in the foreground) is not shared; the owner
starts sharing with the page's button (``POST /api/v1/share``, the defaults),
sees since when and on which UDP address, and stops it again (``DELETE``), after
which the page says how the share ended. The home listens on loopback with
``job_network none``: sharing needs neither root nor firewall rules.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.test_dashboard import AXE, signed_in, wait_js
from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _free_udp_port, _init
from tests.integration.test_control_api import Api, start_control

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

CEILING = 60.0
START = 'button[aria-label="Start sharing this machine with the default options"]'
STOP = 'button[aria-label="Stop sharing this machine"]'
PAUSE = 'button[aria-label="Pause: take the machine back from peers"]'
RESUME = 'button[aria-label="Resume sharing: offer this machine to peers again"]'


@pytest.fixture(scope="module")
def owner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, int]]:
    home = tmp_path_factory.mktemp("share-dash") / "h"
    port = _free_udp_port()
    _init(home, "dana-ws", port)
    image = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
    for key, value in (("job_network", "none"), ("image", image)):
        assert gpumesh(home, "config", "set", key, value).returncode == 0
    api = start_control(home)
    try:
        yield api, port
    finally:
        if api.call("GET", "/api/v1/share").json().get("sharing"):
            api.call("DELETE", "/api/v1/share")
        api.stop()


def _shared(page: Any) -> str:
    value: str = page.get_attribute("#share", "data-sharing")
    return value


def test_the_owner_starts_and_stops_sharing_from_the_page(
    browser: Any, owner: tuple[Api, int]
) -> None:
    api, port = owner
    assert api.ok("GET", "/api/v1/share")["sharing"] is False
    with signed_in(browser, api) as page:
        page.goto(api.dashboard + "/owner")
        assert _shared(page) == "false"
        assert page.text_content("#share-state") == "Not shared."
        assert page.locator(STOP).count() == 0

        page.locator(START).click()
        wait_js(page, "document.getElementById('share')?.dataset.sharing === 'true'", CEILING)
        share = api.ok("GET", "/api/v1/share")
        assert share["sharing"] is True and share["udp"] == f"127.0.0.1:{port}"
        assert share["options"]["port"] is None and share["options"]["public"] is False
        state = page.text_content("#share-state")
        assert state.startswith("Shared since ") and f"on UDP 127.0.0.1:{port}" in state
        assert state.endswith("with the defaults."), state
        assert page.locator(START).count() == 0
        # The page's reading and the node's status agree.
        assert api.ok("GET", "/api/v1/status", params={"offline": "1"})["sharing"] is True

        page.once("dialog", lambda dialog: dialog.accept())
        page.locator(STOP).click()
        wait_js(page, "document.getElementById('share')?.dataset.sharing === 'false'", CEILING)
        share = api.ok("GET", "/api/v1/share")
        assert share["sharing"] is False and share["udp"] is None
        assert share["ended"] is not None and share["ended"]["how"]
        state = page.text_content("#share-state")
        assert state.startswith("Not shared. The last share ended "), state
        assert share["ended"]["how"] in state
        page.locator(START).wait_for()


def test_the_owner_pauses_and_resumes_from_the_page(browser: Any, owner: tuple[Api, int]) -> None:
    api, _ = owner
    api.ok("POST", "/api/v1/share", json={})
    try:
        with signed_in(browser, api) as page:
            page.goto(api.dashboard + "/owner")
            assert page.locator(RESUME).count() == 0
            page.once("dialog", lambda dialog: dialog.accept())
            page.locator(PAUSE).click()
            page.locator("#share-paused").wait_for(timeout=CEILING * 1000)
            assert page.text_content("#share-paused").startswith("Paused by you since ")
            assert page.locator(PAUSE).count() == 0
            assert api.ok("GET", "/api/v1/share")["paused_since"] is not None
            status = api.ok("GET", "/api/v1/status", params={"offline": "1"})
            assert status["state"] == "paused"

            page.locator(RESUME).click()
            page.locator("#share-paused").wait_for(state="detached", timeout=CEILING * 1000)
            assert api.ok("GET", "/api/v1/share")["paused_since"] is None
            page.locator(PAUSE).wait_for()
    finally:
        api.call("POST", "/api/v1/share/resume")
        api.ok("DELETE", "/api/v1/share")


def test_the_sharing_section_passes_axe_in_both_themes_while_shared(
    browser: Any, owner: tuple[Api, int]
) -> None:
    # axe is injected by the test, so this context alone bypasses the page's CSP.
    api, _ = owner
    api.ok("POST", "/api/v1/share", json={})
    try:
        serious = []
        for theme in ("light", "dark"):
            with signed_in(browser, api, bypass_csp=True, color_scheme=theme) as page:
                page.goto(f"{api.dashboard}/owner?theme={theme}")
                assert _shared(page) == "true"
                page.add_script_tag(path=str(AXE))
                result = page.evaluate("axe.run(document)")
                assert len(result["passes"]) > 10  # axe ran and checked the page
                serious += [
                    f"{theme}: {v['id']} {v['help']} {[n['target'] for n in v['nodes']]}"
                    for v in result["violations"]
                    if v["impact"] in ("serious", "critical")
                ]
        assert serious == []
    finally:
        api.ok("DELETE", "/api/v1/share")
