"""A captured session cookie is worth nothing: another local user's server on
another loopback port, visited by the owner's signed-in chromium (typed, and
through a link on the dashboard), receives no credential and no secret name, and
every credential it could have caught (the real session cookie included) opens
no route of the control API over TCP, pages and event streams included.

Browsers send a cookie to every port of its host; the dashboard lives at the
home's secret ``<random>.localhost`` name, and its cookie counts there alone.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpumesh.control.app import ENDPOINTS
from gpumesh.control.endpoints import Access
from tests.browser.test_dashboard import signed_in, wait_js
from tests.conftest import OtherUser
from tests.integration.conftest import gpumesh
from tests.integration.node import cli
from tests.integration.test_control_api import Api, start_control

pytestmark = pytest.mark.usefixtures("gpumesh_processes")

CATCHER = r"""
import http.server, json, sys

class Catch(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        seen = {"method": self.command, "path": self.path, "headers": self.headers.items()}
        print(json.dumps(seen), flush=True)
        body = b"<!doctype html><title>caught</title><p id='caught'>caught</p>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Catch)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class Catcher:
    """Another local user's HTTP server on a loopback port of its own: it records
    every request it receives, headers and all."""

    def __init__(self, other_user: OtherUser) -> None:
        # The other account cannot read this account's Python; the system's it can.
        python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
        assert python is not None
        self.proc = subprocess.Popen(
            other_user.argv(python, "-c", CATCHER),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.requests: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.requests.append(json.loads(line))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=30)


@pytest.fixture
def catcher(other_user: OtherUser) -> Iterator[Catcher]:
    caught = Catcher(other_user)
    try:
        yield caught
    finally:
        caught.stop()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    home = tmp_path / "h"
    assert gpumesh(home, "init", "--name", "sign-in-node").returncode == 0
    started = start_control(home)
    try:
        yield started
    finally:
        started.stop()


def _credentials(requests: list[dict[str, Any]]) -> list[str]:
    """Every cookie value and bearer token in ``requests``."""
    found: list[str] = []
    for request in requests:
        for name, value in request["headers"]:
            if name.lower() == "cookie":
                found += [morsel.value for morsel in SimpleCookie(value).values()]
            elif name.lower() == "authorization":
                found.append(value.partition(" ")[2])
    return found


def _path(template: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", template)


def _refused_everywhere(api: Api, session: str, node_id: str) -> None:
    """``session`` as a cookie, at every loopback name but the secret one (what the
    catcher could present), opens no route: GETs first (the pages, the event streams),
    then every change, each with the CSRF header a script of the catcher would add."""
    port = api.url.rsplit(":", 1)[1]
    endpoints = sorted(ENDPOINTS, key=lambda e: e.method != "GET")
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1"):
        headers = {"host": host, "cookie": f"gpumesh_session={session}", "x-gpumesh-csrf": "1"}
        with httpx.Client(base_url=api.url, headers=headers, timeout=60) as client:
            for endpoint in endpoints:
                what = f"{endpoint.method} {endpoint.path} at {host}"
                body = {} if endpoint.method in ("POST", "PUT", "PATCH") else None
                with client.stream(endpoint.method, _path(endpoint.path), json=body) as response:
                    if endpoint.access is not Access.PUBLIC:
                        assert response.status_code == 401, what
                        continue
                    text = response.read().decode(errors="replace")
                    assert node_id not in text, what
                    if endpoint.media_type == "text/html":
                        assert 'id="login"' in text, what  # the sign-in page, no data


def test_another_users_server_on_another_port_catches_nothing_that_opens_the_dashboard(
    browser: Any, api: Api, catcher: Catcher
) -> None:
    node_id = api.ok("GET", "/api/v1/status", params={"offline": "1"})["node_id"]
    name = api.dashboard.removeprefix("http://").rsplit(":", 1)[0]
    with signed_in(browser, api) as page:
        assert node_id in page.content()
        (cookie,) = [c for c in page.context.cookies() if c["name"] == "gpumesh_session"]
        assert cookie["domain"] == name and cookie["httpOnly"]
        # Typed into the address bar.
        for typed in (
            f"http://127.0.0.1:{catcher.port}/typed",
            f"http://localhost:{catcher.port}/",
        ):
            page.goto(typed)
            assert page.locator("#caught").is_visible()
        # Followed from a link on the dashboard (as a job's forwarded port would be).
        page.goto(api.dashboard + "/jobs")
        page.evaluate(
            """(href) => {
                const link = document.createElement("a");
                link.id = "away"; link.href = href; link.textContent = "away";
                document.querySelector("main").append(link);
            }""",
            f"http://127.0.0.1:{catcher.port}/link",
        )
        with page.expect_navigation():
            page.click("#away")
        wait_js(page, "!!document.getElementById('caught')")

    paths = [r["path"] for r in catcher.requests]
    assert {"/typed", "/", "/link"} <= set(paths), paths
    # Whatever the catcher caught, and the real session cookie had it caught that,
    # opens no route.
    for session in {*_credentials(catcher.requests), cookie["value"]}:
        _refused_everywhere(api, session, node_id)
    # In fact no credential reached it, nor the secret name (a Referer would carry it).
    label = name.split(".")[0]
    for request in catcher.requests:
        for header, value in request["headers"]:
            assert "gpumesh_session" not in value and label not in value, (header, value)
            assert header.lower() != "authorization"


def test_the_page_dashboard_open_hands_the_browser_signs_it_in_once(browser: Any, api: Api) -> None:
    node_id = api.ok("GET", "/api/v1/status", params={"offline": "1"})["node_id"]
    # `true` as the browser: the page is written and handed over; chromium opens it.
    result = cli(api.home, "dashboard", "--open", BROWSER="true")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("\n") == 1 and "serves the dashboard on" in result.stderr
    handed = (api.home / "dashboard-login.html").as_uri()
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(handed)
        wait_js(
            page,
            f"location.origin === {json.dumps(api.dashboard)} && !location.hash"
            " && document.getElementById('login') === null",
        )
        page.wait_for_selector("text=Node id")
        assert node_id in page.content()
        # Opened again, the page's code is spent: it signs nobody in a second time.
        other = browser.new_context().new_page()
        other.goto(handed)
        # Null-safe: the page may still be loading (no notice yet) when first asked.
        failed = "document.getElementById('notice')?.textContent.includes('Sign-in failed')"
        wait_js(other, f"{failed} === true")
        assert other.locator("#login").is_visible()
        other.context.close()
    finally:
        context.close()
