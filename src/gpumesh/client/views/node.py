"""The shapes of the commands about this node: init, status, gpu, doctor, netcheck,
config show."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from gpumesh.client.views.owner import RelayingView, SessionsView

if TYPE_CHECKING:
    from gpumesh.client.checks import Check
    from gpumesh.client.netcheck import Netcheck
    from gpumesh.client.node import NodeInfo, NodeStatus
    from gpumesh.gpu.inventory import GpuInfo, GpuInventory
    from gpumesh.store.home import Home
    from gpumesh.store.jobs import JobRecord

__all__ = [
    "CheckView",
    "ConfigChangeView",
    "GpuDetail",
    "GpuUse",
    "GpusView",
    "LoginCodeView",
    "NetcheckView",
    "NodeView",
    "PublishView",
    "StatusView",
    "WaitingJob",
]


class NodeView(msgspec.Struct):
    """``init``: the node just made."""

    name: str
    node_id: str
    home: str

    @classmethod
    def of(cls, info: NodeInfo) -> NodeView:
        return cls(info.name, str(info.node_id), str(info.home))


class GpuUse(msgspec.Struct):
    """A GPU in ``status``: its memory, in bytes."""

    index: int
    name: str
    memory_total: int
    memory_used: int
    owner: str = ""
    """The owner's processes using it while it is taken back from guests
    (``reclaim_on_gpu_use``); empty: offered (or not sharing)."""


class StatusView(msgspec.Struct):
    """``status``."""

    name: str
    node_id: str
    home: str
    sharing: bool
    listen: str
    """``host:port`` the agent listens on, or would."""
    agent_pid: int | None
    relay: str | None
    relay_state: str | None
    """What the running agent says of its relay; None without either."""
    connections: list[dict[str, str]]
    """The agent's connected peers: ``{"peer": name, "path": "direct"}``."""
    peers: int
    allowed: int
    gpu_source: str
    gpus: list[GpuUse]
    state: str
    """``paused`` while its owner has taken the machine back (`gpumesh pause`), else
    ``busy`` while this node runs GPUMesh jobs for peers, else ``idle``."""
    jobs_hosted_running: int
    jobs_submitted_running: int
    jobs_submitted_unknown: int
    """Unfinished submitted jobs whose providers did not say where they stand."""
    sessions: SessionsView
    """The sharing agent's open shells, desktop connections and CUDA sessions."""
    paused_since: float | None = None
    """When the owner paused sharing (`gpumesh pause`); None: not paused."""
    queue: list[WaitingJob] = msgspec.field(default_factory=list)
    """Jobs this node submitted that no provider holds now: waiting in its queue
    (``run --wait``), or moving to another member of their group."""
    relaying: RelayingView | None = None
    """What this node relays for its peers; null unless it shares with
    ``relay_for_peers`` on."""

    @classmethod
    def of(cls, status: NodeStatus, *, submitted_unknown: int) -> StatusView:
        agent = status.agent
        return cls(
            name=status.name,
            node_id=str(status.node_id),
            home=str(status.home),
            sharing=agent is not None,
            listen=status.listen,
            agent_pid=agent.pid if agent else None,
            relay=status.relay or None,
            relay_state=agent.relay_text if agent and status.relay else None,
            connections=agent.links if agent else [],
            peers=status.peers,
            allowed=status.allowed,
            gpu_source=status.gpu_source,
            gpus=[
                GpuUse(
                    g.index,
                    g.name,
                    g.memory_total,
                    g.memory_used,
                    agent.reclaimed.get(str(g.index), "") if agent else "",
                )
                for g in status.gpus
            ],
            # Busy means GPUMesh jobs here, whether or not they hold a GPU.
            state="paused" if status.paused else "busy" if status.running_hosted else "idle",
            jobs_hosted_running=status.running_hosted,
            jobs_submitted_running=status.running_submitted,
            jobs_submitted_unknown=submitted_unknown,
            sessions=SessionsView.of(status.sessions),
            paused_since=status.paused.since if status.paused else None,
            queue=[WaitingJob.of(job) for job in status.waiting],
            relaying=RelayingView.of(agent.relaying if agent else None),
        )


class WaitingJob(msgspec.Struct):
    """A submitted job no provider holds now."""

    job_id: str
    moving: bool
    """It left a provider (see ``jobs --json``'s hops); else it was never placed."""
    message: str
    """Why it waits (every member's reason), or why it moves."""
    wait_until: float | None
    """When its wait ends (then it ends, saying why); None: it does not wait."""

    @classmethod
    def of(cls, job: JobRecord) -> WaitingJob:
        return cls(job.job_id, bool(job.hops), job.message, job.wait_until or None)


class GpuDetail(msgspec.Struct):
    """A GPU in ``gpu``: everything the inventory read."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    utilization: int | None
    temperature: int | None
    processes: int | None
    owner: str = ""
    """The owner's processes using it while the share took it back from guests
    (``reclaim_on_gpu_use``); empty: offered (or not sharing)."""

    @classmethod
    def of(cls, gpu: GpuInfo, owner: str = "") -> GpuDetail:
        return cls(
            gpu.index,
            gpu.uuid,
            gpu.name,
            gpu.memory_total,
            gpu.memory_used,
            gpu.utilization,
            gpu.temperature,
            gpu.processes,
            owner,
        )


class GpusView(msgspec.Struct):
    """``gpu``."""

    source: str
    """``nvml``, ``nvidia-smi``, ``simulated`` (tests only) or ``none``."""
    gpus: list[GpuDetail]

    @classmethod
    def of(
        cls, inventory: GpuInventory, gpus: list[GpuInfo], reclaimed: dict[str, str] | None = None
    ) -> GpusView:
        """``reclaimed``: the share's GPUs taken back by their owner (index -> processes)."""
        owners = reclaimed or {}
        return cls(inventory.source, [GpuDetail.of(g, owners.get(str(g.index), "")) for g in gpus])


class CheckView(msgspec.Struct):
    """One ``doctor`` check."""

    name: str
    status: str
    """``ok``, ``warn`` or ``fail``."""
    detail: str
    fix: str

    @classmethod
    def of(cls, check: Check) -> CheckView:
        return cls(check.name, check.status, check.detail, check.fix)


class NetcheckView(msgspec.Struct):
    """``netcheck``: the network between this machine and its relay. A measure that
    could not be made is null; ``checks`` says why, one line each."""

    relay: str
    """The relay checked (the ``relay`` setting, or ``--relay``); empty: none."""
    relay_address: str | None
    """Its IPv4 address and UDP port."""
    reachable: bool
    """The relay answered over UDP or TCP."""
    udp_ms: float | None
    """Round trip over UDP: the median of a few."""
    public_address: str | None
    """This machine's address as the relay's port sees it."""
    mapping: str | None
    """``none`` (no NAT), ``independent`` (seen from the same address by both of the
    relay's ports: hole punching can work) or ``by-destination`` (symmetric: peers
    need the relay); null: not known."""
    inbound: bool | None
    """Unsolicited packets (from the relay's second port) got in."""
    mtu: int | None
    """The largest UDP payload that reached the relay unfragmented."""
    mtu_capped: bool
    """``mtu`` is the most the relay answers (1500): the path may carry more."""
    tcp_address: str | None
    """Where the relay over TCP was tried (``relay_tcp``, else the relay host's 443)."""
    tcp_ms: float | None
    """Round trip over TCP."""
    proxy: str | None
    """The HTTPS proxy used for TCP (``host:port``, never its credentials)."""
    node_relay: str | None
    """What this home's running node process says of its relay (``registered as
    ADDR``...); null when none runs or it has no relay."""
    checks: list[CheckView]

    @classmethod
    def of(cls, result: Netcheck) -> NetcheckView:
        udp, mtu, tcp = result.udp, result.mtu, result.tcp
        address = result.relay_address
        return cls(
            relay=result.relay,
            relay_address=f"{address[0]}:{address[1]}" if address else None,
            reachable=result.reachable,
            udp_ms=round(udp.rtt * 1000, 3) if udp else None,
            public_address=udp.observed if udp else None,
            mapping=udp.mapping if udp else None,
            inbound=udp.inbound if udp else None,
            mtu=mtu.payload,
            mtu_capped=mtu.capped,
            tcp_address=tcp.target,
            tcp_ms=round(tcp.rtt * 1000, 3) if tcp.rtt is not None else None,
            proxy=tcp.proxy,
            node_relay=result.node_relay,
            checks=[CheckView.of(check) for check in result.checks],
        )


class ConfigChangeView(msgspec.Struct):
    """``config set`` and ``unset`` (``PUT`` and ``DELETE /api/v1/config/{key}``):
    the setting as it now is."""

    key: str
    value: str
    """As ``config get`` prints it; a secret one masked."""
    secret: bool
    sharing: bool
    """Whether this home shares now (some settings are read when sharing starts)."""

    @classmethod
    def of(cls, home: Home, key: str) -> ConfigChangeView:
        config = home.config
        return cls(
            key, config.shown_text(key), config.is_secret(key), home.agent_info() is not None
        )


class PublishView(msgspec.Struct):
    """``POST /api/v1/share/publish``'s answer."""

    sharing: bool
    published: bool
    """A refresh was asked of the registry (False: this share publishes nothing)."""
    pid: int
    """The node process's."""


class LoginCodeView(msgspec.Struct):
    """A one-time login for a browser: open ``url``; it is good for one exchange."""

    url: str
    expires_in: float
