""":func:`choose` and :func:`evaluate` on probe results as members send them:
GPUMesh jobs make a member busy, or less preferred, whatever its GPUs."""

from __future__ import annotations

from gpumesh.client.placement import Probe, choose, evaluate
from gpumesh.identity.keys import NodeId
from gpumesh.protocol.messages import GpuReport, StatusReply
from gpumesh.store.peers import Peer

GB = 10**9


def _probe(
    name: str,
    gpus: list[GpuReport],
    running_jobs: int,
    rtt_ms: float = 1.0,
    container_gpus: bool = True,
    paused: bool = False,
) -> Probe:
    peer = Peer(
        node_id=NodeId("k" * 52),
        name=name,
        public_key=b"\0" * 32,
        addresses=["127.0.0.1:47000"],
        relay="",
        allowed=True,
        paired_at=0.0,
        last_seen=None,
        last_address="",
    )
    status = StatusReply(
        name=name,
        node_id="k" * 52,
        version="0",
        sharing=True,
        uptime=1.0,
        gpus=gpus,
        running_jobs=running_jobs,
        container_gpus=container_gpus,
        paused=paused,
    )
    return Probe(name, peer, status, rtt_ms=rtt_ms)


def _gpu(free: int) -> GpuReport:
    return GpuReport(
        index=0,
        name="L4",
        memory_total=24 * GB,
        memory_used=24 * GB - free,
        available=free,
        utilization=0,
        jobs=0,
    )


def test_a_cpu_only_member_with_a_job_is_busy() -> None:
    busy = evaluate(_probe("a", [], running_jobs=2), 0)
    assert not busy.eligible
    assert busy.reason == "busy (2 GPUMesh jobs running)"
    assert busy.busy
    idle = evaluate(_probe("b", [], running_jobs=0), 0)
    assert idle.eligible and not idle.busy and idle.reason == "CPU only"


def test_a_gpu_member_running_a_cpu_job_still_fits_but_an_idle_one_wins() -> None:
    # "busy" has the roomier GPU and the shorter round trip; only its job counts against it.
    busy = _probe("busy", [_gpu(24 * GB)], running_jobs=1, rtt_ms=0.5)
    idle = _probe("idle", [_gpu(20 * GB)], running_jobs=0, rtt_ms=5.0)
    placement = choose([busy, idle], 8 * GB)
    assert placement.peer_name == "idle"
    verdicts = {c.name: c for c in placement.candidates}
    assert verdicts["busy"].eligible and verdicts["busy"].busy
    assert verdicts["busy"].reason.endswith("1 GPUMesh job running on its other GPUs or CPUs")
    assert not verdicts["idle"].busy
    # With no idle member left, the least busy one takes it.
    busier = _probe("busier", [_gpu(24 * GB)], running_jobs=3, rtt_ms=0.1)
    assert choose([busier, busy], 8 * GB).peer_name == "busy"


def test_a_member_whose_docker_cannot_give_gpus_is_skipped_for_gpu_jobs() -> None:
    # Its roomy GPU would win, but its jobs would get no GPU there.
    toolless = _probe("toolless", [_gpu(24 * GB)], running_jobs=0, container_gpus=False)
    able = _probe("able", [_gpu(10 * GB)], running_jobs=0, rtt_ms=9.0)
    placement = choose([toolless, able], 8 * GB)
    assert placement.peer_name == "able"
    verdicts = {c.name: c for c in placement.candidates}
    assert not verdicts["toolless"].eligible
    assert verdicts["toolless"].reason == "its Docker cannot give GPUs to containers"
    assert choose([toolless], 8 * GB).chosen is None
    # A CPU job may run there, as on a CPU-only member: after the members with GPUs.
    cpu = choose([toolless, able], 0)
    assert cpu.peer_name == "able"
    alone = evaluate(toolless, 0)
    assert alone.eligible and alone.gpu is None
    assert alone.reason == "CPU only (its Docker cannot give GPUs to containers)"


def test_a_status_reply_from_an_older_provider_gives_its_gpus_to_containers() -> None:
    import msgspec

    from gpumesh.protocol.messages import decode_message, encode_message

    reply = _probe("a", [_gpu(GB)], running_jobs=0).status
    assert reply is not None
    raw = msgspec.msgpack.decode(encode_message(reply))
    del raw["container_gpus"]  # a provider from before the field
    decoded = decode_message(msgspec.msgpack.encode(raw))
    assert isinstance(decoded, StatusReply) and decoded.container_gpus is True


def test_a_member_its_owner_paused_is_skipped_saying_why_and_another_is_chosen() -> None:
    paused = _probe("alice-pc", [_gpu(20 * GB)], running_jobs=0, paused=True)
    other = _probe("bob-pc", [_gpu(8 * GB)], running_jobs=1)
    placement = choose([paused, other], 4 * GB)
    assert placement.peer_name == "bob-pc"
    skipped = next(c for c in placement.candidates if c.name == "alice-pc")
    assert (skipped.eligible, skipped.reason) == (False, "paused by its owner")
