"""`gpumesh dashboard` against a real `gpumesh-control` process: the URL it prints
signs a browser in once; without a control server (or without TCP) it says in
one line what to run."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.integration.conftest import gpumesh
from tests.integration.test_control_api import start_control


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "h"
    assert gpumesh(home, "init", "--name", "dash-node").returncode == 0
    return home


def test_dashboard_prints_a_one_time_login_url(tmp_path: Path) -> None:
    home = _home(tmp_path)
    api = start_control(home)
    try:
        result = gpumesh(home, "dashboard")
        assert result.returncode == 0, result.stderr
        url = result.stdout.strip()
        assert url.startswith(f"{api.url}/#code=")
        code = url.split("#code=", 1)[1]
        with httpx.Client(base_url=api.url) as browser:
            assert browser.get("/").status_code == 200
            assert "Node id" not in browser.get("/").text  # no session: no data
            first = browser.post("/api/v1/auth/session", json={"code": code})
            assert first.status_code == 204
            page = browser.get("/")
            assert "dash-node" in page.text and "Node id" in page.text
            again = httpx.post(f"{api.url}/api/v1/auth/session", json={"code": code})
            assert again.status_code == 401  # one time only
        # Each run mints a new code.
        assert gpumesh(home, "dashboard").stdout.strip() != url
    finally:
        api.stop()


def test_dashboard_without_a_control_server_says_what_to_run(tmp_path: Path) -> None:
    home = _home(tmp_path)
    result = gpumesh(home, "dashboard")
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "no control server runs" in result.stderr and "gpumesh-control" in result.stderr

    api = start_control(home, tcp=False)
    try:
        refused = gpumesh(home, "dashboard")
        assert refused.returncode != 0 and refused.stderr.count("\n") == 1
        assert "does not listen on TCP" in refused.stderr and "--no-tcp" in refused.stderr
    finally:
        api.stop()
