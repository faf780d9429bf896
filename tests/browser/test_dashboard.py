"""The dashboard in a real chromium, against real `gpumesh-control` processes in
front of real nodes: alice shares (`gpumesh share` asks her node process; her
control server, a node process in the foreground, takes the share over; real dockerd), bob
is paired with her both ways, carol is a fresh node that pairs with alice through
the pages alone. The control servers see simulated GPUs (NVIDIA hardware is the
one thing faked, and it says so: source "simulated") with a time-varying load.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests.integration.conftest import gpumesh, shared_pair, until
from tests.integration.test_cli import _free_udp_port, _init
from tests.integration.test_control_api import Api, start_control

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

AXE = Path(__file__).parent / "vendor" / "axe.min.js"
SIMULATED = {
    "GPUMESH_TEST_SIMULATED_GPUS": "RTX-4090:24GB,A100:80GB:10GB",
    "GPUMESH_TEST_SIMULATED_GPU_LOAD": "1",
    "GPUMESH_TEST_GPU_SAMPLE_SECONDS": "0.5",
}
PAGES = ("/", "/peers", "/jobs", "/groups", "/owner")
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@dataclass
class Mesh:
    alice: Api
    """alice's dashboard: she shares."""
    bob: Api
    """bob's dashboard: he submits to alice."""
    carol: Api
    """carol's dashboard: not paired with anyone yet."""
    jobs: list[str]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("dash")
    with shared_pair(tmp) as (alice, bob):
        carol = tmp / "c"
        _init(carol, "carol-ws", _free_udp_port())
        with mock.patch.dict(os.environ, SIMULATED):
            apis = [start_control(home) for home in (alice, bob, carol)]
        try:
            yield Mesh(*apis, jobs=[])
        finally:
            for api in apis:
                api.stop()


@contextlib.contextmanager
def signed_in(browser: Any, api: Api, base: str = "", **options: Any) -> Iterator[Any]:
    """A page of a fresh browser context, signed in to ``api``'s dashboard through a
    one-time login URL (the context is the cookie jar: one per dashboard); ``base``
    reaches the dashboard another way (a forwarder)."""
    context = browser.new_context(**options)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on(
        "console",
        lambda msg: errors.append(msg.text) if "Content Security Policy" in msg.text else None,
    )
    try:
        url = api.ok("POST", "/api/v1/auth/login-codes")["url"]
        page.goto(url.replace(api.dashboard, base) if base else url)
        wait_js(page, "document.getElementById('login') === null && !location.hash")
        page.wait_for_selector("nav")
        yield page
        assert errors == [], errors
    finally:
        context.close()


def wait_js(page: Any, expression: str, ceiling: float = 60.0) -> Any:
    """Poll a JavaScript expression until truthy (``page.wait_for_function`` would
    evaluate it with ``eval``, which the dashboard's CSP refuses, as it should)."""
    from playwright.sync_api import Error

    def now() -> Any:
        try:
            return page.evaluate(expression)
        except Error as exc:
            if "navigation" in str(exc) or "context was destroyed" in str(exc):
                return None  # the page is being replaced: ask the next one
            raise

    return until(now, f"never true: {expression}", within=ceiling, every=0.2)


def tab_to(page: Any, selector: str, presses: int = 80) -> None:
    """Move the focus to ``selector`` with the Tab key alone."""
    for _ in range(presses):
        page.keyboard.press("Tab")
        if page.evaluate("(s) => !!document.activeElement?.matches(s)", selector):
            return
    raise AssertionError(f"Tab never reached {selector}")


# --- no session, no data; another site's form is refused ----------------------------------------


class _EvilPage(http.server.BaseHTTPRequestHandler):
    target = ""

    def do_GET(self) -> None:
        body = (
            f'<!doctype html><form method="post" action="{self.target}">'
            '<input name="x" value="1"><button id="go">go</button></form>'
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_page_without_a_session_shows_nothing_and_another_sites_post_is_refused(
    browser: Any, mesh: Mesh
) -> None:
    context = browser.new_context()
    page = context.new_page()
    try:
        node_id = mesh.bob.ok("GET", "/api/v1/status", params={"offline": "1"})["node_id"]
        for path in (*PAGES, "/jobs/anything"):
            response = page.goto(mesh.bob.dashboard + path)
            assert response.status == 200
            assert page.locator("#login").is_visible(), path
            text = page.content()
            assert node_id not in text and "alice-pc" not in text and "gpm1_" not in text, path
        # A wrong token is refused in words; nothing shows up. (At 127.0.0.1: the right
        # one sends the browser on to the dashboard's own name, signed in.)
        page.goto(mesh.bob.url + "/")
        page.fill("#login-token", "not-the-token")
        page.keyboard.press("Enter")
        wait_js(page, "document.getElementById('notice')?.textContent.includes('wrong') === true")
        assert page.locator("#login").is_visible()
        # The right token signs in.
        page.fill("#login-token", mesh.bob.token)
        page.keyboard.press("Enter")
        page.wait_for_selector("text=Node id")
        assert node_id in page.content()
        assert page.url.startswith(mesh.bob.dashboard + "/")

        # A page of another origin posts a form to the API: refused by Origin.
        target = f"{mesh.bob.dashboard}/api/v1/peers/alice-pc/deny"
        handler = type("Evil", (_EvilPage,), {"target": target})
        evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=evil.serve_forever, daemon=True)
        thread.start()
        try:
            page.goto(f"http://127.0.0.1:{evil.server_address[1]}/")
            with page.expect_navigation():
                page.click("#go")
            assert "another site" in page.content()
        finally:
            evil.shutdown()
            evil.server_close()
        peers = {p["name"]: p["allowed"] for p in mesh.bob.ok("GET", "/api/v1/peers")}
        assert peers["alice-pc"] is True
    finally:
        context.close()


# --- pairing by keyboard, the QR code, connect ------------------------------------------------


def _copy_code(page: Any) -> str:
    """Select this node's code with the keyboard and copy it; returns what was copied."""
    tab_to(page, "#my-code")
    page.keyboard.press("Control+a")
    page.keyboard.press("Control+c")
    code: str = page.input_value("#my-code")
    return code


def _paste_and_pair(page: Any, code: str, peer: str) -> None:
    tab_to(page, "#pair-code")
    page.keyboard.press("Control+v")
    if page.input_value("#pair-code") != code:
        # A headless browser without a system clipboard: type what was copied.
        page.keyboard.type(code)
    assert page.input_value("#pair-code") == code
    page.keyboard.press("Tab")  # to the Pair button
    with page.expect_navigation():
        page.keyboard.press("Enter")
    page.wait_for_selector(f'tr[data-peer="{peer}"]')


def test_two_dashboards_pair_by_keyboard_connect_and_the_qr_decodes(
    browser: Any, mesh: Mesh, tmp_path: Path
) -> None:
    permissions = {"permissions": ["clipboard-read", "clipboard-write"]}
    with (
        signed_in(browser, mesh.alice, **permissions) as alice,
        signed_in(browser, mesh.carol, **permissions) as carol,
    ):
        alice.goto(mesh.alice.dashboard + "/peers")
        carol.goto(mesh.carol.dashboard + "/peers")

        # The QR code drawn on the server decodes back to the code shown beside it.
        shown = alice.input_value("#my-code")
        png = tmp_path / "qr.png"
        alice.locator("#qr svg").screenshot(path=str(png))
        decoded = subprocess.run(
            ["zbarimg", "--raw", "-q", str(png)], capture_output=True, text=True, check=False
        )
        assert decoded.returncode == 0, decoded.stderr
        assert decoded.stdout.strip() == shown

        _paste_and_pair(carol, _copy_code(alice), "alice-pc")
        _paste_and_pair(alice, _copy_code(carol), "carol-ws")
        assert "carol-ws" in {p["name"] for p in mesh.alice.ok("GET", "/api/v1/peers")}
        assert "alice-pc" in {p["name"] for p in mesh.carol.ok("GET", "/api/v1/peers")}

        # Connect from carol's page: the path and the round trip show up in its row.
        tab_to(carol, 'button[aria-label="Connect to alice-pc"]')
        carol.keyboard.press("Enter")
        wait_js(carol, "document.getElementById('connect-alice-pc').textContent.includes('RTT')")
        assert carol.text_content("#connect-alice-pc").startswith("direct, ")


# --- GPU charts ---------------------------------------------------------------------------------


def test_the_charts_draw_the_sampled_history_and_move(browser: Any, mesh: Mesh) -> None:
    with signed_in(browser, mesh.bob) as page:
        wait_js(page, "window.gpumeshCharts && window.gpumeshCharts.length === 2")
        assert page.locator("[data-chart] canvas").count() == 2
        first = page.evaluate("window.gpumeshCharts.map((c) => c.plot.data)")
        assert all(len(series[0]) >= 1 for series in first)

        def moved() -> Any:
            now = page.evaluate("window.gpumeshCharts.map((c) => c.plot.data)")
            return now if now[0][0][-1] != first[0][0][-1] else None

        later = until(moved, "the charts never received a newer sample", every=0.2)
        for before, after in zip(first, later, strict=True):
            assert after[0][-1] > before[0][-1]  # a later time
            assert len(after[0]) > len(before[0]) or after[0][0] > before[0][0]
        # Utilisation and temperature are drawn from varying samples.
        assert len({v for v in later[0][1] if v is not None}) > 1


# --- a job from the page ------------------------------------------------------------------------


def _lines(page: Any) -> list[tuple[str, str]]:
    pairs: list[list[str]] = page.eval_on_selector_all(
        "#log .line", "els => els.map((e) => [e.dataset.stream, e.textContent])"
    )
    return [(stream, text) for stream, text in pairs]


def test_a_run_from_the_page_streams_survives_a_reload_and_cancels(
    browser: Any, mesh: Mesh
) -> None:
    script = (
        "i=0; while [ $i -lt 30 ]; do i=$((i+1)); echo line $i; sleep 0.1; done; "
        "echo oops >&2; sleep 300"
    )
    with signed_in(browser, mesh.bob) as page:
        page.goto(mesh.bob.dashboard + "/jobs")
        page.select_option("#run-where", "peer:alice-pc")
        page.fill("#run-command", f"sh -c '{script}'")
        page.fill("#run-env", "GREETING=hi there")
        with page.expect_navigation(url="**/jobs/*"):
            page.click("#run button[type=submit]")
        job_id = page.get_attribute("#job", "data-job")
        assert job_id
        mesh.jobs.append(job_id)
        page.wait_for_selector("#log .line:has-text('line 3')")
        page.reload()  # mid-job: the page reads the log again from its start
        page.wait_for_selector("#log .line.stderr:has-text('oops')", timeout=60_000)
        lines = _lines(page)
        assert [t for s, t in lines if s == "stdout"] == [f"line {i}" for i in range(1, 31)]
        assert [t for s, t in lines if s == "stderr"] == ["oops"]
        assert page.text_content("#job-state") == "running"

        # The filter hides the lines without its text.
        page.fill("#log-filter", "line 1")
        visible = page.eval_on_selector_all(
            "#log .line:not(.hidden)", "els => els.map((e) => e.textContent)"
        )
        assert visible == ["line 1", *[f"line {i}" for i in range(10, 20)]]

        tab_to(page, "#cancel")
        page.keyboard.press("Enter")
        wait_js(page, "document.getElementById('job-state').textContent === 'cancelled'")
    job = mesh.bob.ok("GET", f"/api/v1/jobs/{job_id}")
    assert job["state"] == "cancelled"


class Forwarder:
    """A loopback TCP forwarder whose open connections can all be cut at once: a
    network drop between the browser and the dashboard."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            with self.lock:
                self.accepted += 1
                self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:
            cut, self.open = self.open, []
        for sock in cut:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_a_dropped_connection_resumes_the_log_without_loss_or_repeat(
    browser: Any, mesh: Mesh
) -> None:
    forwarder = Forwarder(int(mesh.bob.url.rsplit(":", 1)[1]))
    # The dashboard's own name at the forwarder's port: the session cookie counts there.
    via = f"{mesh.bob.dashboard.rsplit(':', 1)[0]}:{forwarder.listener.getsockname()[1]}"
    try:
        with signed_in(browser, mesh.bob, base=via) as page:
            script = "i=0; while [ $i -lt 60 ]; do i=$((i+1)); echo line $i; sleep 0.1; done"
            body = {"peer": "alice-pc", "command": ["sh", "-c", script + "; echo done"]}
            job_id = mesh.bob.ok("POST", "/api/v1/jobs", json=body)["job_id"]
            page.goto(f"{via}/jobs/{job_id}")
            page.wait_for_selector("#log .line:has-text('line 5')")
            before = forwarder.accepted
            forwarder.cut()  # the event stream drops mid-job
            page.wait_for_selector("#log .line:has-text('done')", timeout=60_000)
            assert forwarder.accepted > before  # the page reconnected by itself
            lines = [t for s, t in _lines(page) if s == "stdout"]
            assert lines == [*(f"line {i}" for i in range(1, 61)), "done"]
    finally:
        forwarder.close()


# --- the owner denies a peer --------------------------------------------------------------------


def test_deny_from_the_owners_view_stops_the_peers_job_and_refuses_the_next(
    browser: Any, mesh: Mesh
) -> None:
    body = {"peer": "alice-pc", "command": ["sh", "-c", "echo started; sleep 300"]}
    job_id = mesh.bob.ok("POST", "/api/v1/jobs", json=body)["job_id"]
    mesh.jobs.append(job_id)

    def hosted() -> dict[str, Any]:
        """The job as alice, who runs it, knows it."""
        jobs = mesh.alice.ok("GET", "/api/v1/owner")["hosted"]
        return next((j for j in jobs if j["job_id"] == job_id), {"state": "unknown"})

    def running() -> bool:
        return bool(hosted()["state"] == "running")

    until(running, "bob's job never ran", every=0.2)
    try:
        with signed_in(browser, mesh.alice) as page:
            page.goto(mesh.alice.dashboard + "/owner")
            button = page.locator('button[aria-label="Deny and stop everything for bob-laptop"]')
            page.once("dialog", lambda dialog: dialog.accept())
            button.click()
            wait_js(
                page,
                "document.querySelector('tr[data-peer=\"bob-laptop\"]')?.textContent"
                ".includes('denied')",
            )

        def stopped() -> Any:
            job = hosted()
            return job if job["state"] in ("cancelled", "failed") else None

        until(stopped, "bob's job kept running after the deny", every=0.2)
        refused = mesh.bob.call("POST", "/api/v1/jobs", json=body)
        assert refused.status_code == 403 and refused.json()["code"] == "denied", refused.text
    finally:
        mesh.alice.ok("POST", "/api/v1/peers/bob-laptop/allow")


def test_the_owner_stops_one_hosted_job_from_the_owners_view(browser: Any, mesh: Mesh) -> None:
    body = {"peer": "alice-pc", "command": ["sh", "-c", "sleep 300"]}
    job_id = mesh.bob.ok("POST", "/api/v1/jobs", json=body)["job_id"]

    def state() -> str:
        jobs = mesh.alice.ok("GET", "/api/v1/owner")["hosted"]
        return str(next((j["state"] for j in jobs if j["job_id"] == job_id), "unknown"))

    until(lambda: state() == "running", "the job never ran", every=0.2)
    with signed_in(browser, mesh.alice) as page:
        page.goto(mesh.alice.dashboard + "/owner")
        tab_to(page, f'button[aria-label="Stop job {job_id}"]')
        page.keyboard.press("Enter")
        until(lambda: state() == "cancelled", "the job kept running", every=0.2)
    # Only that job: bob is still allowed and may run again.
    assert {p["name"]: p["allowed"] for p in mesh.alice.ok("GET", "/api/v1/peers")}["bob-laptop"]


# --- groups -------------------------------------------------------------------------------------


def test_the_groups_page_and_a_run_on_a_group_lands_where_explain_says(
    browser: Any, mesh: Mesh
) -> None:
    bob, carol = mesh.bob.home, mesh.carol.home
    assert gpumesh(bob, "pair", gpumesh(carol, "pair-code").stdout.strip()).returncode == 0
    assert gpumesh(bob, "group", "create", "research").returncode == 0
    for member in ("alice-pc", "carol-ws"):
        assert gpumesh(bob, "group", "add", "research", member).returncode == 0
    explained = gpumesh(bob, "run", "--group", "research", "--explain", "--", "true", timeout=60)
    assert explained.returncode == 0, explained.stderr
    chosen = explained.stderr.split("placing on ", 1)[1].split(":", 1)[0]
    assert chosen == "alice-pc"  # carol does not share: unreachable

    with signed_in(browser, mesh.bob) as page:
        page.goto(mesh.bob.dashboard + "/groups")
        group = page.locator('[data-group="research"]')
        row = {
            name: group.locator(f'tr[data-member="{name}"] td').all_text_contents()
            for name in ("alice-pc", "carol-ws", "bob-laptop")
        }
        # Reachable, GPUs, free GPU memory, state, why skipped.
        # alice's share runs in her control server, which sees simulated GPUs.
        assert row["alice-pc"][0].startswith("yes (") and "(SIMULATED)" in row["alice-pc"][1]
        assert row["alice-pc"][3] == "idle" and row["alice-pc"][4] == "-"
        # carol did not answer: the reason is why she would be skipped.
        assert row["carol-ws"][0] == "no" and "unreachable" in row["carol-ws"][4]
        assert row["bob-laptop"][4] == "this node"

        page.goto(mesh.bob.dashboard + "/jobs")
        page.select_option("#run-where", "group:research")
        page.fill("#run-command", "echo placed")
        with page.expect_navigation(url="**/jobs/*"):
            page.click("#run button[type=submit]")
        page.wait_for_selector("#log .line:has-text('placed')")
        facts = dict(
            zip(
                page.locator("#job dt").all_text_contents(),
                page.locator("#job dd").all_text_contents(),
                strict=True,
            )
        )
        assert facts["Peer"] == chosen


# --- themes -------------------------------------------------------------------------------------


def test_themes_follow_the_system_the_switch_and_the_url(browser: Any, mesh: Mesh) -> None:
    background = "getComputedStyle(document.body).backgroundColor"
    with signed_in(browser, mesh.bob, color_scheme="dark") as page:
        dark = page.evaluate(background)
        page.goto(mesh.bob.dashboard + "/peers?theme=light")
        light = page.evaluate(background)
        assert dark != light and page.get_attribute("html", "data-theme") == "light"
        # The switch, by keyboard: it applies at once and is remembered.
        page.goto(mesh.bob.dashboard + "/peers")
        assert page.evaluate(background) == dark  # the system's
        tab_to(page, "#theme-switch")
        page.keyboard.press("ArrowDown")  # System -> Light
        assert page.input_value("#theme-switch") == "light"
        assert page.evaluate(background) == light
        page.reload()
        assert page.evaluate(background) == light
        assert page.input_value("#theme-switch") == "light"


# --- accessibility and screenshots --------------------------------------------------------------


def _paths(mesh: Mesh) -> list[str]:
    return [*PAGES, *(f"/jobs/{j}" for j in mesh.jobs[:1])]


def test_every_page_passes_axe_in_both_themes(browser: Any, mesh: Mesh) -> None:
    # axe is injected by the test, so this context alone bypasses the page's CSP.
    serious: list[str] = []
    for theme in ("light", "dark"):
        with signed_in(browser, mesh.bob, bypass_csp=True, color_scheme=theme) as page:
            for path in _paths(mesh):
                page.goto(f"{mesh.bob.dashboard}{path}?theme={theme}")
                page.wait_for_load_state("networkidle")
                page.add_script_tag(path=str(AXE))
                result = page.evaluate("axe.run(document)")
                assert len(result["passes"]) > 10, path  # axe ran and checked the page
                for v in result["violations"]:
                    if v["impact"] in ("serious", "critical"):
                        targets = [n["target"] for n in v["nodes"]][:3]
                        serious.append(f"{theme} {path}: {v['id']} {v['help']} {targets}")
    assert serious == []


def test_screenshots_of_every_page_light_and_dark_desktop_and_phone(
    browser: Any, mesh: Mesh, artifacts: Path
) -> None:
    made = []
    for size_name, size in (("desktop", DESKTOP), ("phone", PHONE)):
        for theme in ("light", "dark"):
            with signed_in(browser, mesh.bob, viewport=size, color_scheme=theme) as page:
                for path in _paths(mesh):
                    page.goto(mesh.bob.dashboard + path)
                    page.wait_for_load_state("networkidle")
                    name = path.strip("/").replace("/", "-") or "overview"
                    if name.startswith("jobs-"):
                        name = "job"
                    shot = artifacts / f"{name}-{theme}-{size_name}.png"
                    page.screenshot(path=str(shot), full_page=True)
                    made.append(shot)
                    # Nothing wider than the window: readable on a phone.
                    width = page.evaluate("document.documentElement.scrollWidth")
                    assert width <= size["width"] + 1, (path, size_name, width)
    assert all(p.stat().st_size > 1000 for p in made)
    print(f"\nscreenshots: {artifacts}")
