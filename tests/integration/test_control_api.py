"""The control API for real: `gpumesh-control` processes serving real uvicorn over
a real unix socket and real loopback TCP, in front of real agents (alice shares
as a `gpumesh share` process, bob is paired with her both ways) and dockerd.

One mesh serves the whole module; a test that changes access puts it back.
Every response any test reads is recorded, and the last test checks that none
of them holds the identity key or an API token.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import gpumesh, shared_pair, until

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

CONTROL = str(Path(sys.executable).parent / "gpumesh-control")
RECORDED: list[bytes] = []
"""Every response's headers and body, from every test of the module."""


def test_a_bridge_without_an_absolute_place_to_listen_is_refused_in_one_line(mesh: Mesh) -> None:
    for body, said in (
        ({"peer": "alice-pc"}, "a bridge needs bind: HOST:PORT on loopback, or unix:PATH"),
        ({"peer": "alice-pc", "bind": "unix:rel.sock"}, "bind unix:PATH needs an absolute path"),
    ):
        refused = mesh.api.call("POST", "/api/v1/cuda/bridge", json=body)
        assert refused.status_code == 400 and refused.json()["message"] == said
    assert not (mesh.tmp / "rel.sock").exists()
    unknown = mesh.api.call("POST", "/api/v1/desktop/connect", json={"peer": "x", "port": 1})
    assert unknown.status_code == 422 and "port" in unknown.json()["message"]


def _free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _record(response: httpx.Response) -> httpx.Response:
    RECORDED.append(repr(response.headers.raw).encode() + response.content)
    return response


@dataclass
class Api:
    """One running `gpumesh-control` and clients of both its sockets."""

    home: Path
    proc: subprocess.Popen[str]
    url: str
    login: str
    """The one-time login URL it printed."""
    unix: httpx.Client
    tcp_client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.tcp_client = httpx.Client(base_url=self.url, timeout=60)

    @property
    def token(self) -> str:
        return (self.home / "api.token").read_text().strip()

    @property
    def dashboard(self) -> str:
        """``http://<name>.localhost:PORT``: where its login URLs send a browser (the
        home's secret name, where alone a session cookie counts)."""
        return self.login.split("/#code=", 1)[0]

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """A request on the unix socket (the owner's: no credential)."""
        return _record(self.unix.request(method, path, **kwargs))

    def tcp(self, method: str, path: str, *, bearer: bool = True, **kwargs: Any) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if bearer:
            headers["authorization"] = f"Bearer {self.token}"
        response = self.tcp_client.request(method, path, headers=headers, **kwargs)
        self.tcp_client.cookies.clear()  # each request carries only the credential it names
        return _record(response)

    def ok(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.call(method, path, **kwargs)
        assert response.status_code == 200, (response.status_code, response.text)
        return response.json()

    def events(self, job_id: str, *, limit: int | None = None, **kwargs: Any) -> list[Event]:
        """A job's event stream, read until it ends (or ``limit`` output events)."""
        got: list[Event] = []
        raw = b""
        with self.unix.stream("GET", f"/api/v1/jobs/{job_id}/events", **kwargs) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                raw += line.encode() + b"\n"
                if not line.startswith(("event:", "id:", "data:")):
                    continue  # the blank line between events, a keep-alive comment
                key, _, value = line.partition(": ")
                if key == "event":
                    got.append(Event(value))
                elif key == "id":
                    got[-1].id = int(value)
                else:
                    got[-1].data = json.loads(value)
                    if got[-1].name in ("end", "error"):
                        break
                    outputs = [e for e in got if e.name == "output"]
                    if limit is not None and len(outputs) >= limit:
                        break
        RECORDED.append(raw)
        return got

    def stop(self, sig: int = signal.SIGTERM) -> str:
        self.unix.close()
        self.tcp_client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, (self.proc.returncode, out, err)
        assert "Traceback" not in err, err
        return out


@dataclass
class Event:
    name: str
    id: int | None = None
    data: Any = None


def started_lines(proc: subprocess.Popen[str]) -> list[str]:
    """What a starting ``gpumesh-control`` printed, up to its OpenAPI line."""
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "OpenAPI" in line:
            return lines
    raise AssertionError(f"gpumesh-control did not start: {lines} {proc.communicate()}")


def start_control(home: Path, *args: str, tcp: bool = True) -> Api:
    port = _free_tcp_port()
    env = dict(os.environ, GPUMESH_HOME=str(home), GPUMESH_API_ADDR=f"127.0.0.1:{port}")
    env.pop("GPUMESH_API_TOKEN", None)
    env.pop("GPUMESH_LOG", None)
    proc = subprocess.Popen(
        [CONTROL, *args, *([] if tcp else ["--no-tcp"])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = started_lines(proc)
    login = next((w for line in lines for w in line.split() if "#code=" in w), "")
    unix = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(home / "control.sock")),
        base_url="http://gpumesh",
        timeout=60,
    )
    return Api(home, proc, f"http://127.0.0.1:{port}", login, unix)


@dataclass
class Mesh:
    alice: Path
    bob: Path
    api: Api
    """bob's control API (bob submits to alice)."""
    owner: Api
    """alice's control API (alice shares)."""
    tmp: Path


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("control")
    with shared_pair(tmp) as (alice, bob):
        api = start_control(bob)
        owner = start_control(alice)
        try:
            # It took alice's share over from her background node process: stopped
            # there, started again here, not at once.
            sharing = {"offline": "1"}
            until(
                lambda: owner.ok("GET", "/api/v1/status", params=sharing)["sharing"],
                "alice's share to start again in her control server",
            )
            yield Mesh(alice, bob, api, owner, tmp)
        finally:
            for each in (api, owner):
                out = each.stop()
                assert "stopped" in out
                assert not (each.home / "control.sock").exists()


def _lines(events: list[Event]) -> list[str]:
    text = "".join(e.data["text"] for e in events if e.name == "output")
    return text.splitlines()


def _job(api: Api, command: str, **extra: Any) -> dict[str, Any]:
    body = {"peer": "alice-pc", "command": ["sh", "-c", command], **extra}
    result: dict[str, Any] = api.ok("POST", "/api/v1/jobs", json=body)
    return result


# --- the document ---------------------------------------------------------------------------


def test_openapi_document_lists_exactly_the_routes_served(mesh: Mesh) -> None:
    from gpumesh.client.node import Node
    from gpumesh.control.app import create_app
    from gpumesh.control.call import ControlState

    doc = mesh.api.ok("GET", "/api/v1/openapi.json")
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    node = Node(mesh.bob)
    try:
        app = create_app(ControlState(node=node, token="x"))
        served = {
            (method, route.path)  # type: ignore[attr-defined]
            for route in app.routes
            for method in route.methods - {"HEAD"}  # type: ignore[attr-defined]
        }
    finally:
        node.close()
    assert documented == served
    assert ("GET", "/api/v1/jobs/{job_id}/events") in documented
    # Every schema a route names is in the document.
    text = json.dumps(doc)
    for name in ("StatusView", "PeerView", "JobResultView", "OwnerStatusView", "CopyView"):
        assert f"#/components/schemas/{name}" in text
        assert name in doc["components"]["schemas"]
    # Over TCP the document is public (it holds nothing of this node), the rest is not.
    assert mesh.api.tcp("GET", "/api/v1/openapi.json", bearer=False).status_code == 200


# --- node status and GPUs -------------------------------------------------------------------


def test_status_and_gpus_are_the_clis_json(mesh: Mesh) -> None:
    status = mesh.api.ok("GET", "/api/v1/status", params={"offline": "true"})
    cli = json.loads(gpumesh(mesh.bob, "status", "--json", "--offline").stdout)
    assert list(status) == list(cli)
    assert status["node_id"] == cli["node_id"] and status["name"] == "bob-laptop"
    assert status["sharing"] is False
    gpus = mesh.api.ok("GET", "/api/v1/gpus")
    assert gpus == json.loads(gpumesh(mesh.bob, "gpu", "--json").stdout)
    owner_status = mesh.owner.ok("GET", "/api/v1/status", params={"offline": "1"})
    assert owner_status["sharing"] is True and owner_status["agent_pid"]


# --- peers ----------------------------------------------------------------------------------


def test_peers_pair_code_qr_allow_deny_connect(mesh: Mesh) -> None:
    import segno

    from gpumesh.identity.codes import verify_code

    peers = mesh.api.ok("GET", "/api/v1/peers")
    assert peers == json.loads(gpumesh(mesh.bob, "peers", "--json").stdout)
    assert [p["name"] for p in peers] == ["alice-pc"]

    code = mesh.api.ok("GET", "/api/v1/pairing-code")
    offer = verify_code(code["code"])
    assert code["name"] == offer.name == "bob-laptop"
    assert (
        code["node_id"]
        == str(offer.node_id)
        == json.loads(gpumesh(mesh.bob, "status", "--json", "--offline").stdout)["node_id"]
    )
    qr = mesh.api.call("GET", "/api/v1/pairing-code/qr.svg", params={"code": code["code"]})
    assert qr.status_code == 200 and qr.headers["content-type"] == "image/svg+xml"
    expected = segno.make(code["code"], error="m", micro=False).svg_inline(
        scale=1, border=4, omitsize=True
    )
    # The same modules as segno draws for the code itself (the drawing's path).
    assert re.findall(r' d="([^"]+)"', qr.text) == re.findall(r' d="([^"]+)"', expected)
    fresh = mesh.api.call("GET", "/api/v1/pairing-code/qr.svg")
    assert fresh.status_code == 200 and fresh.text.startswith("<svg")
    # Only this node's own codes are drawn.
    alices = gpumesh(mesh.alice, "pair-code").stdout.strip()
    foreign = mesh.api.call("GET", "/api/v1/pairing-code/qr.svg", params={"code": alices})
    assert foreign.status_code == 400 and foreign.json()["code"] == "bad_request"

    carol = mesh.tmp / "carol"
    assert gpumesh(carol, "init", "--name", "carol").returncode == 0
    carols = gpumesh(carol, "pair-code").stdout.strip()
    paired = mesh.api.ok("POST", "/api/v1/peers/pair", json={"code": carols, "offline": True})
    assert paired["name"] == "carol" and paired["allowed"] is True
    assert paired["paired_back"] is None
    again = mesh.api.call("POST", "/api/v1/peers/pair", json={"code": carols, "offline": True})
    assert again.status_code == 400 and again.json()["code"] == "bad_code"
    bad = mesh.api.call("POST", "/api/v1/peers/pair", json={"code": "gpm1_nope"})
    assert bad.status_code == 400 and bad.json()["code"] == "bad_code"

    denied = mesh.api.ok("POST", "/api/v1/peers/carol/deny")
    assert denied["name"] == "carol" and denied["allowed"] is False
    listed = {p["name"]: p["allowed"] for p in mesh.api.ok("GET", "/api/v1/peers")}
    assert listed == {"alice-pc": True, "carol": False}
    assert mesh.api.ok("POST", "/api/v1/peers/carol/allow")["allowed"] is True
    unknown = mesh.api.call("POST", "/api/v1/peers/nobody/deny")
    assert unknown.status_code == 404 and unknown.json()["code"] == "unknown_peer"

    connected = mesh.api.ok("POST", "/api/v1/peers/alice-pc/connect", params={"pings": 2})
    assert connected["peer"] == "alice-pc" and connected["reachable"] is True
    assert connected["path"] == "direct" and connected["sharing"] is True
    # carol does not run: a refusal with the transport's code, not a 500.
    gone = mesh.api.call("POST", "/api/v1/peers/carol/connect")
    assert gone.status_code == 502 and gone.json()["code"] in ("unreachable", "transport")


# --- jobs -----------------------------------------------------------------------------------


def test_submit_list_and_read_a_jobs_events(mesh: Mesh) -> None:
    submitted = _job(mesh.api, "for i in $(seq 1 40); do echo line $i; done; echo oops >&2")
    job_id = submitted["job_id"]
    assert submitted["peer"] == "alice-pc" and submitted["role"] == "submitted"

    events = mesh.api.events(job_id)
    assert events[-1].name == "end"
    assert events[-1].data["state"] == "succeeded" and events[-1].data["exit_code"] == 0
    outputs = [e for e in events if e.name == "output"]
    stdout = "".join(e.data["text"] for e in outputs if e.data["stream"] == "stdout")
    assert stdout.splitlines() == [f"line {i}" for i in range(1, 41)]
    assert any(e.data["stream"] == "stderr" and "oops" in e.data["text"] for e in outputs)
    assert all(base64.b64decode(e.data["data"]).decode() == e.data["text"] for e in outputs)
    numbered = [e.id for e in events if e.id is not None]
    assert numbered == sorted(numbered) and len(set(numbered)) == len(numbered)
    assert {e.name for e in events} >= {"status", "output", "end"}

    # Resuming after any event gives exactly what followed it: by Last-Event-ID and by after.
    middle = outputs[len(outputs) // 2]
    assert middle.id is not None
    before = [e for e in events if e.id is not None and e.id <= middle.id]
    resumed = mesh.api.events(job_id, headers={"last-event-id": str(middle.id)})
    assert _lines(before) + _lines(resumed) == _lines(events)
    by_param = mesh.api.events(job_id, params={"after": str(middle.id)})
    assert _lines(by_param) == _lines(resumed)

    listed = mesh.api.ok("GET", "/api/v1/jobs", params={"offline": "true"})
    assert listed[0]["job_id"] == job_id and listed[0]["state"] == "succeeded"
    assert list(listed[0]) == list(
        json.loads(gpumesh(mesh.bob, "jobs", "--json", "--offline").stdout)[0]
    )
    one = mesh.api.ok("GET", f"/api/v1/jobs/{job_id[:6]}")
    assert one["job_id"] == job_id and one["exit_code"] == 0
    missing = mesh.api.call("GET", "/api/v1/jobs/ffffffffffff/events")
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"


def test_a_live_follow_cut_off_and_resumed_loses_and_repeats_nothing(mesh: Mesh) -> None:
    job_id = _job(mesh.api, "for i in $(seq 1 30); do echo line $i; sleep 0.05; done")["job_id"]
    first = mesh.api.events(job_id, limit=3)  # the client leaves mid-job
    assert first[-1].name == "output"
    last = max(e.id for e in first if e.id is not None)
    rest = mesh.api.events(job_id, headers={"last-event-id": str(last)})
    assert rest[-1].name == "end" and rest[-1].data["state"] == "succeeded"
    assert _lines(first) + _lines(rest) == [f"line {i}" for i in range(1, 31)]
    # The hosted side's events, read on alice's own API, are the same lines.
    hosted = mesh.owner.events(job_id)
    assert _lines(hosted) == [f"line {i}" for i in range(1, 31)]


def test_cancel_a_running_job(mesh: Mesh) -> None:
    job_id = _job(mesh.api, "echo started; sleep 60")["job_id"]
    assert _lines(mesh.api.events(job_id, limit=1)) == ["started"]
    cancelled = mesh.api.ok("POST", f"/api/v1/jobs/{job_id}/cancel", json={})
    assert cancelled["job_id"] == job_id
    assert cancelled["state"] == "cancelled" and cancelled["final"] is True
    end = mesh.api.events(job_id)[-1]
    assert end.name == "end" and end.data["state"] == "cancelled"
    bad = mesh.api.call("POST", "/api/v1/jobs", json={"command": ["true"]})
    assert bad.status_code == 400 and bad.json()["code"] == "bad_request"
    assert bad.json()["message"] == (
        "The job names no place to run: give `peer` (a paired node) or `group`."
    )
    typo = mesh.api.call("POST", "/api/v1/jobs", json={"peer": "alice-pc", "comand": ["x"]})
    assert typo.status_code == 422 and "comand" in typo.json()["message"]


def test_prune_lists_what_it_would_remove_and_refuses_a_negative_age(mesh: Mesh) -> None:
    job_id = _job(mesh.api, "true")["job_id"]
    assert mesh.api.events(job_id)[-1].name == "end"
    dry = mesh.api.ok("POST", "/api/v1/jobs/prune", json={"older_than": 0, "dry_run": True})
    assert {"job_id": job_id, "role": "submitted", "state": "succeeded"} in dry
    assert job_id in [j["job_id"] for j in mesh.api.ok("GET", "/api/v1/jobs?offline=true")]
    bad = mesh.api.call("POST", "/api/v1/jobs/prune", json={"older_than": -1})
    assert bad.status_code == 422 and "older_than" in bad.json()["message"]


def test_the_routes_that_change_jobs_groups_and_peers_refuse_a_caller_without_a_token(
    mesh: Mesh,
) -> None:
    def jobs() -> list[str]:
        return [j["job_id"] for j in mesh.api.ok("GET", "/api/v1/jobs?offline=true&limit=1000")]

    def groups() -> list[str]:
        return [g["name"] for g in mesh.api.ok("GET", "/api/v1/groups")]

    before = (jobs(), groups())
    free, bridge = _free_tcp_port(), mesh.tmp / "bridge.sock"
    for path, body in (
        ("/api/v1/jobs/prune", {"older_than": 0}),
        ("/api/v1/groups", {"name": "stolen"}),
        ("/api/v1/groups/join", {"code": "gpg1_x"}),
        ("/api/v1/peers/sync", {"dial": False}),
        ("/api/v1/registry/search", {}),
        ("/api/v1/desktop/connect", {"peer": "alice-pc", "bind": f"127.0.0.1:{free}"}),
        ("/api/v1/cuda/bridge", {"peer": "alice-pc", "bind": f"unix:{bridge}"}),
        ("/api/v1/cuda/demo", {"peer": "alice-pc"}),
        ("/api/v1/cuda/bench", {"peer": "alice-pc"}),
    ):
        refused = mesh.api.tcp("POST", path, bearer=False, json=body)
        assert refused.status_code == 401 and refused.json()["code"] == "denied", path
    assert (jobs(), groups()) == before  # nothing pruned, nothing created
    _nothing_listens(free, bridge)  # no tunnel, no bridge


def _free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _nothing_listens(port: int, path: Path) -> None:
    """Nothing listens on loopback ``port`` and no socket file is at ``path``."""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert not path.exists()


def test_search_without_a_registry_says_how_to_set_one_and_refuses_a_bad_limit(
    mesh: Mesh,
) -> None:
    none = mesh.api.call("POST", "/api/v1/registry/search", json={"gpu": "4090"})
    assert none.status_code == 400, none.text
    assert "gpumesh config set rendezvous_url" in none.json()["message"]
    bad = mesh.api.call("POST", "/api/v1/registry/search", json={"limit": 1000})
    assert bad.status_code == 422 and "limit" in bad.json()["message"]
    synced = mesh.api.ok("POST", "/api/v1/peers/sync", json={"dial": False})
    assert synced["registry"] == "" and synced["republished_by"] is None
    assert "alice-pc" in [p["name"] for p in synced["peers"]]


# --- groups ---------------------------------------------------------------------------------


def test_groups_members_live_and_a_job_placed_in_a_group(mesh: Mesh) -> None:
    assert gpumesh(mesh.bob, "group", "create", "lab").returncode == 0
    assert gpumesh(mesh.bob, "group", "add", "lab", "alice-pc").returncode == 0
    groups = mesh.api.ok("GET", "/api/v1/groups")
    assert groups == json.loads(gpumesh(mesh.bob, "group", "list", "--json").stdout)
    assert [(g["name"], g["member_count"]) for g in groups] == [("lab", 2)]
    members = {m["name"]: m for m in mesh.api.ok("GET", "/api/v1/groups/lab/members")}
    assert members["alice-pc"]["reachable"] is True and members["alice-pc"]["state"] == "idle"
    offline = mesh.api.ok("GET", "/api/v1/groups/lab/members", params={"offline": "true"})
    assert all(m["reachable"] is None for m in offline)

    placed = mesh.api.ok("POST", "/api/v1/jobs", json={"group": "lab", "command": ["echo", "hi"]})
    assert placed["peer"] == "alice-pc"
    assert _lines(mesh.api.events(placed["job_id"])) == ["hi"]
    nogroup = mesh.api.call("GET", "/api/v1/groups/nope/members")
    assert nogroup.status_code == 404 and nogroup.json()["code"] == "not_found"


# --- copies and apps ------------------------------------------------------------------------


def test_copies_and_app_sync_on_the_unix_socket_and_with_a_token(mesh: Mesh) -> None:
    source = mesh.tmp / "data.bin"
    source.write_bytes(os.urandom(300_000))
    up = mesh.api.ok(
        "POST", "/api/v1/copies", json={"source": str(source), "destination": "alice-pc:/in/"}
    )
    assert up["direction"] == "upload" and up["size"] == 300_000
    back = mesh.tmp / "back.bin"
    down = mesh.api.tcp(
        "POST",
        "/api/v1/copies",
        json={"source": "alice-pc:/in/data.bin", "destination": str(back)},
    )
    assert down.status_code == 200, down.text
    assert down.json()["direction"] == "download" and back.read_bytes() == source.read_bytes()
    both = mesh.api.call("POST", "/api/v1/copies", json={"source": "a:/x", "destination": "b:/y"})
    assert both.status_code == 400 and both.json()["code"] == "config"

    app = mesh.tmp / "proj"
    app.mkdir()
    (app / "train.py").write_text("print('hi')\n")
    synced = mesh.api.ok("POST", "/api/v1/apps/sync", json={"peer": "alice-pc", "dir": str(app)})
    assert synced["remote"] == "/apps/proj" and synced["sent"] == ["train.py"]
    again = mesh.api.ok("POST", "/api/v1/apps/sync", json={"peer": "alice-pc", "dir": str(app)})
    assert again["files_sent"] == 0 and again["files_unchanged"] == 1


# --- the owner's view, and the owner's deny while `gpumesh share` runs ----------------------


def test_owner_view_and_deny_reach_the_running_agent(mesh: Mesh) -> None:
    job_id = _job(mesh.api, "echo for-the-owner")["job_id"]
    assert _lines(mesh.api.events(job_id)) == ["for-the-owner"]
    owner = mesh.owner.ok("GET", "/api/v1/owner")
    assert owner["sharing"] is True and owner["agent_pid"]
    hosted = {j["job_id"]: j for j in owner["hosted"]}
    assert hosted[job_id]["role"] == "hosted" and hosted[job_id]["peer"] == "bob-laptop"
    assert owner["running"] == sum(j["finished_at"] is None for j in owner["hosted"])

    denied = mesh.owner.tcp("POST", "/api/v1/peers/bob-laptop/deny")
    assert denied.status_code == 200 and denied.json()["allowed"] is False
    try:
        refused = mesh.api.call(
            "POST", "/api/v1/jobs", json={"peer": "alice-pc", "command": ["true"]}
        )
        assert refused.status_code == 403 and refused.json()["code"] == "denied", refused.json()
    finally:
        assert mesh.owner.ok("POST", "/api/v1/peers/bob-laptop/allow")["allowed"] is True
    assert _lines(mesh.api.events(_job(mesh.api, "echo back")["job_id"])) == ["back"]


# --- who may call what over TCP -------------------------------------------------------------


def test_tcp_needs_a_token_and_a_loopback_host(mesh: Mesh) -> None:
    api = mesh.api
    none = api.tcp("GET", "/api/v1/peers", bearer=False)
    assert none.status_code == 401 and none.json()["code"] == "denied"
    wrong = api.tcp("GET", "/api/v1/peers", bearer=False, headers={"authorization": "Bearer x"})
    assert wrong.status_code == 401
    assert api.tcp("GET", "/api/v1/peers").status_code == 200
    port = api.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io"):
        rebound = api.tcp("GET", "/api/v1/peers", headers={"host": host})
        assert rebound.status_code == 403 and rebound.json()["code"] == "denied", host
    assert api.tcp("GET", "/api/v1/peers", headers={"host": f"localhost:{port}"}).is_success
    # A state change from another site's page is refused even with the token.
    foreign = api.tcp(
        "POST", "/api/v1/peers/alice-pc/allow", headers={"origin": "http://evil.example"}
    )
    assert foreign.status_code == 403 and foreign.json()["code"] == "denied"
    own = api.tcp("POST", "/api/v1/peers/alice-pc/allow", headers={"origin": api.url})
    assert own.status_code == 200


def test_browser_login_cookie_csrf_and_local_paths(mesh: Mesh) -> None:
    api = mesh.api
    page = api.tcp("GET", "/", bearer=False)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert 'id="login"' in page.text and "Node id" not in page.text  # no data without a session

    code = api.login.split("#code=", 1)[1]
    name = api.dashboard.split("://", 1)[1]
    assert name.endswith(f".localhost:{api.url.rsplit(':', 1)[1]}")
    assert name.split(".")[0] not in api.token  # derived from it, never part of it
    # At 127.0.0.1 a cookie would reach every port of it: the code is not traded there.
    loopback = api.tcp("POST", "/api/v1/auth/session", bearer=False, json={"code": code})
    assert loopback.status_code == 403 and "gpumesh dashboard" in loopback.json()["message"]
    at_name = {"host": name}
    cross = api.tcp(
        "POST",
        "/api/v1/auth/session",
        bearer=False,
        json={"code": code},
        headers={"origin": "http://evil.example", **at_name},
    )
    assert cross.status_code == 403  # and the code is not spent by it
    exchanged = api.tcp(
        "POST", "/api/v1/auth/session", bearer=False, json={"code": code}, headers=at_name
    )
    assert exchanged.status_code == 204 and exchanged.content == b""
    cookie = exchanged.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    session = exchanged.cookies["gpumesh_session"]
    reused = api.tcp(
        "POST", "/api/v1/auth/session", bearer=False, json={"code": code}, headers=at_name
    )
    assert reused.status_code == 401 and reused.json()["code"] == "denied"

    free, bridge = _free_tcp_port(), mesh.tmp / "bridge.sock"

    def browser(method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"cookie": f"gpumesh_session={session}", **at_name, **kwargs.pop("headers", {})}
        return api.tcp(method, path, bearer=False, headers=headers, **kwargs)

    assert browser("GET", "/api/v1/status", params={"offline": "1"}).status_code == 200
    # The cookie alone, at any other name of loopback (another user's catch), is nothing.
    for host in ("127.0.0.1", "localhost", f"127.0.0.1:{api.url.rsplit(':', 1)[1]}"):
        replayed = browser("GET", "/api/v1/status", headers={"host": host})
        assert replayed.status_code == 401, host
    no_csrf = browser("POST", "/api/v1/peers/alice-pc/allow")
    assert no_csrf.status_code == 403 and "x-gpumesh-csrf" in no_csrf.json()["message"]
    csrf = {"x-gpumesh-csrf": "1"}
    assert browser("POST", "/api/v1/peers/alice-pc/allow", headers=csrf).status_code == 200
    # Routes that name local paths are never a browser's.
    for path, body in (
        ("/api/v1/copies", {"source": "/etc/passwd", "destination": "alice-pc:/x"}),
        ("/api/v1/apps/sync", {"peer": "alice-pc", "dir": "/etc"}),
        ("/api/v1/apps/run", {"peer": "alice-pc", "dir": "/etc", "command": ["true"]}),
        ("/api/v1/apps/pull", {"peer": "alice-pc", "job": "x", "dir": "/tmp/x"}),
        ("/api/v1/shells", {"peer": "alice-pc"}),
        ("/api/v1/auth/login-codes", None),
        # Nor are the routes that open a listener on this machine.
        ("/api/v1/desktop/connect", {"peer": "alice-pc", "bind": f"127.0.0.1:{free}"}),
        ("/api/v1/cuda/bridge", {"peer": "alice-pc", "bind": f"unix:{bridge}"}),
    ):
        refused = browser("POST", path, json=body, headers=csrf)
        assert refused.status_code == 403 and refused.json()["code"] == "denied", path
    _nothing_listens(free, bridge)
    workdir = browser(
        "POST",
        "/api/v1/jobs",
        json={"peer": "alice-pc", "command": ["true"], "workdir": "/etc"},
        headers=csrf,
    )
    assert workdir.status_code == 403
    # A new login URL comes from the owner's socket; logging out ends the session.
    fresh = api.ok("POST", "/api/v1/auth/login-codes")
    assert fresh["url"].startswith(f"{api.dashboard}/#code=")
    assert browser("DELETE", "/api/v1/auth/session", headers=csrf).status_code == 204
    assert browser("GET", "/api/v1/peers").status_code == 401


def test_no_response_holds_the_key_or_a_token(mesh: Mesh) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    for api in (mesh.api, mesh.owner):
        for path in ("/api/v1/status", "/api/v1/peers", "/api/v1/pairing-code", "/api/v1/owner"):
            api.ok("GET", path)
            assert api.tcp("GET", path).status_code == 200
    secrets: list[bytes] = []
    for api in (mesh.api, mesh.owner):
        secrets.append(api.token.encode())
        pem = (api.home / "identity.key").read_bytes()
        key = serialization.load_pem_private_key(pem, password=None)
        assert isinstance(key, Ed25519PrivateKey)
        raw = key.private_bytes_raw()
        body = b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))
        secrets += [
            body,
            raw.hex().encode(),
            base64.b64encode(raw),
            base64.urlsafe_b64encode(raw).rstrip(b"="),
        ]
    assert len(RECORDED) > 20
    for response in RECORDED:
        for secret in secrets:
            assert secret not in response


# --- the process ----------------------------------------------------------------------------


def test_process_stops_cleanly_and_refuses_what_it_must(tmp_path: Path) -> None:
    home = tmp_path / "n"
    assert gpumesh(home, "init", "--name", "solo").returncode == 0
    api = start_control(home, tcp=False)
    mode = (home / "control.sock").stat().st_mode & 0o777
    assert mode == 0o600 and (home.stat().st_mode & 0o777) == 0o700
    assert api.ok("GET", "/api/v1/status", params={"offline": "1"})["name"] == "solo"
    # A second one for the same home is refused in one line; the first keeps serving.
    second = subprocess.run(
        [CONTROL, "--no-tcp"],
        env=dict(os.environ, GPUMESH_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert second.returncode == 7, second
    assert second.stderr.startswith("error: a node process (pid ")
    assert len(second.stderr.strip().splitlines()) == 1
    assert api.ok("GET", "/api/v1/peers") == []
    out = api.stop(signal.SIGINT)
    assert out.rstrip().endswith("gpumesh-control: stopped")
    assert not (home / "control.sock").exists()

    wide = subprocess.run(
        [CONTROL, "--listen", "0.0.0.0:0"],
        env=dict(os.environ, GPUMESH_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert wide.returncode == 2 and "not a loopback address" in wide.stderr
    no_token = subprocess.run(
        [CONTROL, "--listen", "0.0.0.0:0", "--allow-remote"],
        env={k: v for k, v in dict(os.environ, GPUMESH_HOME=str(home)).items()
             if k != "GPUMESH_API_TOKEN"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )  # fmt: skip
    assert no_token.returncode == 2 and "GPUMESH_API_TOKEN" in no_token.stderr
    uninitialised = subprocess.run(
        [CONTROL, "--no-tcp"],
        env=dict(os.environ, GPUMESH_HOME=str(tmp_path / "empty")),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert uninitialised.returncode == 2 and "Traceback" not in uninitialised.stderr
