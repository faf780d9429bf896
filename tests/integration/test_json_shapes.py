"""Every ``--json`` output keeps its shape: keys, nesting and JSON types, not values.

One scenario runs each command that has ``--json`` through the real ``gpumesh``
entry point, against real nodes on loopback: alice shares (a ``gpumesh share``
process, at the end registered with a real ``gpumesh-relay``), bob uses her,
carol is a third home that never shares. Each output becomes a shape (:func:`shape_of`:
ids, times and sizes vary, their types do not) and is compared with the one
recorded in ``fixtures/json_shapes.json``, case by case. Where a key's type
depends on the situation (``paired_back`` offline or not, a job running or
done, a copy over the data channel or QUIC), the scenario runs each situation
as its own case.

A shape change is a change to what scripts, and the HTTP API that returns the
same shapes, read. When one is meant, record the shapes again and commit the
fixture with the change::

    GPUMESH_UPDATE_SHAPES=1 .venv/bin/python -m pytest tests/integration/test_json_shapes.py

The provider's GPUs are part of some shapes (a job's ``gpus``, a member's free
GPU memory), so the scenario needs a machine where no NVIDIA GPU is visible;
the commands that show this machine's GPUs (``gpu``, and ``status`` of a home
that does not share) see simulated ones, in a node process started with them,
so their GPU rows are recorded too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpumesh.client.registry import RegistryClient, SequenceClock, listing_of
from gpumesh.gpu.inventory import ENV_SIMULATED, detect_inventory
from gpumesh.identity.keys import Identity
from gpumesh.protocol.listing import GpuListing
from gpumesh.registry.config import RegistryConfig
from gpumesh.settings import ENV_TEST_JOB_NETWORK
from tests.integration.conftest import remove_containers, until
from tests.integration.node import shares
from tests.integration.public_registry import serve_registry
from tests.integration.test_cli import _free_udp_port
from tests.jobnet_lab import SESSION_PREFIX

pytestmark = pytest.mark.usefixtures("docker_daemon", "gpumesh_processes")

FIXTURE = Path(__file__).parent / "fixtures" / "json_shapes.json"
UPDATE = os.environ.get("GPUMESH_UPDATE_SHAPES", "") not in ("", "0")
IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
SIMULATED_GPUS = {ENV_SIMULATED: "A100:80GB:10GB,RTX-4090:24GB"}
# The console script when installed (what users run), else the same entry point.
_SCRIPT = Path(sys.executable).with_name("gpumesh")
GPUMESH = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "gpumesh"]

# Codes change every run: the recorded command names them instead.
_CODES = {"gpm1_": "PAIR_CODE", "gpg1_": "GROUP_INVITE"}

Shape = str | list["Shape"] | dict[str, "Shape"]


def shape_of(value: object) -> Shape:
    """The shape of a decoded JSON value.

    A scalar is its type: ``null``, ``bool``, ``int``, ``float`` or ``str``. An
    object is its keys, each with its value's shape. A list is the distinct
    shapes of its elements (so ``[]`` for an empty list, and two shapes where
    the elements differ, such as a running and a finished job).
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        distinct = {_text(shape): shape for shape in map(shape_of, value)}
        return [distinct[key] for key in sorted(distinct)]
    if isinstance(value, dict):
        return {str(key): shape_of(item) for key, item in sorted(value.items())}
    raise TypeError(f"not a JSON value: {value!r}")


def differences(path: str, want: Shape, got: Shape) -> list[str]:
    """Each place where ``got`` differs from ``want``, one line each."""
    if isinstance(want, dict) and isinstance(got, dict):
        found = [f"{path}.{key}: gone (was {_text(want[key])})" for key in want if key not in got]
        found += [f"{path}.{key}: new ({_text(got[key])})" for key in got if key not in want]
        for key in want:
            if key in got:
                found += differences(f"{path}.{key}", want[key], got[key])
        return found
    if isinstance(want, list) and isinstance(got, list) and want != got:
        if len(want) == len(got) == 1:
            return differences(f"{path}[]", want[0], got[0])
        if want and got and all(isinstance(s, dict) for s in [*want, *got]):
            # Objects of several shapes (a running and a finished job): key by key,
            # each with the types it has in any of them.
            found = _merged_differences(f"{path}[]", want, got)
            if found:
                return found
        found = [f"{path}[]: no element is {_text(s)} any more" for s in want if s not in got]
        return found + [f"{path}[]: an element is {_text(s)}" for s in got if s not in want]
    if want != got:
        return [f"{path}: was {_text(want)}, now {_text(got)}"]
    return []


def _merged_differences(path: str, want: list[Shape], got: list[Shape]) -> list[str]:
    def merged(shapes: list[Shape]) -> dict[str, str]:
        types: dict[str, set[str]] = {}
        for shape in shapes:
            assert isinstance(shape, dict)
            for key, value in shape.items():
                types.setdefault(key, set()).add(_text(value))
        return {key: " | ".join(sorted(texts)) for key, texts in types.items()}

    before, after = merged(want), merged(got)
    found = [f"{path}.{key}: gone (was {before[key]})" for key in before if key not in after]
    found += [f"{path}.{key}: new ({after[key]})" for key in after if key not in before]
    found += [
        f"{path}.{key}: was {before[key]}, now {after[key]}"
        for key in before
        if key in after and before[key] != after[key]
    ]
    return found


def _text(shape: Shape) -> str:
    return json.dumps(shape, sort_keys=True, separators=(",", ":"))


# --- running the CLI ------------------------------------------------------------------


def _env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    # Only what the scenario sets: a GPUMESH_PEER or GPUMESH_IMAGE of the caller's
    # shell, or its simulated GPUs, would change what the commands print.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    env.update(GPUMESH_HOME=str(home), GPUMESH_TEST_DOCKER_IMAGE=IMAGE)
    # The job networks this test run owns (tests/jobnet_lab.py), not the machine's.
    env.update({ENV_TEST_JOB_NETWORK: os.environ.get(ENV_TEST_JOB_NETWORK, SESSION_PREFIX)})
    env.update(extra or {})
    return env


def _cli(
    home: Path, *args: str, env: dict[str, str] | None = None, ok: tuple[int, ...] = (0,)
) -> subprocess.CompletedProcess[str]:
    simulated = ENV_SIMULATED in (env or {})
    if simulated:  # the node process reads the GPUs: one started with them
        _stop_node(home)
    result = subprocess.run(
        [*GPUMESH, *args],
        env=_env(home, env),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    if simulated:  # and the next commands get one without them again
        _stop_node(home)
    assert result.returncode in ok, (
        f"gpumesh {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    )
    return result


def _stop_node(home: Path) -> None:
    stop = [*GPUMESH, "daemon", "stop"]
    stopped = subprocess.run(stop, env=_env(home), capture_output=True, text=True, check=False)
    assert stopped.returncode == 0, stopped.stderr


def _json(home: Path, *args: str) -> Any:
    return json.loads(_cli(home, *args).stdout)


class Recorder:
    """Runs the ``--json`` commands of the scenario and keeps each output's shape."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cases: dict[str, dict[str, Any]] = {}

    def json(
        self,
        case: str,
        situation: str,
        home: Path,
        *args: str,
        env: dict[str, str] | None = None,
        ok: tuple[int, ...] = (0,),
    ) -> Any:
        assert case not in self.cases, f"case {case} recorded twice"
        result = _cli(home, *args, env=env, ok=ok)
        try:
            data = json.loads(result.stdout)
        except ValueError as exc:
            raise AssertionError(f"{case}: not JSON ({exc}):\n{result.stdout}") from None
        return self.record(case, situation, home, args, data)

    def record(
        self, case: str, situation: str, home: Path, args: tuple[str, ...], data: Any
    ) -> Any:
        """Keep the shape of ``data``, one document a command printed (a command that
        runs on prints several: each is its own case)."""
        assert case not in self.cases, f"case {case} recorded twice"
        shown = [_CODES.get(arg[:5], arg) for arg in args]
        command = " ".join(["gpumesh", *shown]).replace(str(self.root), "$TMP")
        self.cases[case] = {
            "command": command,
            "home": home.name,
            "situation": situation,
            "shape": shape_of(data),
        }
        return data


@contextmanager
def _process(args: list[str], env: dict[str, str], ready: Callable[[], bool]) -> Iterator[None]:
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        until(lambda: ready() or proc.poll() is not None, f"{' '.join(args)} to start", every=0.2)
        assert proc.poll() is None, f"{' '.join(args)} stopped: {proc.communicate()[1]}"
        yield
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def _sharing(home: Path) -> Any:
    return _process([*GPUMESH, "share"], _env(home), lambda: shares(home))


# --- the scenario ---------------------------------------------------------------------


def _scenario(root: Path, rec: Recorder) -> None:
    alice, bob, carol = root / "alice", root / "bob", root / "carol"
    relay = f"127.0.0.1:{_free_udp_port()}"
    relay_log = root / "relay.log"
    with relay_log.open("w") as log:
        relay_proc = subprocess.Popen(
            [sys.executable, "-m", "gpumesh.relay.main", "--open", "--listen", relay],
            stdout=log,
            stderr=log,
        )
    try:
        until(lambda: "listening on" in relay_log.read_text(), "the relay to listen", every=0.2)
        _nodes(root, rec, alice, bob, carol, relay)
    finally:
        relay_proc.send_signal(signal.SIGINT)
        relay_proc.wait(timeout=20)


def _nodes(root: Path, rec: Recorder, alice: Path, bob: Path, carol: Path, relay: str) -> None:
    rec.json("init", "a new home", carol, "init", "--name", "carol-box", "--json")
    _cli(alice, "init", "--name", "alice-pc")
    _cli(bob, "init", "--name", "bob-laptop")
    for home in (alice, bob, carol):
        # Every home on its own free port: nothing else on this machine answers a dial.
        for key, value in (
            ("listen_host", "127.0.0.1"),
            ("listen_port", str(_free_udp_port())),
            ("connect_timeout", "10"),  # a loaded CI machine still answers in time
            ("image", IMAGE),
        ):
            _cli(home, "config", "set", key, value)

    rec.json("config_show", "", bob, "config", "show", "--json")
    rec.json("doctor", "exits 1 when a check fails", bob, "doctor", "--json", ok=(0, 1))
    rec.json("gpu", "simulated GPUs", bob, "gpu", "--json", env=SIMULATED_GPUS)
    status = ("status", "--json")
    rec.json("status_not_sharing", "simulated GPUs", bob, *status, env=SIMULATED_GPUS)

    alice_id = str(_json(alice, "status", "--json")["node_id"])
    try:
        with _sharing(alice):
            _pairing(rec, alice, bob, carol)
            _registry(root, rec, alice, bob, carol)
            _jobs(rec, alice, bob)
            _copies(root, rec, bob)
            _apps(root, rec, bob)
            _groups(rec, alice, bob)
            _desktop(rec, alice, bob)
            job_id = _cli(bob, "run", "--peer", "alice-pc", "--detach", "--", "sleep", "120")
        rec.json(
            "jobs_provider_unreachable",
            "bob's running job is on alice, who stopped sharing: unknown since",
            bob,
            "jobs",
            "--json",
        )
        assert job_id.stdout.strip()
        _relayed(rec, alice, bob, relay)
    finally:
        remove_containers(alice_id)


def _pairing(rec: Recorder, alice: Path, bob: Path, carol: Path) -> None:
    def code(home: Path) -> str:
        return _cli(home, "pair-code").stdout.strip()

    rec.json(
        "pair_not_paired_back",
        "alice shares and has not paired bob yet",
        bob,
        "pair",
        code(alice),
        "--json",
    )
    rec.json("pair_offline", "no dial", alice, "pair", "--offline", code(bob), "--json")
    rec.json(
        "pair_ready", "a fresh code of alice, who paired bob", bob, "pair", code(alice), "--json"
    )
    rec.json("pair_unreachable", "bob does not share", carol, "pair", code(bob), "--json")
    _cli(bob, "pair", "--offline", code(carol))
    rec.json("connect", "direct, on loopback", bob, "connect", "alice-pc", "--json")
    rec.json(
        "connect_speed",
        "with a throughput measurement",
        bob,
        "connect",
        "alice-pc",
        "--speed",
        "1MB",
        "--json",
    )
    rec.json("peers", "alice (seen), carol (never seen)", bob, "peers", "--json")
    rec.json("pair_code", "", carol, "pair-code", "--json")
    rec.json("deny", "carol, never seen", bob, "deny", "carol-box", "--json")
    rec.json("allow", "carol again", bob, "allow", "carol-box", "--json")


def _registry(root: Path, rec: Recorder, alice: Path, bob: Path, carol: Path) -> None:
    """``search`` and ``sync``: bob has no registry; carol has one that lists alice."""
    rec.json("sync_no_registry", "bob: no rendezvous_url, alice answers", bob, "sync", "--json")
    with serve_registry(str(root / "registry.db"), RegistryConfig()) as registry:
        identity = Identity.load(alice / "identity.key")
        listing = listing_of(
            identity,
            SequenceClock(registry.clock).next(),
            name="alice-pc",
            gpus=[GpuListing("RTX-4090", 24 * 1000**3, 20 * 1000**3)],
            idle=True,
            region="us-west",
            contact="alice@example.org",
            version="0.1.0",
        )
        RegistryClient(registry.url).publish(identity, listing)
        _cli(carol, "config", "set", "rendezvous_url", registry.url)
        rec.json("search", "one listing (alice's)", carol, "search", "--json")
        rec.json("sync_registry", "carol: a registry, bob paired", carol, "sync", "--json")
        _cli(carol, "config", "unset", "rendezvous_url")


def _jobs(rec: Recorder, alice: Path, bob: Path) -> None:
    _cli(bob, "run", "--peer", "alice-pc", "--", "echo", "hello")
    attached = subprocess.Popen(
        [*GPUMESH, "run", "--peer", "alice-pc", "--", "sleep", "120"],
        env=_env(bob),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def running(home: Path) -> list[Any]:
            jobs = _json(home, "jobs", "--offline", "--json")
            return [j for j in jobs if j["state"] == "running" and j["started_at"] is not None]

        until(lambda: running(bob) and running(alice), "bob's job to run on alice", every=0.2)
        until(
            lambda: _json(alice, "status", "--json", "--offline")["connections"],
            "alice to list bob's link",
            every=0.2,
        )
        rec.json("status_sharing", "bob's job running", alice, "status", "--json")
        rec.json("jobs_submitted", "one job done, one running", bob, "jobs", "--json")
        rec.json("jobs_hosted", "one job done, one running", alice, "jobs", "--json")
        rec.json(
            "cancel_submitted",
            "bob's running job",
            bob,
            "cancel",
            running(bob)[0]["job_id"],
            "--json",
        )
        rec.json("pause", "no guest job left", alice, "pause", "--grace", "1s", "--json")
        rec.json("resume", "", alice, "resume", "--json")
        attached.wait(timeout=60)
    finally:
        if attached.poll() is None:
            attached.kill()
            attached.wait()


def _copies(root: Path, rec: Recorder, bob: Path) -> None:
    local = root / "local"
    (local / "data" / "sub").mkdir(parents=True)
    (local / "one.bin").write_bytes(os.urandom(300_000))
    (local / "data" / "a.txt").write_text("a\n")
    (local / "data" / "sub" / "b.txt").write_text("b\n")
    (local / "data" / "outside").symlink_to("/etc/hostname")
    one, data = str(local / "one.bin"), str(local / "data")
    rec.json("cp_upload_file", "the data channel", bob, "cp", one, "alice-pc:/one.bin", "--json")
    rec.json(
        "cp_upload_file_quic",
        "QUIC only",
        bob,
        "cp",
        "--no-fast-path",
        one,
        "alice-pc:/two.bin",
        "--json",
    )
    back = str(local / "back.bin")
    rec.json("cp_download_file", "", bob, "cp", "alice-pc:/one.bin", back, "--json")
    rec.json(
        "cp_upload_folder",
        "a link out of it is left out",
        bob,
        "cp",
        data,
        "alice-pc:/",
        "--json",
    )
    back = str(local / "back")
    rec.json("cp_download_folder", "", bob, "cp", "alice-pc:/data", back, "--json")


def _apps(root: Path, rec: Recorder, bob: Path) -> None:
    project = root / "proj"
    project.mkdir()
    (project / "main.py").write_text("print('hi')\n")
    (project / "run.log").write_text("ignored\n")
    (project / ".gpumeshignore").write_text("*.log\n")
    sync = ("app", "sync", "--peer", "alice-pc", "--dir", str(project))
    rec.json("app_sync_dry_run", "*.log ignored", bob, *sync, "--dry-run", "--json")
    rec.json("app_sync", "first sync", bob, *sync, "--json")
    (project / "main.py").unlink()
    (project / "other.py").write_text("print('other')\n")
    rec.json("app_sync_changes", "one file sent, one deleted", bob, *sync, "--json")
    run = ("app", "run", "--peer", "alice-pc", "--dir", str(project), "--json", "--", "true")
    rec.json("app_run", "no --out", bob, *run)
    app_job = next(j["job_id"] for j in _json(bob, "jobs", "--json") if j["role"] == "submitted")
    out = str(root / "app-out")
    rec.json("app_pull", "by a prefix, the peer from the record", bob, "app", "pull", "--job",
             app_job[:6], "--dir", out, "--json")  # fmt: skip


def _groups(rec: Recorder, alice: Path, bob: Path) -> None:
    rec.json("group_create", "", bob, "group", "create", "lab", "--json")
    rec.json("group_add", "", bob, "group", "add", "lab", "alice-pc", "--json")
    _cli(bob, "group", "add", "lab", "carol-box")
    rec.json("group_list_created", "", bob, "group", "list", "--json")
    invite = _cli(bob, "group", "invite", "lab").stdout.strip()
    rec.json("group_join", "alice has not paired carol", alice, "group", "join", invite, "--json")
    rec.json("group_list_joined", "", alice, "group", "list", "--json")
    rec.json(
        "group_members",
        "bob itself, alice probed (sharing, no GPU), carol unreachable",
        bob,
        "group",
        "members",
        "lab",
        "--json",
    )
    members = ("group", "members", "lab", "--offline", "--json")
    rec.json("group_members_offline", "", bob, *members)


def _desktop(rec: Recorder, alice: Path, bob: Path) -> None:
    """``desktop connect --json`` runs until stopped: where it listens, then a line per
    connection (over a data channel: a direct loopback link)."""
    server = socket.create_server(("127.0.0.1", 0))
    served = str(server.getsockname()[1])
    rec.json("desktop_share", "", alice, "desktop", "share", "--port", served, "--json")
    rec.json("desktop_allow", "", alice, "desktop", "allow", "bob-laptop", "--json")
    args = ("desktop", "connect", "alice-pc", "--bind", "127.0.0.1:0", "--json")
    proc = subprocess.Popen(
        [*GPUMESH, *args], env=_env(bob), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline()]
        while lines[-1] and lines[-1].rstrip() != "}":  # the first document is indented
            lines.append(proc.stdout.readline())
        ready = rec.record(
            "desktop_connect", "a plain TCP server shared", bob, args, json.loads("".join(lines))
        )
        port = int(str(ready["listen"]).rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60):
            line = proc.stdout.readline()
            rec.record(
                "desktop_connect_connection", "its first connection", bob, args, json.loads(line)
            )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        server.close()
        _cli(alice, "desktop", "share", "stop")


def _relayed(rec: Recorder, alice: Path, bob: Path, relay: str) -> None:
    """alice registers with a relay from another port: bob reaches her through it
    and punches a direct path. (Until now no home had a relay: with one, a dial on
    a loaded machine may go either way, and connect's punch_ms with it.)"""
    for home in (alice, bob):
        _cli(home, "config", "set", "relay", relay)
    _cli(alice, "config", "set", "listen_port", str(_free_udp_port()))
    with _sharing(alice):
        until(
            lambda: "registered" in _json(alice, "status", "--json", "--offline")["relay_state"],
            "alice to register with the relay",
            every=0.2,
        )
        rec.json(
            "status_sharing_relay", "registered with a relay, no link", alice, "status", "--json"
        )
        rec.json(
            "netcheck",
            "alice's node process registered; on loopback: no NAT; no relay over TCP",
            alice,
            "netcheck",
            "--json",
            env={"HTTPS_PROXY": "", "https_proxy": ""},
        )
        rec.json(
            "connect_hole_punched",
            "alice's address is stale: through the relay, then punched",
            bob,
            "connect",
            "alice-pc",
            "--json",
        )
        _cli(bob, "pair", _cli(alice, "pair-code").stdout.strip())
        rec.json("peers_relay", "alice's code names her relay", bob, "peers", "--json")
        members = ("group", "members", "lab", "--offline", "--json")
        rec.json("group_members_relay_offline", "alice with her relay", bob, *members)


# --- the test -------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_every_json_output_keeps_its_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_SIMULATED, raising=False)
    if detect_inventory().source != "none":
        pytest.skip("the shapes are recorded where the provider has no NVIDIA GPU")
    rec = Recorder(tmp_path)
    _scenario(tmp_path, rec)
    if UPDATE:
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(rec.cases, indent=2, sort_keys=True) + "\n")
    recorded: dict[str, dict[str, Any]] = json.loads(FIXTURE.read_text())
    problems = [f"{case}: not run any more" for case in recorded if case not in rec.cases]
    problems += [f"{case}: not recorded" for case in rec.cases if case not in recorded]
    for case, now in rec.cases.items():
        if case in recorded:
            found = differences("", recorded[case]["shape"], now["shape"])
            problems += [f"{case} ({now['command']}): {line}" for line in found]
    if problems:
        pytest.fail(
            "--json shapes differ from tests/integration/fixtures/json_shapes.json "
            "(GPUMESH_UPDATE_SHAPES=1 records them again, when the change is meant):\n  "
            + "\n  ".join(problems),
            pytrace=False,
        )


def test_shapes_are_types_and_keys_not_values() -> None:
    first = {"id": "a1", "n": 3, "t": 1.5, "ok": True, "x": None, "jobs": [{"s": "run"}]}
    second = {"id": "b2", "n": 9, "t": 7.25, "ok": False, "x": None, "jobs": [{"s": "done"}] * 3}
    assert shape_of(first) == shape_of(second)
    assert shape_of([{"a": 1}, {"a": None}, {"a": 2}]) == [{"a": "int"}, {"a": "null"}]
    assert differences("", shape_of(first), shape_of({**first, "n": "3", "new": []})) == [
        ".new: new ([])",
        '.n: was "int", now "str"',
    ]
    assert differences("", shape_of({"l": [{"a": 1}]}), shape_of({"l": [{"b": 1}]})) == [
        '.l[].a: gone (was "int")',
        '.l[].b: new ("int")',
    ]
    jobs = [{"id": "a", "exit": 0, "at": 1.5}, {"id": "b", "exit": None, "at": None}]
    renamed = [{"id": "a", "code": 0, "at": "1.5"}, {"id": "b", "code": None, "at": None}]
    assert differences("", shape_of(jobs), shape_of(renamed)) == [
        '[].exit: gone (was "int" | "null")',
        '[].code: new ("int" | "null")',
        '[].at: was "float" | "null", now "null" | "str"',
    ]
    # the same types per key, combined otherwise: named element by element
    swapped = [{"id": "a", "exit": 0, "at": None}, {"id": "b", "exit": None, "at": 1.5}]
    assert differences("", shape_of(jobs), shape_of(swapped)) == [
        '[]: no element is {"at":"float","exit":"int","id":"str"} any more',
        '[]: no element is {"at":"null","exit":"null","id":"str"} any more',
        '[]: an element is {"at":"float","exit":"null","id":"str"}',
        '[]: an element is {"at":"null","exit":"int","id":"str"}',
    ]
