"""The real ``gpumesh`` CLI in subprocesses: the user flow, messages and exit codes.

Every failure a user can cause must end in one line on stderr, a non-zero
exit code, and no traceback.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import pytest

from gpumesh.errors import ExitCode
from gpumesh.identity.codes import CODE_PREFIX, make_code
from gpumesh.identity.keys import Identity
from tests.integration.conftest import gpumesh, remove_containers
from tests.integration.node import shares, wait_shares

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _init(home: Path, name: str, port: int | None = None) -> None:
    assert gpumesh(home, "init", "--name", name).returncode == 0
    assert gpumesh(home, "config", "set", "listen_host", "127.0.0.1").returncode == 0
    if port is not None:
        assert gpumesh(home, "config", "set", "listen_port", str(port)).returncode == 0


def _one_line_error(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert text in lines[0]
    assert "Traceback" not in result.stderr


def _start_share(home: Path, *flags: str, inside: Sequence[str] = ()) -> subprocess.Popen[str]:
    """`gpumesh share` for ``home``, run through the command prefix ``inside`` if any
    (``ip netns exec NS``), once its node process shares."""
    env = dict(os.environ, GPUMESH_HOME=str(home))
    proc = subprocess.Popen(
        [*inside, sys.executable, "-m", "gpumesh", "share", *flags],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_shares(home, proc)
    except AssertionError:
        proc.kill()
        raise
    return proc


@contextlib.contextmanager
def running_share(home: Path, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """`gpumesh share` for ``home`` (started as :func:`_start_share` starts it) while
    the block runs; then stopped with SIGTERM, its pipes drained and closed."""
    share = _start_share(home, *flags)
    try:
        yield share
    finally:
        if share.poll() is None:
            share.terminate()
        share.communicate(timeout=30)


@pytest.fixture
def alice_sharing(tmp_path: Path):
    home = tmp_path / "a"
    _init(home, "alice-pc", _free_udp_port())
    proc = _start_share(home)
    yield home, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def test_share_says_who_runs_which_job_and_how_it_ended(alice_sharing, tmp_path: Path) -> None:
    """The share's output never said who ran which job."""
    alice, share = alice_sharing
    bob = tmp_path / "b"
    _init(bob, "bob-laptop")
    image = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")
    assert gpumesh(bob, "config", "set", "image", image).returncode == 0
    assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
    assert gpumesh(alice, "pair", gpumesh(bob, "pair-code").stdout.strip()).returncode == 0
    try:
        run = gpumesh(bob, "run", "--peer", "alice-pc", "--", "sh", "-c", "exit 3")
        assert run.returncode == 3, run.stderr
        (job,) = json.loads(gpumesh(bob, "jobs", "--json", "--offline").stdout)
    finally:
        remove_containers(json.loads(gpumesh(alice, "status", "--json").stdout)["node_id"])
    assert gpumesh(alice, "share", "stop").returncode == 0
    out, _ = share.communicate(timeout=30)
    said = [line.strip() for line in out.splitlines() if line.strip().startswith("job ")]
    short = job["job_id"][:8]
    assert said == [
        f"job {short} from bob-laptop: sh -c 'exit 3' ({image})",
        f"job {short} of bob-laptop failed (exited 3)",
    ], out


def test_user_flow_pair_connect_deny_and_stop(alice_sharing, tmp_path: Path) -> None:
    alice, share = alice_sharing
    bob = tmp_path / "b"
    _init(bob, "bob-laptop")

    alice_code = gpumesh(alice, "pair-code").stdout.strip()
    assert alice_code.startswith(CODE_PREFIX)
    # --offline: no dial yet, so `last_seen` below is still empty.
    paired = gpumesh(bob, "pair", "--offline", alice_code)
    assert paired.returncode == 0, paired.stderr
    assert "Paired with alice-pc" in paired.stdout
    bob_code = gpumesh(bob, "pair-code").stdout.strip()
    assert gpumesh(alice, "pair", bob_code).returncode == 0

    peers = json.loads(gpumesh(bob, "peers", "--json").stdout)
    assert [p["name"] for p in peers] == ["alice-pc"]
    assert peers[0]["allowed"] is True
    assert peers[0]["last_seen"] is None

    connected = gpumesh(bob, "connect", "alice-pc", "--json")
    assert connected.returncode == 0, connected.stderr
    report = json.loads(connected.stdout)
    assert report["reachable"] is True
    assert report["path"] == "direct"
    assert report["rtt_ms"] > 0
    assert json.loads(gpumesh(bob, "peers", "--json").stdout)[0]["last_seen"] is not None

    human = gpumesh(bob, "connect", "alice-pc")
    assert "alice-pc is reachable: path direct" in human.stdout
    assert "rtt" in human.stdout

    status = json.loads(gpumesh(alice, "status", "--json").stdout)
    assert status["sharing"] is True
    assert status["peers"] == 1

    assert gpumesh(alice, "deny", "bob-laptop").returncode == 0
    _one_line_error(gpumesh(bob, "connect", "alice-pc"), 3, "alice-pc has denied you access")
    assert gpumesh(alice, "allow", "bob-laptop").returncode == 0
    assert gpumesh(bob, "connect", "alice-pc").returncode == 0

    stopped = gpumesh(alice, "share", "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert share.wait(timeout=10) == 0
    assert not shares(alice)
    assert json.loads(gpumesh(alice, "status", "--json").stdout)["sharing"] is False
    _one_line_error(
        gpumesh(bob, "connect", "alice-pc"), ExitCode.UNREACHABLE, "nothing is listening"
    )


def test_share_stops_cleanly_on_ctrl_c(alice_sharing) -> None:
    alice, share = alice_sharing
    share.send_signal(signal.SIGINT)
    assert share.wait(timeout=10) == 0
    out, err = share.communicate()
    assert "Sharing alice-pc" in out
    assert CODE_PREFIX in out  # the banner prints a pairing code
    assert "Traceback" not in err
    assert not shares(alice)


def test_second_share_with_other_options_is_refused(alice_sharing) -> None:
    alice, _share = alice_sharing
    other = gpumesh(alice, "share", "--port", str(_free_udp_port()))
    _one_line_error(other, ExitCode.IN_USE, "this home already shares with")


def test_share_on_a_taken_port_says_so(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        home = tmp_path / "a"
        _init(home, "alice", taken.getsockname()[1])
        _one_line_error(gpumesh(home, "share"), ExitCode.IN_USE, "cannot listen on UDP")


def _tamper(code: str, field: str, value: object) -> str:
    """Change one field of a code's offer, keep the signature, recompute the CRC."""
    raw = base64.urlsafe_b64decode(code[len(CODE_PREFIX) :] + "==")
    signed = msgspec.msgpack.decode(raw[2:-4])
    offer = msgspec.msgpack.decode(signed["offer"])
    offer[field] = value
    signed["offer"] = msgspec.msgpack.encode(offer)
    body = msgspec.msgpack.encode(signed)
    data = struct.pack("!H", len(body)) + body
    data += struct.pack("!I", zlib.crc32(data))
    return CODE_PREFIX + base64.urlsafe_b64encode(data).decode().rstrip("=")


@pytest.fixture
def bob_home(tmp_path: Path) -> Path:
    home = tmp_path / "b"
    _init(home, "bob")
    return home


@pytest.fixture
def alice_code(tmp_path: Path) -> str:
    home = tmp_path / "a"
    _init(home, "alice")
    return gpumesh(home, "pair-code").stdout.strip()


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda c: "hello there", "not a GPUMesh pairing code"),
        (lambda c: c[:60], "truncated"),
        (lambda c: c[:40] + ("A" if c[40] != "A" else "B") + c[41:], "bad checksum"),
        (lambda c: c[:30] + "!!" + c[32:], "characters that do not belong"),
        (lambda c: _tamper(c, "name", "mallory"), "signature does not verify"),
        (lambda c: _tamper(c, "addresses", ["203.0.113.9:47000"]), "signature does not verify"),
        (lambda c: _tamper(c, "public_key", Identity.generate().public_key), "does not verify"),
    ],
    ids=["garbage", "truncated", "checksum", "characters", "name", "address", "key"],
)
def test_bad_codes_are_refused_before_anything_is_stored(
    bob_home: Path, alice_code: str, mangle, message: str
) -> None:
    _one_line_error(gpumesh(bob_home, "pair", mangle(alice_code)), 2, message)
    assert json.loads(gpumesh(bob_home, "peers", "--json").stdout) == []


def test_expired_code_is_refused(bob_home: Path) -> None:
    stale = make_code(Identity.generate(), "alice", ["127.0.0.1:47000"], clock=lambda: 1_000_000)
    _one_line_error(gpumesh(bob_home, "pair", stale), 2, "expired")


def test_own_code_is_refused(bob_home: Path) -> None:
    own = gpumesh(bob_home, "pair-code").stdout.strip()
    _one_line_error(gpumesh(bob_home, "pair", own), 2, "this node's own pairing code")


def test_new_key_for_a_paired_name_needs_rekey(bob_home: Path, tmp_path: Path) -> None:
    first = make_code(Identity.generate(), "alice", ["127.0.0.1:47000"])
    assert gpumesh(bob_home, "pair", first).returncode == 0
    reinstalled = make_code(Identity.generate(), "alice", ["127.0.0.1:47000"])
    _one_line_error(gpumesh(bob_home, "pair", reinstalled), 2, "--rekey")
    rekeyed = gpumesh(bob_home, "pair", "--rekey", reinstalled)
    assert rekeyed.returncode == 0, rekeyed.stderr
    peers = json.loads(gpumesh(bob_home, "peers", "--json").stdout)
    assert len(peers) == 1


def _peer(home: Path, name: str) -> dict[str, object]:
    peers = {p["name"]: p for p in json.loads(gpumesh(home, "peers", "--json").stdout)}
    return dict(peers[name])


def test_a_code_pairs_once(bob_home: Path, tmp_path: Path) -> None:
    alice = tmp_path / "a"
    _init(alice, "alice", 47201)
    code = gpumesh(alice, "pair-code").stdout.strip()
    assert gpumesh(bob_home, "pair", code).returncode == 0
    again = gpumesh(bob_home, "pair", code)
    _one_line_error(again, 2, "that pairing code of alice was already used on this node")
    assert "ask alice for a fresh code (`gpumesh pair-code` on their side)" in again.stderr
    assert _peer(bob_home, "alice")["allowed"] is True


def test_pair_never_lifts_a_denial(bob_home: Path, tmp_path: Path) -> None:
    alice = tmp_path / "a"
    _init(alice, "alice", 47201)
    code = gpumesh(alice, "pair-code").stdout.strip()
    assert gpumesh(bob_home, "pair", code).returncode == 0
    assert gpumesh(bob_home, "deny", "alice").returncode == 0
    # Her earlier code, still valid: spent, refused, and she stays denied.
    _one_line_error(gpumesh(bob_home, "pair", code), 2, "already used")
    assert _peer(bob_home, "alice")["allowed"] is False
    # A fresh code: her new address is taken (same key), the denial stays, and says so.
    assert gpumesh(alice, "config", "set", "listen_port", "47299").returncode == 0
    fresh = gpumesh(bob_home, "pair", gpumesh(alice, "pair-code").stdout.strip())
    assert fresh.returncode == 0, fresh.stderr
    assert "still denied" in fresh.stdout
    assert "`gpumesh allow alice` lets them use this node again" in fresh.stdout
    assert _peer(bob_home, "alice")["allowed"] is False
    assert _peer(bob_home, "alice")["addresses"] == ["127.0.0.1:47299"]
    assert gpumesh(bob_home, "allow", "alice").returncode == 0
    assert _peer(bob_home, "alice")["allowed"] is True


def test_a_fresh_code_of_an_allowed_peer_refreshes_its_addresses(
    bob_home: Path, tmp_path: Path
) -> None:
    alice = tmp_path / "a"
    _init(alice, "alice", 47201)
    assert gpumesh(bob_home, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
    assert _peer(bob_home, "alice")["addresses"] == ["127.0.0.1:47201"]
    assert gpumesh(alice, "config", "set", "listen_port", "47299").returncode == 0
    fresh = gpumesh(bob_home, "pair", gpumesh(alice, "pair-code").stdout.strip(), "--json")
    assert fresh.returncode == 0, fresh.stderr
    reply = json.loads(fresh.stdout)
    assert (reply["addresses"], reply["allowed"]) == (["127.0.0.1:47299"], True)
    assert _peer(bob_home, "alice")["addresses"] == ["127.0.0.1:47299"]


def test_unknown_and_ambiguous_peers(bob_home: Path) -> None:
    _one_line_error(gpumesh(bob_home, "connect", "nobody"), 2, "no paired peer named 'nobody'")
    # Find two keys whose ids share 4 characters (a birthday search, ~1k keys).
    seen: dict[str, Identity] = {}
    while True:
        identity = Identity.generate()
        prefix = identity.node_id[:4]
        if prefix in seen:
            break
        seen[prefix] = identity
    for index, ident in enumerate((seen[prefix], identity)):
        code = make_code(ident, f"twin{index}", ["127.0.0.1:47000"])
        assert gpumesh(bob_home, "pair", code).returncode == 0
    _one_line_error(gpumesh(bob_home, "deny", prefix), 2, "matches 2 peers")
    assert gpumesh(bob_home, "deny", identity.node_id[:12]).returncode == 0


def test_init_never_silently_replaces_an_identity(bob_home: Path) -> None:
    before = (bob_home / "identity.key").read_bytes()
    _one_line_error(gpumesh(bob_home, "init", "--name", "bob"), 2, "use --force")
    assert (bob_home / "identity.key").read_bytes() == before
    forced = gpumesh(bob_home, "init", "--name", "bob", "--force")
    assert forced.returncode == 0
    assert "warning" in forced.stderr
    assert (bob_home / "identity.key").read_bytes() != before
    assert (bob_home / "identity.key").stat().st_mode & 0o777 == 0o600


def test_commands_before_init_say_how_to_start(tmp_path: Path) -> None:
    _one_line_error(gpumesh(tmp_path / "none", "peers"), 2, "run `gpumesh init")


def test_config_refuses_unknown_keys_and_bad_values(bob_home: Path) -> None:
    _one_line_error(gpumesh(bob_home, "config", "set", "colour", "blue"), 2, "valid keys:")
    _one_line_error(gpumesh(bob_home, "config", "set", "listen_port", "70000"), 2, "1 to 65535")
    _one_line_error(gpumesh(bob_home, "config", "set", "max_vram", "lots"), 2, "invalid size")
    _one_line_error(
        gpumesh(bob_home, "config", "set", "relay_for_peers_rate", "fast"),
        2,
        "invalid rate 'fast': give bytes a second, such as 10MB/s",
    )
    assert gpumesh(bob_home, "config", "set", "listen_port", "47001").returncode == 0
    assert gpumesh(bob_home, "config", "get", "listen_port").stdout.strip() == "47001"
    assert "listen_port = 47001" in (bob_home / "config.toml").read_text()
    env_wins = subprocess.run(
        [sys.executable, "-m", "gpumesh", "config", "get", "relay"],
        env=dict(os.environ, GPUMESH_HOME=str(bob_home), GPUMESH_RELAY="relay.example:4799"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert env_wins.stdout.strip() == "relay.example:4799"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.usefixtures("open_umask")
def test_a_new_home_is_private(tmp_path: Path) -> None:
    home = tmp_path / "new"
    _init(home, "newbie")
    assert _mode(home) == 0o700
    assert _mode(home / "logs") == 0o700
    for name in ("config.toml", "gpumesh.db", "logs/gpumesh.log"):
        assert _mode(home / name) == 0o600, name


def test_every_command_narrows_the_home_again(bob_home: Path) -> None:
    files = [bob_home / name for name in ("config.toml", "gpumesh.db", "logs/gpumesh.log")]
    for path in files:
        path.chmod(0o644)
    (bob_home / "logs").chmod(0o755)
    bob_home.chmod(0o755)
    assert gpumesh(bob_home, "peers").returncode == 0
    assert _mode(bob_home) == 0o700
    assert _mode(bob_home / "logs") == 0o700
    assert [_mode(path) for path in files] == [0o600] * len(files)


def test_config_show_masks_the_relay_token_and_get_reveals_it(bob_home: Path) -> None:
    token = "tok-9f3a71c2e5"
    set_ = gpumesh(bob_home, "config", "set", "relay_token", token)
    assert set_.returncode == 0, set_.stderr
    assert set_.stdout.strip() == "relay_token = ******** (hidden)"
    table = gpumesh(bob_home, "config", "show")
    assert table.returncode == 0, table.stderr
    assert token not in table.stdout + table.stderr
    assert re.search(r"relay_token\s+\*{8}\s+file", table.stdout), table.stdout
    shown = gpumesh(bob_home, "config", "show", "--json")
    assert token not in shown.stdout + shown.stderr
    values = json.loads(shown.stdout)
    assert values["relay_token"] == "********"
    assert values["node_name"] == "bob"
    assert gpumesh(bob_home, "config", "get", "relay_token").stdout.strip() == token
    unset = gpumesh(bob_home, "config", "unset", "relay_token")
    assert unset.returncode == 0, unset.stderr
    assert json.loads(gpumesh(bob_home, "config", "show", "--json").stdout)["relay_token"] == ""
    assert token not in (bob_home / "logs" / "gpumesh.log").read_text()


def test_help_has_examples_everywhere() -> None:
    from gpumesh.cli.main import COMMANDS

    for command in ("", *COMMANDS):
        args = [command, "--help"] if command else ["--help"]
        result = gpumesh(Path("/nonexistent"), *args)
        assert result.returncode == 0, result.stderr
        assert "Examples:" in result.stdout, command


def test_doctor_reports_each_check(bob_home: Path) -> None:
    result = gpumesh(bob_home, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert set(checks) >= {"identity", "config", "database", "docker", "udp port", "clock"}
    assert checks["identity"]["status"] == "ok"
    (bob_home / "identity.key").chmod(0o644)
    result = gpumesh(bob_home, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert result.returncode == 1
    assert checks["identity"]["status"] == "fail"
    assert "chmod 600" in checks["identity"]["fix"]


def test_config_set_relay_takes_a_host_without_port(bob_home: Path) -> None:
    """The README says the relay's port defaults to 4799: a bare host is accepted."""
    result = gpumesh(bob_home, "config", "set", "relay", "127.0.0.1")
    assert result.returncode == 0, result.stderr
    assert gpumesh(bob_home, "config", "get", "relay").stdout.strip() == "127.0.0.1"


def test_doctor_reports_a_bad_setting_in_the_environment_and_runs_the_rest(
    bob_home: Path,
) -> None:
    result = _run_with_env(
        bob_home, {"GPUMESH_RELAY": "relay.example.org:http"}, "doctor", "--json"
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert checks["config"]["status"] == "fail"
    assert "GPUMESH_RELAY" in checks["config"]["detail"]
    assert "GPUMESH_RELAY" in checks["config"]["fix"]
    # The other checks ran, and only the bad setting failed.
    assert {"identity", "database", "docker", "udp port", "clock"} <= set(checks)
    assert [c["name"] for c in checks.values() if c["status"] == "fail"] == ["config"]


def test_a_log_filter_that_is_not_one_is_warned_about_once(bob_home: Path) -> None:
    # `config path` logs in the command's own process (a thin command's node
    # process has its own log).
    result = _run_with_env(bob_home, {"GPUMESH_LOG": "bogus==="}, "config", "path")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("warning: GPUMESH_LOG='bogus==='")
    assert "e.g. GPUMESH_LOG=info,gpumesh.transport=debug" in lines[0]
    quiet = {"GPUMESH_LOG": "error,gpumesh.transport=error"}
    fine = _run_with_env(bob_home, quiet, "config", "path")
    assert (fine.returncode, fine.stderr) == (0, "")


def test_doctor_narrows_the_home_and_reports_its_modes(bob_home: Path) -> None:
    (bob_home / "config.toml").chmod(0o644)
    bob_home.chmod(0o755)
    checks = {c["name"]: c for c in json.loads(gpumesh(bob_home, "doctor", "--json").stdout)}
    assert checks["home"]["status"] == "ok", checks["home"]
    assert "0700" in checks["home"]["detail"]
    assert "0600" in checks["home"]["detail"]
    assert _mode(bob_home) == 0o700
    assert _mode(bob_home / "config.toml") == 0o600


@pytest.mark.usefixtures("docker_daemon")
def test_doctor_sees_the_docker_daemon_and_its_version(bob_home: Path) -> None:
    checks = {c["name"]: c for c in json.loads(gpumesh(bob_home, "doctor", "--json").stdout)}
    assert checks["docker"]["status"] == "ok", checks["docker"]
    assert checks["docker"]["detail"].startswith("Docker ")
    assert "API 1." in checks["docker"]["detail"]


@pytest.mark.usefixtures("docker_daemon")
def test_doctor_reports_job_isolation_storage_and_agent_user(bob_home: Path) -> None:
    checks = {c["name"]: c for c in json.loads(gpumesh(bob_home, "doctor", "--json").stdout)}
    isolation, storage = checks["job isolation"], checks["job storage"]
    assert isolation["status"] == "ok", isolation
    assert "inside containers" in isolation["detail"] or "userns-remap" in isolation["detail"]
    assert storage["status"] == "ok", storage
    assert storage["detail"].startswith("read-only root filesystem; /tmp and HOME 1GB tmpfs")
    expected = "warn" if os.geteuid() == 0 else "ok"
    assert checks["agent user"]["status"] == expected, checks["agent user"]
    assert gpumesh(bob_home, "config", "set", "job_root", "on").returncode == 0
    checks = {c["name"]: c for c in json.loads(gpumesh(bob_home, "doctor", "--json").stdout)}
    assert checks["job isolation"]["status"] in ("warn", "fail"), checks["job isolation"]
    assert checks["job storage"]["status"] in ("ok", "warn")
    assert "writable root filesystem" in checks["job storage"]["detail"]


def test_doctor_without_docker_says_how_to_fix(bob_home: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpumesh", "doctor", "--json"],
        env=dict(os.environ, GPUMESH_HOME=str(bob_home), DOCKER_HOST="unix:///nonexistent.sock"),
        capture_output=True,
        text=True,
        check=False,
    )
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert result.returncode == 1
    assert checks["docker"]["status"] == "fail"
    assert "start it" in checks["docker"]["fix"]


def _run_with_env(
    home: Path, extra: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    """``gpumesh ARGS`` with ``extra`` in its environment, and in its node process's:
    the one running is stopped first, so the command starts one that has it."""
    env = dict(os.environ, GPUMESH_HOME=str(home), **extra)
    _stop_node(env)
    return subprocess.run(
        [sys.executable, "-m", "gpumesh", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _stop_node(env: dict[str, str]) -> None:
    stop = [sys.executable, "-m", "gpumesh", "daemon", "stop"]
    stopped = subprocess.run(stop, env=env, capture_output=True, text=True, check=False)
    assert stopped.returncode == 0, stopped.stderr


def test_gpu_table_and_its_simulated_warning(bob_home: Path) -> None:
    """No NVIDIA hardware here: the simulated inventory stands in, and says so."""
    result = _run_with_env(
        bob_home, {"GPUMESH_TEST_SIMULATED_GPUS": "RTX-4090:24GB:3GB,A100:80GB"}, "gpu"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("SIMULATED GPUs")
    assert "RTX-4090" in result.stdout and "3GB / 24GB" in result.stdout
    listing = json.loads(
        _run_with_env(
            bob_home, {"GPUMESH_TEST_SIMULATED_GPUS": "A100:80GB"}, "gpu", "--json"
        ).stdout
    )
    assert listing["source"] == "simulated"
    assert listing["gpus"][0]["memory_total"] == 80 * 10**9
    status = _run_with_env(bob_home, {"GPUMESH_TEST_SIMULATED_GPUS": "A100:80GB"}, "status")
    assert "SIMULATED" in status.stdout


def test_gpu_without_any_gpu_says_so(bob_home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GPUMESH_TEST_SIMULATED_GPUS"}
    env.update(GPUMESH_HOME=str(bob_home), PATH="/nonexistent")
    _stop_node(env)  # the node process this command starts reads the GPUs
    result = subprocess.run(
        [sys.executable, "-m", "gpumesh", "gpu"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if "nvml" in result.stderr:  # pragma: no cover - a machine with a real GPU
        pytest.skip("this machine has an NVIDIA driver")
    _one_line_error(result, 1, "no NVIDIA GPU found")
