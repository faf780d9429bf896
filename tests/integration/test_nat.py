"""Across NATs, for real: two nodes in network namespaces behind MASQUERADE
routers, a `gpumesh-relay` process on the "public" segment (scripts/natlab.sh).

What each test proves about the path, not only that something worked:
- routers that drop unsolicited packets: hole punching succeeds and the job's
  bytes go direct (the relay's own counters show it forwarded almost nothing);
- routers that take unsolicited packets (port remapped) and symmetric NAT:
  everything goes through the relay (its counters show the job's bytes);
- relay down: a clear error within seconds; relay restarted: the provider
  registers again by itself and the next command works;
- the relay's byte cap ends a relayed session with its named refusal;
- every namespace, veth and process made is gone afterwards.

Needs root, iproute2 and iptables; in CI these are never skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpumesh.identity.keys import Identity

pytestmark = pytest.mark.usefixtures("network_lab", "gpumesh_processes")

ROOT = Path(__file__).resolve().parents[2]
NATLAB = ROOT / "scripts" / "natlab.sh"
PREFIX = "gmt"
RELAY = "203.0.113.1:4799"
BIN = Path(sys.executable).parent
IMAGE = os.environ.get("GPUMESH_TEST_DOCKER_IMAGE", "gpumesh-test/busybox:1")


def _natlab(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GPUMESH_NATLAB_PREFIX=PREFIX)
    return subprocess.run(
        ["bash", str(NATLAB), *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@dataclass
class Lab:
    tmp: Path
    a: Path
    b: Path
    relay: subprocess.Popen[str] | None = None
    share: subprocess.Popen[str] | None = None
    relay_args: tuple[str, ...] = ()

    @property
    def stats_path(self) -> Path:
        return self.tmp / "relay-stats.json"

    def run(
        self, ns: str, home: Path | None, *args: str, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ)
        env.pop("GPUMESH_LOG", None)
        if home is not None:
            env["GPUMESH_HOME"] = str(home)
        return subprocess.run(
            ["ip", "netns", "exec", f"{PREFIX}{ns}", *args],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def gpumesh(
        self, ns: str, home: Path, *args: str, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return self.run(ns, home, str(BIN / "gpumesh"), *args, timeout=timeout)

    def start_relay(self) -> None:
        self.stats_path.unlink(missing_ok=True)
        ids = [self.node_id(self.a), self.node_id(self.b)]
        command = [
            "ip", "netns", "exec", f"{PREFIX}P", str(BIN / "gpumesh-relay"),
            "--listen", RELAY, "--allow", ids[0], "--allow", ids[1],
            "--stats-file", str(self.stats_path), "--keepalive", "2s",
            "--registration-timeout", "10s", *self.relay_args,
        ]  # fmt: skip
        log = self.tmp / "relay.log"
        with log.open("a") as out:
            self.relay = subprocess.Popen(command, stdout=out, stderr=out, text=True)
        deadline = time.monotonic() + 10
        while "listening on" not in log.read_text():
            assert self.relay.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)

    def stop_relay(self) -> None:
        _stop(self.relay)
        self.relay = None

    def start_share(self) -> None:
        env = dict(os.environ, GPUMESH_HOME=str(self.b))
        env.pop("GPUMESH_LOG", None)
        with (self.tmp / "share.log").open("a") as out:
            self.share = subprocess.Popen(
                ["ip", "netns", "exec", f"{PREFIX}B", str(BIN / "gpumesh"), "share"],
                env=env,
                stdout=out,
                stderr=out,
                text=True,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status = json.loads(self.gpumesh("B", self.b, "status", "--json").stdout)
            if (status.get("relay_state") or "").startswith("registered"):
                return
            time.sleep(0.2)
        raise AssertionError(f"the provider never registered with the relay: {status}")

    def node_id(self, home: Path) -> str:
        """Read from the home's key: no command, so no node process starts (in the
        wrong namespace, or before the relay runs)."""
        return str(Identity.load(home / "identity.key").node_id)

    def relay_stats(self) -> dict[str, object]:
        # The relay rewrites its stats file at most once a second.
        time.sleep(1.2)
        data: dict[str, object] = json.loads(self.stats_path.read_text())
        return data


def _build_lab(
    tmp_path: Path, mode: str, *extra: str, relay_args: tuple[str, ...] = ()
) -> Iterator[Lab]:
    result = _natlab("up", mode, *extra)
    assert result.returncode == 0, result.stderr
    lab = Lab(tmp_path, tmp_path / "a", tmp_path / "b", relay_args=relay_args)
    try:
        for home, ns, name in ((lab.a, "A", "bob-laptop"), (lab.b, "B", "alice-pc")):
            assert lab.gpumesh(ns, home, "init", "--name", name).returncode == 0
            assert lab.gpumesh(ns, home, "config", "set", "relay", RELAY).returncode == 0
            assert lab.gpumesh(ns, home, "config", "set", "image", IMAGE).returncode == 0
            # The provider runs in a namespace of its own while the engine and its
            # containers stay in this machine's: job network rules made there would
            # filter nothing (what jobs reach is test_job_network.py's).
            assert lab.gpumesh(ns, home, "config", "set", "job_network", "bridge").returncode == 0
        code_b = lab.gpumesh("B", lab.b, "pair-code").stdout.strip()
        code_a = lab.gpumesh("A", lab.a, "pair-code").stdout.strip()
        assert lab.gpumesh("A", lab.a, "pair", code_b).returncode == 0
        assert lab.gpumesh("B", lab.b, "pair", code_a).returncode == 0
        # Pairing started each home's node process before the relay runs: the
        # tests start theirs (and see their registrations) from here.
        for ns, home in (("A", lab.a), ("B", lab.b)):
            assert lab.gpumesh(ns, home, "daemon", "stop").returncode == 0
        lab.start_relay()
        lab.start_share()
        yield lab
    finally:
        _stop(lab.share)
        _stop(lab.relay)
        down = _natlab("down")
        assert down.returncode == 0, down.stderr
        left = _natlab("check")
        assert left.returncode == 0, f"the NAT lab left things behind: {left.stderr}"
        _remove_containers(lab)


def _stop(process: subprocess.Popen[str] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def _remove_containers(lab: Lab) -> None:
    from tests.integration.conftest import remove_containers

    try:
        node_id = lab.node_id(lab.b)
    except Exception:
        return
    remove_containers(node_id)  # tolerates a removal the agent still has under way


@pytest.fixture
def drop_lab(tmp_path: Path) -> Iterator[Lab]:
    yield from _build_lab(tmp_path, "drop")


@pytest.fixture
def symmetric_lab(tmp_path: Path) -> Iterator[Lab]:
    yield from _build_lab(tmp_path, "drop", "--random-fully")


@pytest.fixture
def accept_lab(tmp_path: Path) -> Iterator[Lab]:
    yield from _build_lab(tmp_path, "accept")


@pytest.fixture
def capped_lab(tmp_path: Path) -> Iterator[Lab]:
    yield from _build_lab(tmp_path, "drop", "--random-fully", relay_args=("--session-bytes", "1MB"))


@pytest.fixture
def timed_lab(tmp_path: Path) -> Iterator[Lab]:
    yield from _build_lab(
        tmp_path, "drop", "--random-fully", relay_args=("--session-seconds", "2s")
    )


def _connect(lab: Lab) -> dict[str, object]:
    result = lab.gpumesh("A", lab.a, "connect", "alice-pc", "--json")
    assert result.returncode == 0, result.stderr
    data: dict[str, object] = json.loads(result.stdout)
    return data


def _run_job_with_payload(lab: Lab, size: int) -> str:
    work = lab.tmp / "work"
    work.mkdir(exist_ok=True)
    (work / "payload.bin").write_bytes(os.urandom(size))
    command = ["run", "--peer", "alice-pc", "--workdir", str(work), "--", "wc", "-c", "payload.bin"]
    result = lab.gpumesh("A", lab.a, *command, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _relayed_bytes(stats: dict[str, object]) -> int:
    value = stats["bytes_relayed"]
    assert isinstance(value, int)
    return value


@pytest.mark.usefixtures("docker_daemon")
def test_nats_that_drop_unsolicited_packets_are_punched_and_the_job_runs_direct(
    drop_lab: Lab,
) -> None:
    connected = _connect(drop_lab)
    assert str(connected["path"]).startswith("direct (hole-punched) 203.0.113.3:")
    payload = 3 * 1024 * 1024
    assert _run_job_with_payload(drop_lab, payload).split()[0] == str(payload)
    # The workdir (3 MiB) went direct: the relay carried only handshakes.
    assert _relayed_bytes(drop_lab.relay_stats()) < payload // 4
    peers = json.loads(drop_lab.gpumesh("A", drop_lab.a, "peers", "--json").stdout)
    assert peers[0]["last_path"].startswith("direct (hole-punched)")
    # A punched path is UDP only: cp keeps to QUIC instead of trying a TCP channel.
    blob = drop_lab.tmp / "blob.bin"
    blob.write_bytes(os.urandom(256 * 1024))
    copied = drop_lab.gpumesh("A", drop_lab.a, "cp", "--json", str(blob), "alice-pc:/blob.bin")
    assert copied.returncode == 0, copied.stderr
    assert json.loads(copied.stdout)["channel"] == "quic"
    doctor = json.loads(drop_lab.gpumesh("A", drop_lab.a, "doctor", "--json").stdout)
    nat = {c["name"]: c for c in doctor}["nat"]["detail"]
    assert "behind NAT, seen as 203.0.113.2:" in nat and "filtered" in nat


@pytest.mark.usefixtures("docker_daemon")
def test_symmetric_nat_runs_the_job_over_the_relay(symmetric_lab: Lab) -> None:
    connected = _connect(symmetric_lab)
    assert connected["path"] == f"relayed via {RELAY}"
    payload = 2 * 1024 * 1024
    before = _relayed_bytes(symmetric_lab.relay_stats())
    assert _run_job_with_payload(symmetric_lab, payload).split()[0] == str(payload)
    assert _relayed_bytes(symmetric_lab.relay_stats()) - before > payload
    status = json.loads(symmetric_lab.gpumesh("B", symmetric_lab.b, "status", "--json").stdout)
    assert status["relay_state"].startswith("registered as 203.0.113.3:")


@pytest.mark.usefixtures("docker_daemon")
def test_nat_that_accepts_unsolicited_packets_remaps_ports_so_the_relay_carries_the_job(
    accept_lab: Lab,
) -> None:
    connected = _connect(accept_lab)
    assert connected["path"] == f"relayed via {RELAY}"
    payload = 1024 * 1024
    before = _relayed_bytes(accept_lab.relay_stats())
    assert _run_job_with_payload(accept_lab, payload).split()[0] == str(payload)
    assert _relayed_bytes(accept_lab.relay_stats()) - before > payload


def test_relay_down_is_a_clear_error_and_a_restarted_relay_is_used_again(
    symmetric_lab: Lab,
) -> None:
    symmetric_lab.stop_relay()
    started = time.monotonic()
    result = symmetric_lab.gpumesh("A", symmetric_lab.a, "connect", "alice-pc", "--timeout", "3")
    took = time.monotonic() - started
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "relay 203.0.113.1:4799" in lines[0] and "no answer" in lines[0]
    assert took < 10
    # The provider registers again by itself once the relay is back.
    symmetric_lab.start_relay()
    deadline = time.monotonic() + 30
    while True:
        result = symmetric_lab.gpumesh("A", symmetric_lab.a, "connect", "alice-pc", "--json")
        if result.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["path"] == f"relayed via {RELAY}"


def test_the_relay_byte_cap_ends_a_relayed_session_with_its_named_refusal(capped_lab: Lab) -> None:
    result = capped_lab.gpumesh("A", capped_lab.a, "connect", "alice-pc", "--speed", "8MB")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "byte-cap" in lines[0] and "ended the session" in lines[0]
    closes = capped_lab.relay_stats()["closes"]
    assert isinstance(closes, dict) and closes.get("byte-cap", 0) >= 1


def test_the_relay_time_cap_ends_a_relayed_session_with_its_named_refusal(timed_lab: Lab) -> None:
    started = time.monotonic()
    result = timed_lab.gpumesh("A", timed_lab.a, "connect", "alice-pc", "--speed", "20GB")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "time-cap" in lines[0] and "ended the session" in lines[0]
    assert time.monotonic() - started < 30
