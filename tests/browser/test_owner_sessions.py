"""The owner's view of open sessions in a real chromium: alice shares (a `gpumesh
share` process, real dockerd) her desktop (a plain TCP echo server stands in for
it) and CUDA (the host-memory fallback: no GPU here) with bob-laptop, who opens a
shell, a desktop connection and a CUDA session; alice ends one from the /owner
page with the keyboard alone, then denies bob there, which ends every one.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.cuda import RemoteDevice
from gpumesh.errors import GPUMeshError
from tests.browser.test_dashboard import AXE, signed_in, tab_to, wait_js
from tests.integration.conftest import until
from tests.integration.test_owner_sessions import Owner, sharing_sessions

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

CEILING = 60.0
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def owner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Owner]:
    with sharing_sessions(tmp_path_factory.mktemp("owner-dash")) as shared:
        yield shared


def _sessions(owner: Owner, kind: str) -> list[dict[str, Any]]:
    return list(owner.api.ok("GET", "/api/v1/owner")["sessions"][kind])


def _consumer(bob: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpumesh", *args],
        env=dict(os.environ, GPUMESH_HOME=str(bob)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def _desktop_connection(bob: Path) -> Iterator[tuple[subprocess.Popen[str], socket.socket]]:
    """`desktop connect alice-pc` and one TCP connection through it (echo checked)."""
    proc = _consumer(bob, "desktop", "connect", "alice-pc", "--bind", "127.0.0.1:0")
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        found = re.search(r"is on 127\.0\.0\.1:(\d+);", first)
        assert found is not None, first
        with socket.create_connection(("127.0.0.1", int(found.group(1))), CEILING) as conn:
            conn.sendall(b"ping")
            assert conn.recv(4) == b"ping"
            conn.settimeout(CEILING)
            yield proc, conn
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_the_owner_stops_a_desktop_connection_from_the_page_by_keyboard(
    browser: Any, owner: Owner
) -> None:
    with _desktop_connection(owner.bob) as (proc, conn):
        [listed] = until(
            lambda: _sessions(owner, "desktops"), "the desktop listed", within=CEILING, every=0.2
        )
        _no_serious_axe_violation(browser, owner)
        with signed_in(browser, owner.api) as page:
            page.goto(owner.api.dashboard + "/owner")
            label = f"Stop bob-laptop's desktop session {listed['id']}"
            row = page.locator(f'tr[data-session="{listed["id"]}"]')
            assert "Desktop" in row.inner_text() and "bob-laptop" in row.inner_text()
            tab_to(page, f'button[aria-label="{label}"]')
            page.keyboard.press("Enter")
            assert conn.recv(100) == b""  # cut by the owner, with no traffic from us
            wait_js(page, f"document.querySelector('tr[data-session=\"{listed['id']}\"]') === null")
        _, err = proc.communicate(timeout=CEILING)
        assert proc.returncode == 3
        assert err.strip().splitlines()[-1] == (
            "error: alice-pc's owner ended your desktop connection"
        )
    assert _sessions(owner, "desktops") == []


def _no_serious_axe_violation(browser: Any, owner: Owner) -> None:
    """The owner's page with a session listed, in both themes (axe is injected by
    the test, so this context alone bypasses the page's CSP)."""
    serious = []
    for theme in ("light", "dark"):
        with signed_in(browser, owner.api, bypass_csp=True, color_scheme=theme) as page:
            page.goto(f"{owner.api.dashboard}/owner?theme={theme}")
            page.locator("tr[data-session]").first.wait_for()
            page.add_script_tag(path=str(AXE))
            result = page.evaluate("axe.run(document)")
            assert len(result["passes"]) > 10  # axe ran and checked the page
            serious += [
                f"{theme}: {v['id']} {v['help']} {[n['target'] for n in v['nodes']]}"
                for v in result["violations"]
                if v["impact"] in ("serious", "critical")
            ]
    assert serious == []


def test_deny_and_stop_everything_ends_shells_desktop_and_cuda_sessions(
    browser: Any, owner: Owner
) -> None:
    shell = _consumer(owner.bob, "exec", "alice-pc", "--", "sh", "-c", "echo ready; sleep 600")
    dev = None
    try:
        assert shell.stdout is not None
        assert shell.stdout.readline() == "ready\n"
        dev = RemoteDevice("alice-pc", home=owner.bob, memory=MiB)
        with _desktop_connection(owner.bob) as (desktop, conn):
            until(
                lambda: all(_sessions(owner, kind) for kind in ("shells", "desktops", "cuda")),
                "a shell, a desktop and a CUDA session listed",
                within=CEILING,
                every=0.2,
            )
            [cuda] = _sessions(owner, "cuda")
            with signed_in(browser, owner.api) as page:
                page.goto(owner.api.dashboard + "/owner")
                for kind in ("Shell", "Desktop", "CUDA"):
                    page.locator("tr[data-session]", has_text=kind).wait_for()
                page.once("dialog", lambda dialog: dialog.accept())
                tab_to(page, 'button[aria-label="Deny and stop everything for bob-laptop"]')
                page.keyboard.press("Enter")
                wait_js(page, "document.querySelector('tr[data-session]') === null")
            assert conn.recv(100) == b""
            _, err = desktop.communicate(timeout=CEILING)
            assert desktop.returncode == 3 and "revoked your access" in err, err
        _, err = shell.communicate(timeout=CEILING)
        assert shell.returncode == 3 and "revoked your access" in err, err
        with pytest.raises(GPUMeshError, match="revoked"):
            dev.synchronize()
        for kind in ("shells", "desktops", "cuda"):
            assert _sessions(owner, kind) == [], kind
        with pytest.raises(OSError):
            os.kill(cuda["pid"], 0)  # the CUDA worker is gone
    finally:
        if dev is not None:
            dev.close()
        if shell.poll() is None:
            shell.kill()
            shell.communicate()
        owner.api.ok("POST", "/api/v1/peers/bob-laptop/allow")
