"""The provider's CUDA sessions: ``CudaOpen`` starts a worker process for one peer.

Owns CUDA sessions on this node. A session is offered only while the owner
shares CUDA (``gpumesh cuda share``, remembered in the store) and only to peers
on the CUDA allowlist (``cuda allow``), which is separate from the peer
allowlist and empty by default. Its device memory is reserved in the shared
GPU allocator before the worker starts (so ``status``, placement and
``max_vram`` see it), on the GPU the worker is then limited to; on a machine
without a GPU the session runs on the host-memory fallback with its memory
held in the same books on no GPU.

Each session runs in its own process (:mod:`gpumesh.agent.cudaworker`): the agent
only pumps the call protocol's bytes between the consumer's stream and the
worker's pipes, so a CUDA fault or a crash there ends that session with one
line to the consumer, never the agent. Its memory counts against
``share_memory`` with the jobs and shells (:class:`~gpumesh.agent.limits.Admission`);
the worker starts with a clean environment and confines itself
(:mod:`gpumesh.agent.cudaconfine`): no new privileges, ``job_user``'s ids when the
agent is root, and on the fallback an address-space ceiling of its memory.
The session ends, and its memory is freed and given back, when the consumer
finishes its stream, when its link goes, when the owner revokes (``cuda
deny``, ``deny``, ``cuda share stop``: :meth:`CudaService.revoke`) and when
the agent stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gpumesh.agent.cudaconfine import worker_ids
from gpumesh.agent.deps import Handlers, Provider, RequestContext, Settings
from gpumesh.agent.gpus import GpuAllocator, Holder, HolderKind
from gpumesh.agent.limits import Admission
from gpumesh.blocking import in_thread
from gpumesh.errors import (
    AccessDeniedError,
    AgentError,
    ConnectionLostError,
    CudaError,
    GPUMeshError,
    LimitError,
    ProtocolError,
)
from gpumesh.protocol.cuda import FrameDecoder, decode_end
from gpumesh.protocol.cuda import FrameKind as CudaFrameKind
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import CudaOpen, CudaOpened
from gpumesh.units import format_size

if TYPE_CHECKING:
    from gpumesh.store.peers import Peer
    from gpumesh.transport.stream import Stream

__all__ = ["CudaAccess", "CudaService", "CudaSession", "worker_argv", "worker_environment"]

logger = logging.getLogger(__name__)

CALL_PROTOCOL = 1
"""The CUDA call protocol this node's worker speaks (:data:`gpumesh.protocol.cuda.VERSION`)."""
MAX_SESSIONS_PER_PEER = 4
FALLBACK_CEILING = 4 * 1024**3
"""Most host memory one host-memory fallback session may hold."""
START_TIMEOUT = 60.0
"""How long a worker may take to open its device (cuInit can be slow)."""
_WORKER_PATH = "/usr/local/bin:/usr/bin:/bin"
_PASSED_ON = ("PYTHONPATH", "LD_LIBRARY_PATH")
_PIPE_CHUNK = 1024 * 1024
_PIPE_LIMIT = 4 * _PIPE_CHUNK
"""What the worker's output may buffer here before reading it pauses: a copy's
chunks come out in 1 MiB reads, not 64 KiB ones."""


class CudaAccess(Protocol):
    """Who may open CUDA sessions (the store)."""

    def cuda_share(self) -> bool: ...

    def cuda_allowed(self) -> set[str]: ...

    def peers(self) -> list[Peer]: ...


@dataclass
class CudaSession:
    """One open CUDA session, as the owner's ``status`` lists it."""

    id: str
    peer: str
    """The peer's name."""
    peer_id: str
    memory: int
    backend: str
    device: str
    gpus: list[str]
    started: float
    process: asyncio.subprocess.Process = field(repr=False)
    ended_because: str = ""
    """Set when the owner ended it (the consumer is told this line)."""

    def end(self, reason: str) -> None:
        """End the session now (its worker is killed; its memory goes with it)."""
        if not self.ended_because:
            self.ended_because = reason
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "peer": self.peer,
            "memory": self.memory,
            "backend": self.backend,
            "device": self.device,
            "gpus": self.gpus,
            "started": self.started,
            "pid": self.process.pid,
        }


class CudaService:
    """The CUDA sessions of one agent."""

    def __init__(
        self,
        provider: Provider,
        access: CudaAccess,
        gpus: GpuAllocator,
        admission: Admission,
        settings: Settings,
        *,
        backend: str = "auto",
    ) -> None:
        self.provider = provider
        self.access = access
        self.gpus = gpus
        self.admission = admission
        """Holds each session's memory within ``share_memory``, beside jobs and shells."""
        self.settings = settings
        self.backend = backend
        """What workers use: ``auto`` (the driver when libcuda loads), ``fallback``."""
        self._sessions: dict[str, CudaSession] = {}

    def register(self, handlers: Handlers) -> None:
        handlers.add(CudaOpen, self.handle_open)

    def sessions(self) -> list[CudaSession]:
        return list(self._sessions.values())

    async def revoke(self) -> None:
        """End the sessions the owner no longer allows: CUDA not shared any more, the
        peer off the CUDA allowlist, or denied altogether."""
        if not self._sessions:
            return
        sharing = self.access.cuda_share()
        allowed = self.access.cuda_allowed()
        denied = {peer.node_id for peer in self.access.peers() if not peer.allowed}
        name = self.provider.name
        for session in self.sessions():
            if not sharing:
                session.end(f"{name} stopped sharing CUDA")
            elif session.peer_id in denied:
                session.end(f"{name} has revoked your access")
            elif session.peer_id not in allowed:
                session.end(f"{name} has revoked your CUDA access")

    def end(self, session_id: str) -> bool:
        """End one session because the owner asked; False when it is not open."""
        session = self._sessions.get(session_id)
        if session is None or session.ended_because:
            return False
        session.end(f"{self.provider.name}'s owner ended your CUDA session")
        return True

    def stop(self) -> None:
        for session in self.sessions():
            session.end(f"{self.provider.name} stopped sharing")

    # --- the request ----------------------------------------------------------------------

    def _check_access(self, peer: Peer) -> None:
        name = self.provider.name
        if not self.access.cuda_share():
            raise AccessDeniedError(
                f"{name} does not share CUDA; its owner can offer it with `gpumesh cuda share`"
            )
        if peer.node_id not in self.access.cuda_allowed():
            raise AccessDeniedError(
                f"{name} has not allowed you CUDA sessions: ask its owner to run "
                f"`gpumesh cuda allow {peer.name}`"
            )

    async def handle_open(self, ctx: RequestContext, message: CudaOpen) -> None:
        peer = ctx.peer
        self._check_access(peer)
        if message.version != CALL_PROTOCOL:
            raise ProtocolError(
                f"{self.provider.name} speaks CUDA call protocol {CALL_PROTOCOL}, not "
                f"{message.version}: upgrade the older side"
            )
        open_here = sum(1 for s in self._sessions.values() if s.peer_id == peer.node_id)
        if open_here >= MAX_SESSIONS_PER_PEER:
            raise LimitError(
                f"{self.provider.name} allows {MAX_SESSIONS_PER_PEER} CUDA sessions per peer "
                f"and you have {open_here} open; close one first"
            )
        holder = Holder(HolderKind.CUDA, secrets.token_hex(6))
        gpus = await in_thread(self.gpus.inventory.gpus) if self.backend != "fallback" else []
        if not gpus:
            self._check_fallback(message.memory)
        with self.admission.cuda(peer.node_id, message.memory):
            try:
                if gpus:
                    chosen = await self.gpus.reserve(holder, message.memory)
                    backend = self.backend
                else:
                    self.gpus.hold(holder, [], message.memory)
                    chosen, backend = [], "fallback"
                await self._run(ctx, f"cuda-{holder.id}", message.memory, chosen, backend)
            finally:
                self.gpus.release(holder)

    def _check_fallback(self, memory: int) -> None:
        cap = min(FALLBACK_CEILING, self.gpus.max_vram or FALLBACK_CEILING)
        if memory > cap:
            raise LimitError(
                f"the CUDA session asks for {format_size(memory)}; {self.provider.name} has "
                f"no GPU and holds at most {format_size(cap)} per session in host memory"
            )

    async def _run(
        self, ctx: RequestContext, session_id: str, memory: int, gpus: list[str], backend: str
    ) -> None:
        process = await asyncio.create_subprocess_exec(
            *worker_argv(
                memory, backend, worker_ids(str(self.settings.get("job_user")), os.geteuid())
            ),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=worker_environment(gpus, os.environ),
            cwd="/",
            start_new_session=True,
            limit=_PIPE_LIMIT,
        )
        try:
            await self._serve(ctx, session_id, memory, gpus, process)
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            self._sessions.pop(session_id, None)

    async def _serve(
        self,
        ctx: RequestContext,
        session_id: str,
        memory: int,
        gpus: list[str],
        process: asyncio.subprocess.Process,
    ) -> None:
        assert process.stdin and process.stdout and process.stderr
        name, peer = self.provider.name, ctx.peer
        try:
            line = await asyncio.wait_for(process.stderr.readline(), START_TIMEOUT)
        except TimeoutError:
            raise AgentError(f"the CUDA worker on {name} did not start in time") from None
        try:
            described = json.loads(line)
        except ValueError:
            described = None
        if not isinstance(described, dict):
            said = _last_words(await process.stdout.read())
            await process.wait()
            why = f": {said}" if said else f" (exit {process.returncode})"
            raise CudaError(
                f"the CUDA worker on {name} could not open a device{why}; its owner can "
                "run `gpumesh cuda doctor`"
            )
        session = CudaSession(
            id=session_id,
            peer=peer.name,
            peer_id=peer.node_id,
            memory=memory,
            backend=str(described.get("backend", "")),
            device=str(described.get("device", "")),
            gpus=gpus,
            started=time.time(),
            process=process,
        )
        self._sessions[session_id] = session
        ctx.stream.send_message(
            CudaOpened(
                provider=name,
                backend=session.backend[:64],
                device=session.device[:64],
                memory=memory,
                detail=str(described.get("detail", ""))[:2048],
                gpus=gpus,
            )
        )
        logger.info(
            "[%s] opened a CUDA session (%s, %s, %s)",
            peer.name,
            session.backend,
            session.device,
            format_size(memory),
        )
        to_worker = asyncio.create_task(_to_worker(ctx.stream, process))
        from_worker = asyncio.create_task(_from_worker(ctx.stream, process))
        logs = asyncio.create_task(_log_worker(peer.name, process))
        closed = asyncio.create_task(ctx.link.wait_closed())
        exited = asyncio.create_task(process.wait())
        try:
            pending: set[asyncio.Future[Any]] = {to_worker, closed, exited}
            while exited in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if closed in done:
                    logger.info("[%s] CUDA session ended with its link", peer.name)
                    return
                if to_worker in done and to_worker.exception() is not None:
                    logger.info("[%s] CUDA session ended: %s", peer.name, to_worker.exception())
                    return
            # What the worker wrote before it ended goes out first.
            with contextlib.suppress(GPUMeshError):
                await from_worker
            code = process.returncode
            if session.ended_because:
                logger.info("[%s] CUDA session ended: %s", peer.name, session.ended_because)
                ctx.stream.refuse(AccessDeniedError(session.ended_because))
            elif code == 0:
                logger.info("[%s] CUDA session closed", peer.name)
                ctx.stream.finish()
            else:
                why = _exit_text(code)
                logger.warning("[%s] CUDA worker %s", peer.name, why)
                ctx.stream.refuse(
                    CudaError(
                        f"the CUDA worker on {name} {why}; the session and its device "
                        "memory are gone: open a new one"
                    )
                )
        finally:
            for task in (to_worker, from_worker, logs, closed, exited):
                task.cancel()


def worker_argv(memory: int, backend: str, ids: tuple[int, int] | None) -> list[str]:
    """The worker's command line: without the user's site folder (``-s``), its cap,
    backend and user."""
    argv = [sys.executable, "-s", "-m", "gpumesh.agent.cudaworker"]
    argv += ["--memory-cap", str(memory), "--backend", backend]
    if ids is not None:
        argv += ["--uid", str(ids[0]), "--gid", str(ids[1])]
    return argv


def worker_environment(gpus: list[str], agent: Mapping[str, str]) -> dict[str, str]:
    """All the environment a worker gets: none of the agent's own (its home, tokens,
    proxies, whatever the owner's shell exported) but where the agent found its
    code and libraries (``PYTHONPATH``, ``LD_LIBRARY_PATH``: a source checkout, a
    shared libpython, libcuda outside the loader's folders), and what CUDA needs."""
    env = {"PATH": _WORKER_PATH, "LANG": "C.UTF-8", "HOME": "/"}
    env.update({name: agent[name] for name in _PASSED_ON if agent.get(name)})
    if gpus:
        # The worker sees only the GPU its memory is reserved on, in NVML's order.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def _last_words(output: bytes) -> str:
    """The message of the END frame a worker wrote before it gave up, if any."""
    try:
        frames = FrameDecoder().feed(output)
    except ProtocolError:
        return ""
    ends = [frame for frame in frames if frame.kind is CudaFrameKind.END]
    return decode_end(ends[-1].body).message if ends else ""


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"crashed ({signal.Signals(-code).name})"
        except ValueError:
            return f"crashed (signal {-code})"
    return f"failed (exit {code})"


async def _to_worker(stream: Stream, process: asyncio.subprocess.Process) -> None:
    """Consumer -> worker: DATA frames to its stdin; the stream's end closes it."""
    stdin = process.stdin
    assert stdin is not None
    try:
        while (frame := await stream.read_frame()) is not None:
            if frame.kind is not FrameKind.DATA:
                raise ProtocolError("a CUDA session carries only data after CudaOpened")
            if frame.body:
                stdin.write(frame.body)
                await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        return  # the worker ended: its exit says why
    finally:
        with contextlib.suppress(Exception):
            stdin.close()


async def _from_worker(stream: Stream, process: asyncio.subprocess.Process) -> None:
    """Worker -> consumer: its stdout as DATA frames, until it ends."""
    stdout = process.stdout
    assert stdout is not None
    while data := await stdout.read(_PIPE_CHUNK):
        try:
            await stream.send_data(data)
        except GPUMeshError:
            raise
        except Exception as exc:  # the stream is gone
            raise ConnectionLostError(str(exc)) from exc


async def _log_worker(peer: str, process: asyncio.subprocess.Process) -> None:
    stderr = process.stderr
    assert stderr is not None
    while line := await stderr.readline():
        logger.info("[%s] cuda worker: %s", peer, line.decode(errors="replace").rstrip())
