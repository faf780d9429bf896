"""Sharing, owned by the node process: the provider, what it reports, its publishing.

:class:`Sharing` starts and stops this home's provider (the agent) inside the
node process, on ``POST`` and ``DELETE /api/v1/share``. Everything a share has
to say (where it listens, its GPUs, who jobs run as, the relay, the registry,
the pairing code, how it ended) becomes numbered :class:`ShareLine` s kept in a
bounded buffer: ``gpumesh share`` prints them as it follows the share, from the
first line of the share it asked for or joined; the node's log has them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from gpumesh import platform
from gpumesh.client.bodies import ShareOptions
from gpumesh.control.shareviews import PauseView, ShareEnd, ShareLine, ShareView
from gpumesh.daemon import publish
from gpumesh.errors import (
    ConfigError,
    GPUMeshError,
    InUseError,
    NotFoundError,
    RuntimeUnavailableError,
)
from gpumesh.runtime.base import NO_GPU_RUNTIME_NOTE
from gpumesh.runtime.jobnet import describe_mode
from gpumesh.units import format_size

_SAID = {"gpumesh_said": True}
"""On the log record of a line the share says (see cli/_logsetup.LevelFilter)."""

if TYPE_CHECKING:
    from gpumesh.agent.server import Agent
    from gpumesh.client.node import Node
    from gpumesh.daemon.publish import Publishing

__all__ = ["Sharing", "require_linux"]

logger = logging.getLogger(__name__)

KEPT_LINES = 500
"""Lines of output kept for followers (a share's start says about twenty)."""
RELAY_WAIT = 3.0
"""Seconds the start waits for the relay's first answer before reporting it."""
MAX_GRACE = 24 * 3600.0
"""The longest grace a pause gives guest jobs."""


class Sharing:
    """This home's share: at most one at a time, started and stopped by the API."""

    def __init__(
        self,
        node: Node,
        ended: ShareEnd | None = None,
        *,
        echo: Callable[[ShareLine], None] | None = None,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        """``ended``: how the home's last share ended, if known; ``echo`` hears each
        line as it is said (a node process in the foreground prints them);
        ``on_change``: called when sharing starts or stops."""
        self.node = node
        self.echo = echo
        self.on_change = on_change
        self.agent: Agent | None = None
        self.options: ShareOptions | None = None
        self.since: float | None = None
        self.ended = ended
        self.first_line = 0
        self._lines: deque[ShareLine] = deque(maxlen=KEPT_LINES)
        self._seq = 0
        self._grew = asyncio.Event()
        self._starting: asyncio.Lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._publishing: Publishing | None = None
        self._how = ""
        """Why the running share is being stopped (said in :attr:`ended`)."""
        self._udp = ""
        """``host:port`` the running share listens on."""

    @property
    def active(self) -> bool:
        return self.agent is not None

    @property
    def port(self) -> int:
        """The UDP port the running share listens on; 0 when none runs."""
        return 0 if self.agent is None else self.agent.address[1]

    def view(self) -> ShareView:
        return ShareView(
            sharing=self.active,
            since=self.since,
            options=self.options,
            udp=self._udp if self.active else None,
            first_line=self.first_line,
            ended=None if self.active else self.ended,
            agent=None if self.agent is None else self.agent.info(),
            paused_since=pause.since if (pause := self.node.home.store.paused()) else None,
        )

    # --- output ---------------------------------------------------------------------------

    def say(self, text: str, *, err: bool = False, tone: str = "") -> None:
        self._seq += 1
        line = ShareLine(self._seq, text, err, tone)
        self._lines.append(line)
        # Marked as said when echoed: the console it is echoed to leaves the record out.
        said = _SAID if self.echo is not None else None
        logger.log(logging.WARNING if tone else logging.INFO, "share: %s", text, extra=said)
        if self.echo is not None:
            self.echo(line)
        self._grew.set()
        self._grew = asyncio.Event()

    def lines(self, after: int) -> list[ShareLine]:
        return [line for line in self._lines if line.seq > after]

    async def follow(self, after: int) -> AsyncIterator[ShareLine | ShareView]:
        """The lines after ``after``, as they come, then the share as it ended."""
        share_from = self.first_line
        while True:
            grew = self._grew
            for line in self.lines(after):
                after = line.seq
                yield line
            if not self.active or self.first_line != share_from:
                yield self.view()
                return
            await grew.wait()

    # --- start and stop -----------------------------------------------------------------------

    async def start(self, options: ShareOptions) -> ShareView:
        """Share with ``options``; the running share when it has the same ones (it is
        joined). Returns once the provider serves and its start is reported."""
        async with self._starting:
            if self.agent is not None:
                if options != self.options:
                    assert self.options is not None
                    raise InUseError(
                        f"this home already shares with {self.options.describe()}: follow it "
                        "with `gpumesh share` (no options), or stop it with `gpumesh share "
                        "stop` and share again with the options you want"
                    )
                return self.view()
            cap = options.check()
            require_linux()

            publish.check(self.node.home.config, options.public)
            await self._start(options, cap)
            return self.view()

    async def _start(self, options: ShareOptions, cap: int | None) -> None:
        # The provider (Docker's client, NVML, the services) loads when a share first
        # starts: a node process that only consumes never holds it.
        from gpumesh.agent.server import Agent

        self.node.home.reload_config()  # `config set` in another process: the latest
        agent = Agent(self.node.home, host=options.host, port=options.port, max_vram=cap)
        agent.jobs.report = lambda line: self.say(f"  {line}")
        host, port = (await agent.start())[:2]
        self._udp = f"{host}:{port}"
        self.agent, self.options, self.since, self.ended = agent, options, time.time(), None
        self.first_line = self._seq + 1
        self.on_change()
        try:
            await self._report(agent)

            self._publishing = await publish.start(self.node, agent, options, self.say)
        except BaseException:
            self._end("it failed to start")
            raise
        pause = self.node.home.store.paused()
        if pause is not None:
            since = time.strftime("%Y-%m-%d %H:%M", time.localtime(pause.since))
            self.say(
                f"Paused by the owner since {since}: peers get nothing until `gpumesh resume`",
                err=True,
                tone="warn",
            )
        self.say(
            "Only paired, allowed peers are served. Pairing code for a new peer (valid 1 hour):"
        )
        self.say(self.node.pairing_code())
        self._task = asyncio.ensure_future(self._until_stopped(agent))

    async def _until_stopped(self, agent: Agent) -> None:
        await agent.wait_stopped()
        publishing, self._publishing = self._publishing, None
        if publishing is not None:
            await publishing.stop()
        self._end(self._how or "stopped")

    async def stop(self, how: str = "stopped with `gpumesh share stop`") -> bool:
        """Stop sharing; False when this home did not share. A start under way
        finishes first (a Ctrl-C while it starts stops what it started)."""
        async with self._starting:
            agent = self.agent
        if agent is None:
            return False
        self._how = how
        agent.stop()
        if self._task is not None:
            await asyncio.shield(self._task)
        return True

    def _end(self, how: str) -> None:
        if self.agent is None:
            return
        self.agent.stop()
        self.agent = None
        self._task = None
        self._how = ""
        self.ended = ShareEnd(time.time(), how)
        self.on_change()
        self.say("Stopped sharing.", err=True)

    # --- the start's report ----------------------------------------------------------------

    async def _report(self, agent: Agent) -> None:
        info = self.node.info()
        host, port = agent.address[:2]
        self.say(f"Sharing {info.name} ({info.node_id.short}) on udp {host}:{port}")
        inventory = agent.gpus.inventory
        gpus = inventory.gpus()
        if inventory.source == "simulated":
            self.say("WARNING: SIMULATED GPUs (test mode, not real hardware)", tone="alarm")
        for gpu in gpus:
            self.say(
                f"  GPU {gpu.index}: {gpu.name}, {format_size(gpu.memory_total)} "
                f"({format_size(gpu.memory_free)} free)"
            )
        if not gpus:
            self.say("  no NVIDIA GPU here: peers can run CPU-only jobs (without --gpu-memory)")
        elif agent.jobs.no_gpu_runtime:
            self.say(f"  {NO_GPU_RUNTIME_NOTE}", err=True, tone="warn")
        await self._report_job_user(agent)
        network = agent.containers.network()
        cap = agent.gpus.max_vram
        vram = f"; GPU memory at most {format_size(cap)} a job" if cap else ""
        self.say(
            f"  limits: {agent.share_limits().describe()}{vram}; job network {network.mode} "
            f"({describe_mode(network.mode)})"
        )
        if agent.relay is not None:
            await self._report_relay(agent)

    async def _report_relay(self, agent: Agent) -> None:
        relay = agent.relay
        assert relay is not None
        with contextlib.suppress(GPUMeshError):
            await relay.wait_registered(RELAY_WAIT)
        if relay.registered.is_set():
            self.say(f"  relay {relay.label}: registered, seen as {relay.observed}")
            return
        why = relay.error.message if relay.error else "no answer yet"
        self.say(f"  relay {relay.label}: not registered ({why}); retrying", err=True, tone="warn")

    async def _report_job_user(self, agent: Agent) -> None:
        """Who peers' jobs run as here; loudly when it is root (job_root on)."""
        try:
            who = await agent.containers.who_runs(str(agent.home.config.get("image")))
        except ConfigError as exc:
            self.say(f"WARNING: {exc.message}", err=True, tone="warn")
            return
        except GPUMeshError:
            return  # no Docker: jobs are refused with their own clear message
        if who.user.startswith("0:") and who.owner == (0, 0):
            self.say(
                "WARNING: job_root is on: peers' jobs run as ROOT in their containers, with a "
                "writable root filesystem"
                + ("" if who.storage_size else " of unbounded size")
                + "; root in a container shares this machine's kernel. Turn it off with "
                "`gpumesh config set job_root off`, or use Docker's userns-remap",
                err=True,
                tone="alarm",
            )
            return
        inside = "root in a remapped user namespace" if who.user.startswith("0:") else who.user
        bound = "bounded" if who.storage_size else "unbounded"
        root = f"writable, {bound}" if who.writable_root else "read-only"
        self.say(f"  jobs run as {inside} (host uid {who.owner[0]}), root filesystem {root}")

    # --- the owner takes the machine back ---------------------------------------------------

    async def pause(self, grace: float) -> PauseView:
        """The owner takes the machine back until :meth:`resume` (``gpumesh pause``):
        returns once the guests' jobs are stopped (see :meth:`Agent.pause`)."""
        if not 0 <= grace <= MAX_GRACE:
            raise ConfigError(
                f"invalid grace {grace:g}s: give a duration from 0s to {MAX_GRACE // 3600:.0f}h"
            )
        agent = self.agent
        if agent is None:
            raise NotFoundError(
                "this node does not share, so no peer uses it: there is nothing to pause "
                "(`gpumesh share` starts sharing)"
            )
        was = self.node.home.store.paused()
        done = await agent.pause(grace)
        pause = done.pause
        if was is None or done.jobs or done.sessions:
            jobs = f"{len(done.jobs)} guest job{'s' if len(done.jobs) != 1 else ''} preempted"
            self.say(
                f"Paused by the owner: {jobs}, {done.sessions} session(s) ended; peers get "
                "nothing until `gpumesh resume`",
                err=True,
                tone="warn",
            )
        return PauseView(True, was is None, pause.since, pause.grace, done.jobs, done.sessions)

    def resume(self) -> PauseView:
        """Offer the machine to peers again (``gpumesh resume``); a pause outlives the
        share and the process, so this needs no share running."""
        resumed = self.node.home.store.resume()
        if resumed and self.active:
            self.say("Resumed by the owner: peers may use this machine again")
        return PauseView(False, resumed)

    def republish(self) -> bool:
        """Refresh the registry listing or address record now; False when nothing is
        published (not sharing, or sharing publishes nothing)."""
        if self._publishing is None:
            return False
        self._publishing.publisher.refresh_now()
        return True


def require_linux() -> None:
    """The provider runs Docker jobs with NVIDIA's runtime and Linux's sandboxing
    (openat2, /proc, unix sockets): elsewhere, say so before anything starts."""

    if platform.system() != "linux":
        raise RuntimeUnavailableError(
            f"`gpumesh share` needs Linux (this is {platform.system_name()}): a provider "
            "runs jobs in Docker with NVIDIA's runtime on Linux. This machine works as a consumer "
            "(pair, run, cp, exec, app); share from a Linux machine"
        )
