"""View structs print the ``--json`` shapes the CLI always printed, and group
status says where a member stands as a typed state, from probe results alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgspec

from gpumesh.client.groups import MemberLive, MemberState, MemberStatus, MemberView
from gpumesh.client.node import ConnectResult, NodeStatus, ThroughputResult
from gpumesh.client.owner import OpenSessions
from gpumesh.client.placement import Probe
from gpumesh.client.views import to_json
from gpumesh.client.views.groups import MemberStatusEntry
from gpumesh.client.views.node import StatusView
from gpumesh.client.views.peers import ConnectView
from gpumesh.gpu.inventory import GpuInfo
from gpumesh.identity.keys import NodeId
from gpumesh.protocol.messages import GpuReport, StatusReply
from gpumesh.store.groups import GroupMember
from gpumesh.store.home import AgentInfo
from gpumesh.store.peers import Peer
from gpumesh.store.shares import Pause

GB = 10**9
ID = NodeId("k" * 26)


class _Shape(msgspec.Struct):
    name: str
    count: int
    ratio: float | None
    tags: list[str]
    maybe: str | msgspec.UnsetType = msgspec.UNSET


def test_to_json_prints_what_json_dumps_printed() -> None:
    # The text the CLI printed before view structs: indent 2, ASCII only.
    old = {"name": "café ☃", "count": 3, "ratio": None, "tags": ["a", "b"]}
    view = _Shape("café ☃", 3, None, ["a", "b"])
    assert to_json(view) == json.dumps(old, indent=2, default=str)
    assert '"caf\\u00e9 \\u2603"' in to_json(view)
    assert to_json([view]) == json.dumps([old], indent=2)
    assert to_json([]) == "[]"
    # A field set is printed in its place, an unset one not at all.
    assert list(json.loads(to_json(_Shape("x", 1, 0.5, [], "here")))) == [
        "name",
        "count",
        "ratio",
        "tags",
        "maybe",
    ]


def _peer(name: str = "alice-pc") -> Peer:
    return Peer(
        node_id=ID,
        name=name,
        public_key=b"\1" * 32,
        addresses=["127.0.0.1:47000", "10.0.0.2:47000"],
        relay="",
        allowed=True,
        paired_at=1.0,
        last_seen=None,
        last_address="10.0.0.2:47000",
    )


def _status(*, sharing: bool = True, gpus: list[GpuReport], running_jobs: int = 0) -> StatusReply:
    return StatusReply(
        name="alice-pc",
        node_id=ID,
        version="0",
        sharing=sharing,
        uptime=1.0,
        gpus=gpus,
        running_jobs=running_jobs,
    )


def _gpu(index: int, name: str, free: int, utilization: int = 0, jobs: int = 0) -> GpuReport:
    return GpuReport(
        index=index,
        name=name,
        memory_total=80 * GB,
        memory_used=80 * GB - free,
        available=free,
        utilization=utilization,
        jobs=jobs,
    )


def test_a_member_state_comes_from_the_probe_not_from_text() -> None:
    peer = _peer()
    no_answer = Probe("alice-pc", peer, error="unreachable: nothing listens", unreachable=True)
    refused = Probe("alice-pc", peer, error="has not paired you: send it your code")
    idle = Probe("alice-pc", peer, _status(gpus=[_gpu(0, "L4", 20 * GB)]), rtt_ms=3.0)
    cpu_jobs = Probe("alice-pc", peer, _status(gpus=[], running_jobs=1), rtt_ms=3.0)
    hot = Probe("alice-pc", peer, _status(gpus=[_gpu(0, "L4", 20 * GB, utilization=95)]))
    off = Probe("alice-pc", peer, _status(sharing=False, gpus=[]))
    states = {
        name: MemberLive.of(p)
        for name, p in [
            ("no_answer", no_answer),
            ("refused", refused),
            ("idle", idle),
            ("cpu_jobs", cpu_jobs),
            ("hot", hot),
            ("off", off),
        ]
    }
    assert states["no_answer"].state is MemberState.UNREACHABLE
    assert states["no_answer"].reason == "unreachable: nothing listens"
    assert states["refused"].state is MemberState.REFUSED
    assert not states["refused"].answered and states["refused"].gpus is None
    assert states["idle"].state is MemberState.IDLE and states["idle"].reason == ""
    assert states["cpu_jobs"].state is MemberState.BUSY
    # Every GPU above the busy threshold, with no GPUMesh job anywhere: busy too.
    assert states["hot"].state is MemberState.BUSY
    assert states["off"].state is MemberState.NOT_SHARING and states["off"].answered


def _member_view(peer: Peer | None, access: str) -> MemberView:
    member = GroupMember("g1", ID, "alice-pc", b"\1" * 32, ["192.0.2.9:47000"], "relay:1", 2.0)
    return MemberView(member, is_self=False, peer=peer, access=access)


_MEMBER_KEYS = [
    "name",
    "node_id",
    "is_self",
    "access",
    "paired",
    "allowed",
    "addresses",
    "relay",
    "hint",
]


def test_a_member_not_asked_has_null_live_keys_and_no_reach() -> None:
    entry = json.loads(
        to_json(MemberStatusEntry.of_status(MemberStatus(_member_view(None, "not paired"), None)))
    )
    live_keys = ["reachable", "gpus", "free_gpu_memory", "state", "probe"]
    assert list(entry) == [*_MEMBER_KEYS, *live_keys]
    assert all(entry[key] is None for key in live_keys)
    # Not paired: the invite's addresses and relay, and what to do.
    assert entry["addresses"] == ["192.0.2.9:47000"] and entry["relay"] == "relay:1"
    assert entry["paired"] is False and entry["allowed"] is None
    assert entry["hint"] == "not paired: ask for their `gpumesh pair-code`"


def test_a_member_asked_shows_what_the_probe_found() -> None:
    view = _member_view(_peer(), "allowed")
    gpus = [_gpu(0, "L4", 20 * GB), _gpu(1, "L4", 4 * GB), _gpu(2, "A100", 70 * GB)]
    answered = MemberLive.of(Probe("alice-pc", view.peer, _status(gpus=gpus), rtt_ms=12.4))
    entry = json.loads(to_json(MemberStatusEntry.of_status(MemberStatus(view, answered))))
    live_keys = ["reachable", "reach", "gpus", "free_gpu_memory", "state", "probe"]
    assert list(entry) == [*_MEMBER_KEYS, *live_keys]
    # A paired peer's own addresses, the one that last worked first.
    assert entry["addresses"] == ["10.0.0.2:47000", "127.0.0.1:47000"]
    assert entry["relay"] is None and entry["allowed"] is True and entry["hint"] is None
    assert entry["reachable"] is True and entry["reach"] == "yes (12 ms)"
    assert entry["gpus"] == "1x A100, 2x L4"
    assert entry["free_gpu_memory"] == 70 * GB
    assert entry["state"] == entry["probe"] == "idle"

    refused = MemberLive.of(Probe("alice-pc", view.peer, error="has not paired you"))
    entry = json.loads(to_json(MemberStatusEntry.of_status(MemberStatus(view, refused))))
    assert list(entry) == [*_MEMBER_KEYS, *live_keys]
    assert entry["reachable"] is False and entry["reach"] == "has not paired you"
    assert entry["probe"] == "refused"
    assert (entry["gpus"], entry["free_gpu_memory"], entry["state"]) == ("-", None, "-")

    cpu_only = MemberLive.of(Probe("alice-pc", view.peer, _status(gpus=[]), rtt_ms=1.0))
    entry = json.loads(to_json(MemberStatusEntry.of_status(MemberStatus(view, cpu_only))))
    assert (entry["gpus"], entry["free_gpu_memory"], entry["state"]) == ("none", None, "idle")


def test_status_keeps_its_keys_in_order() -> None:
    status = NodeStatus(
        name="alice-pc",
        node_id=ID,
        home=Path("/home/a/.gpumesh"),
        agent=AgentInfo(pid=42, host="0.0.0.0", port=47000, started=1.0, relay="r:1"),
        listen="0.0.0.0:47000",
        relay="r:1",
        peers=2,
        allowed=1,
        gpus=[GpuInfo(0, "GPU-0", "L4", 24 * GB, GB)],
        gpu_source="nvml",
        running_hosted=1,
        running_submitted=0,
        sessions=OpenSessions(),
    )
    shown = json.loads(to_json(StatusView.of(status, submitted_unknown=3)))
    assert list(shown) == [
        "name",
        "node_id",
        "home",
        "sharing",
        "listen",
        "agent_pid",
        "relay",
        "relay_state",
        "connections",
        "peers",
        "allowed",
        "gpu_source",
        "gpus",
        "state",
        "jobs_hosted_running",
        "jobs_submitted_running",
        "jobs_submitted_unknown",
        "sessions",
        "paused_since",
        "queue",
        "relaying",
    ]
    assert shown["sessions"] == {"shells": [], "desktops": [], "cuda": []}
    assert shown["relaying"] is None  # relay_for_peers is off
    assert shown["node_id"] == ID and shown["home"] == "/home/a/.gpumesh"
    assert shown["gpus"] == [
        {"index": 0, "name": "L4", "memory_total": 24 * GB, "memory_used": GB, "owner": ""}
    ]
    assert (shown["sharing"], shown["agent_pid"], shown["relay_state"]) == (True, 42, "")
    assert (shown["state"], shown["jobs_submitted_unknown"]) == ("busy", 3)
    assert shown["paused_since"] is None
    paused = json.loads(
        to_json(
            StatusView.of(dataclasses.replace(status, paused=Pause(7.0, 30.0)), submitted_unknown=0)
        )
    )
    assert (paused["state"], paused["paused_since"]) == ("paused", 7.0)  # over busy


def test_connect_has_upload_speed_only_when_measured() -> None:
    peer = _peer()
    result = ConnectResult(
        peer=peer,
        address="10.0.0.2:47000",
        path="direct",
        rtt_ms=0.123456,
        punch_ms=None,
        connect_ms=61.98765,
        remote=_status(gpus=[]),
    )
    plain = json.loads(to_json(ConnectView.of(result, None)))
    assert "upload_mb_per_s" not in plain
    assert (plain["rtt_ms"], plain["connect_ms"], plain["punch_ms"]) == (0.123, 61.988, None)
    assert plain["warm"] is False  # dialled for it (a node process's warm session: True)
    measured = ConnectView.of(result, ThroughputResult(peer, bytes=3_000_000, seconds=2.0))
    shown = json.loads(to_json(measured))
    assert list(shown)[-1] == "upload_mb_per_s" and shown["upload_mb_per_s"] == 1.5
