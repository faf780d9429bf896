"""`gpumesh dashboard` through the home's real node process: it starts one when
none runs, asks it to serve TCP, and the URL it prints signs a browser-like
client in once; the node process then stays (no idle exit) until `daemon stop`.
A taken port is named in one line; `gpumesh-control` still serves it too."""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import OtherUser
from tests.integration.conftest import gpumesh
from tests.integration.node import alive, cli, status, wait_gone
from tests.integration.test_control_api import _free_tcp_port, start_control

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "h"
    assert gpumesh(home, "init", "--name", "dash-node").returncode == 0
    return home


def _signs_in_once(url: str, base: str) -> None:
    """``url`` signs a browser-like client in once, and only once: a client of
    ``base`` that names the URL's host (``<name>.localhost``, as a browser would)."""
    port = base.rsplit(":", 1)[1]
    origin, _, code = url.partition("/#code=")
    name = origin.removeprefix("http://")
    assert code and name.endswith(f".localhost:{port}"), url
    with httpx.Client(base_url=base, headers={"host": name}) as browser:
        assert browser.get("/").status_code == 200
        assert "Node id" not in browser.get("/").text  # no session: no data
        first = browser.post("/api/v1/auth/session", json={"code": code})
        assert first.status_code == 204
        page = browser.get("/")
        assert "dash-node" in page.text and "Node id" in page.text
        # A browser session may not tell the node process to serve TCP elsewhere.
        refused = browser.post(
            "/api/v1/node/tcp", json={"listen": "127.0.0.1:1"}, headers={"x-gpumesh-csrf": "1"}
        )
        assert refused.status_code == 403
    again = httpx.post(f"{base}/api/v1/auth/session", json={"code": code}, headers={"host": name})
    assert again.status_code == 401  # one time only


def test_dashboard_starts_the_node_process_which_then_serves_tcp_and_stays(
    tmp_path: Path,
) -> None:
    home = _home(tmp_path)
    port = _free_tcp_port()
    base = f"http://127.0.0.1:{port}"
    assert status(home)["running"] is False
    # An idle limit of 1 s: a node process that did not stay would be gone at once.
    result = cli(home, "dashboard", GPUMESH_API_ADDR=f"127.0.0.1:{port}", GPUMESH_NODE_IDLE="1")
    assert result.returncode == 0, result.stderr
    url = result.stdout.strip()
    _signs_in_once(url, base)
    node = status(home)["node"]
    pid = node["pid"]
    assert node["detached"] and node["idle_exit"] is None
    assert node["api"] == [str(home / "control.sock"), base]
    # What is left running, and how to stop it, is said.
    assert result.stderr.strip().splitlines()[-1] == (
        f"The node process (pid {pid}) serves the dashboard on 127.0.0.1:{port} until "
        "`gpumesh daemon stop`."
    )
    text = cli(home, "daemon", "status").stdout
    assert f"api       {base}" in text and "idle exit never" in text
    # Well past the idle limit (a generous margin, not a timing verdict): still there.
    time.sleep(3)
    assert alive(pid) and httpx.get(f"{base}/api/v1/openapi.json").status_code == 200

    # A second run asks the same process; it mints a new code.
    second = cli(home, "dashboard", GPUMESH_API_ADDR=f"127.0.0.1:{port}")
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() != url and second.stdout.startswith(url.split("#")[0])
    assert status(home)["node"]["pid"] == pid

    assert cli(home, "daemon", "stop").returncode == 0
    assert wait_gone(pid)
    assert status(home)["running"] is False
    try:
        httpx.get(f"{base}/api/v1/openapi.json", timeout=5)
    except httpx.TransportError:
        pass
    else:
        raise AssertionError("the stopped node process still serves TCP")


def test_a_running_node_process_is_asked_to_serve_tcp(tmp_path: Path) -> None:
    home = _home(tmp_path)
    assert cli(home, "jobs").returncode == 0  # a background node process, unix socket only
    node = status(home)["node"]
    assert node["api"] == [str(home / "control.sock")] and node["idle_exit"] is not None
    port = _free_tcp_port()
    result = cli(home, "dashboard", GPUMESH_API_ADDR=f"127.0.0.1:{port}")
    assert result.returncode == 0, result.stderr
    after = status(home)["node"]
    assert after["pid"] == node["pid"] and after["idle_exit"] is None
    assert after["api"][1] == f"http://127.0.0.1:{port}"
    _signs_in_once(result.stdout.strip(), f"http://127.0.0.1:{port}")


def test_a_taken_port_is_named_in_one_line(tmp_path: Path) -> None:
    home = _home(tmp_path)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        result = cli(home, "dashboard", GPUMESH_API_ADDR=f"127.0.0.1:{port}")
    finally:
        taken.close()
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"127.0.0.1:{port} is taken" in result.stderr
    assert "GPUMESH_API_ADDR" in result.stderr
    # The node process itself is fine, and still not on TCP.
    assert status(home)["node"]["api"] == [str(home / "control.sock")]


def test_a_non_loopback_address_is_refused_in_one_line(tmp_path: Path) -> None:
    home = _home(tmp_path)
    result = cli(home, "dashboard", GPUMESH_API_ADDR="0.0.0.0:0")
    assert result.returncode != 0 and result.stderr.count("\n") == 1
    assert "not a loopback address" in result.stderr and "--allow-remote" in result.stderr


def test_dashboard_with_gpumesh_control_running(tmp_path: Path) -> None:
    home = _home(tmp_path)
    api = start_control(home)
    try:
        result = cli(home, "dashboard")
        assert result.returncode == 0, result.stderr
        _signs_in_once(result.stdout.strip(), api.url)
    finally:
        api.stop()


def test_gpumesh_node_off_is_said_to_be_gone_and_changes_nothing(tmp_path: Path) -> None:
    home = _home(tmp_path)
    api = start_control(home)  # a node process that serves the dashboard already
    try:
        served = cli(home, "dashboard", GPUMESH_NODE="off")
        assert served.returncode == 0, served.stderr
        assert served.stdout.startswith(f"{api.dashboard}/#code=")
        first, *_rest = served.stderr.splitlines()
        assert first == (
            "gpumesh: GPUMESH_NODE=off is gone and changes nothing: every command goes "
            "through the node process (in Python, gpumesh.Mesh(in_process=True) runs the "
            "client layer in your own process)"
        )
        assert served.stderr.count("GPUMESH_NODE") == 1
    finally:
        api.stop()


STAND_IN = """#!{python}
# A stand-in browser: what it was handed, and what another local user watching
# /proc sees of it while it runs.
import json, os, subprocess, sys
seen = subprocess.run({watch} + ["cat", "/proc/%d/cmdline" % os.getpid()],
                      capture_output=True, check=False).stdout.decode(errors="replace")
with open({record!r}, "w") as out:
    json.dump({{"argv": sys.argv, "env": dict(os.environ), "seen": seen}}, out)
"""


def _stand_in(tmp_path: Path, other_user: OtherUser) -> tuple[Path, Path]:
    """A stand-in browser program and the file it records its run in."""
    record = tmp_path / "browser-run.json"
    program = tmp_path / "stand-in-browser"
    watch = other_user.argv()
    program.write_text(STAND_IN.format(python=sys.executable, watch=watch, record=str(record)))
    program.chmod(0o755)
    return program, record


def test_open_hands_the_browser_an_owner_only_file_and_no_code_in_its_argv(
    tmp_path: Path, other_user: OtherUser
) -> None:
    home = _home(tmp_path)
    port = _free_tcp_port()
    base = f"http://127.0.0.1:{port}"
    program, record = _stand_in(tmp_path, other_user)
    # A link planted at the page's name is replaced, never written through.
    planted = tmp_path / "planted"
    planted.write_text("untouched")
    (home / "dashboard-login.html").symlink_to(planted)
    # The owner's own token in the environment: the browser must not inherit it.
    token = secrets.token_urlsafe(32)
    result = cli(
        home,
        "dashboard",
        "--open",
        GPUMESH_API_ADDR=f"127.0.0.1:{port}",
        BROWSER=str(program),
        GPUMESH_API_TOKEN=token,
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout.strip()
    code = printed.split("#code=", 1)[1]
    run = json.loads(record.read_text())
    # What another local user read in /proc while the browser ran: no code, no token.
    assert str(program) in run["seen"]  # the watch itself worked
    for text in (run["seen"], *run["argv"], *run["env"].values()):
        assert code not in text and "#code=" not in text and token not in text, text
    assert "localhost" not in " ".join(run["argv"])  # nor the dashboard's secret name
    # It was handed a page in the home that only the owner may read, and that page
    # signs in once.
    page = home / "dashboard-login.html"
    assert run["argv"][1:] == [page.as_uri()]
    info = page.lstat()
    assert stat.S_ISREG(info.st_mode) and info.st_mode & 0o777 == 0o600
    assert info.st_uid == os.getuid() and planted.read_text() == "untouched"
    assert other_user.run("cat", str(page)).returncode != 0
    assert f'content="0;url={printed}"' in page.read_text()
    _signs_in_once(printed, base)


def test_open_with_a_snap_browser_prints_the_url_and_says_why(
    tmp_path: Path, other_user: OtherUser
) -> None:
    home = _home(tmp_path)
    port = _free_tcp_port()
    program, record = _stand_in(tmp_path, other_user)
    # Ubuntu's /usr/bin/firefox is such a wrapper of the snap.
    wrapper = tmp_path / "firefox"
    wrapper.write_text(
        f'#!/bin/sh\n[ -x /snap/bin/firefox ] && exec /snap/bin/firefox "$@"\nexec {program} "$@"\n'
    )
    wrapper.chmod(0o755)
    result = cli(
        home, "dashboard", "--open", GPUMESH_API_ADDR=f"127.0.0.1:{port}", BROWSER=str(wrapper)
    )
    assert result.returncode == 0, result.stderr
    assert "#code=" in result.stdout and result.stderr.count("\n") == 2  # and what serves it
    assert "snap package and cannot read" in result.stderr and str(home) in result.stderr
    assert not record.exists() and not (home / "dashboard-login.html").exists()
    _signs_in_once(result.stdout.strip(), f"http://127.0.0.1:{port}")


def test_open_through_xdg_open_to_a_snap_default_browser_prints_the_url_and_says_why(
    tmp_path: Path, other_user: OtherUser
) -> None:
    home = _home(tmp_path)
    port = _free_tcp_port()
    program, record = _stand_in(tmp_path, other_user)
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "xdg-open").symlink_to(program)
    (tools / "xdg-settings").write_text("#!/bin/sh\necho firefox_firefox.desktop\n")
    (tools / "xdg-settings").chmod(0o755)
    result = cli(
        home,
        "dashboard",
        "--open",
        GPUMESH_API_ADDR=f"127.0.0.1:{port}",
        BROWSER="xdg-open",
        PATH=f"{tools}:{os.environ['PATH']}",
    )
    assert result.returncode == 0, result.stderr
    assert "#code=" in result.stdout and result.stderr.count("\n") == 2  # and what serves it
    assert "firefox_firefox.desktop is a snap package" in result.stderr
    assert not record.exists() and not (home / "dashboard-login.html").exists()
