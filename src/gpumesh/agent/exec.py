"""The provider's shells: ``ExecStart`` opens a program in a fresh container.

Owns exec sessions. Each one is a new locked-down container (the same limits
as a job; labelled with this node, the peer and ``kind=exec``; no host folder,
no GPU), attached before it starts so no output is missed. On the request's
stream, DATA frames then carry the terminal's bytes both ways, ``ExecResize``
messages from the consumer set the TTY size, and the provider ends with
``ExecExit`` and FIN. Never a host shell: the only program run is the one in
the container.

The container lives exactly as long as its session: it is removed when the
program exits, when the consumer's stream or link goes away (a revoked peer's
link included), and when the agent stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gpumesh.agent.containers import Containers, JobUser
from gpumesh.agent.deps import Handlers, Provider, RequestContext
from gpumesh.agent.gpus import GpuAllocator, Holder, HolderKind
from gpumesh.agent.limits import Admission
from gpumesh.blocking import abandon, in_thread
from gpumesh.errors import (
    AccessDeniedError,
    ConnectionLostError,
    ExitCode,
    GPUMeshError,
    LimitError,
    ProtocolError,
    error_from_code,
)
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.messages import (
    ExecExit,
    ExecResize,
    ExecStart,
    ExecStarted,
    Message,
    Refusal,
    decode_message,
)
from gpumesh.runtime.base import (
    KIND_EXEC,
    LABEL_KIND,
    LABEL_NODE,
    LABEL_PEER,
    ContainerSpec,
    JobRuntime,
    Terminal,
)
from gpumesh.runtime.states import shell_output_in_our_words

if TYPE_CHECKING:
    from gpumesh.store.peers import Peer
    from gpumesh.transport.stream import Stream

__all__ = ["ExecService"]

logger = logging.getLogger(__name__)

_OUTPUT_QUEUE = 16
"""Output chunks read from the container but not yet sent; bounds memory when
the consumer reads slowly (the engine then holds the rest)."""
_DRAIN_TIMEOUT = 5.0
"""After the program exits, how long its last output may take to arrive."""
_STOP_TIMEOUT = 10.0
"""How long stopping the agent waits for open shells' containers to go."""


@dataclass
class ShellSession:
    """One open shell, as the owner sees it."""

    id: str
    peer: str
    """The peer's name."""
    image: str
    container: str
    """The container's name."""
    since: float
    ended: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set when the owner ends it."""

    def describe(self) -> dict[str, str]:
        return {
            "id": self.id,
            "peer": self.peer,
            "image": self.image,
            "container": self.container,
            "since": str(self.since),
        }


class ExecService:
    """Interactive containers of one agent."""

    def __init__(
        self,
        provider: Provider,
        containers: Containers,
        admission: Admission,
        gpus: GpuAllocator,
    ) -> None:
        self.provider = provider
        self.containers = containers
        """The engine, images, user and limits: the same as jobs get."""
        self.gpus = gpus
        """The same books as jobs': a shell with a GPU holds its memory while open."""
        self.admission = admission
        """Shared with the job service: shells and jobs count against the same limits."""
        self._live: set[str] = set()
        """Containers of open sessions, removed on stop."""
        self._sessions: dict[str, ShellSession] = {}

    def register(self, handlers: Handlers) -> None:
        handlers.add(ExecStart, self.handle_start)

    @property
    def runtime(self) -> JobRuntime:
        return self.containers.runtime  # one engine connection pool per agent

    def sessions(self) -> list[ShellSession]:
        """Open shells, oldest first."""
        return sorted(self._sessions.values(), key=lambda s: s.since)

    def end(self, session_id: str) -> bool:
        """End one shell because the owner asked (its container goes, the consumer is
        told); False when it is not open."""
        session = self._sessions.get(session_id)
        if session is None or session.ended.is_set():
            return False
        session.ended.set()
        return True

    def stop(self) -> None:
        """Remove the containers of open sessions (blocking, bounded)."""
        live, self._live = list(self._live), set()
        threads = [
            threading.Thread(target=self._remove_quietly, args=(cid,), daemon=True) for cid in live
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(_STOP_TIMEOUT / max(1, len(threads)))

    def _remove_quietly(self, container_id: str) -> None:
        try:
            self.runtime.remove(container_id)
        except GPUMeshError as exc:
            logger.warning("could not remove exec container %s: %s", container_id[:12], exc)

    # --- the request ----------------------------------------------------------------------

    async def handle_start(self, ctx: RequestContext, message: ExecStart) -> None:
        for key in message.env:
            if key.upper().startswith("NVIDIA_"):
                raise LimitError(f"{key} may not be set: the provider decides GPU access")
        # Held from before the image check (no pull for a peer at its limit) until the
        # container is gone: max_shells_per_peer, and its memory within share_memory.
        with self.admission.shell(ctx.peer.node_id):
            holder = Holder(HolderKind.SHELL, secrets.token_hex(6))
            gpus = await self.gpus.reserve(holder, message.gpu_memory) if message.gpu_memory else []
            try:
                await self._open(ctx, message, gpus)
            finally:
                self.gpus.release(holder)

    async def _open(self, ctx: RequestContext, message: ExecStart, gpus: list[str]) -> None:
        who = await self.containers.prepare(
            message.image, ctx.stream if message.pull_progress else None
        )
        spec = self.container_spec(ctx.peer, message, who, gpus)
        runtime = self.runtime
        try:
            container_id = await in_thread(runtime.create_interactive, spec, message.tty)
        except GPUMeshError as exc:
            raise self.containers.in_our_name(exc) from None
        self._live.add(container_id)
        terminal: Terminal | None = None
        try:
            terminal = await in_thread(runtime.attach, container_id, message.tty)
            try:
                await in_thread(runtime.start, container_id)
            except GPUMeshError as exc:  # e.g. no NVIDIA runtime for a shell with a GPU
                raise self.containers.in_our_name(exc) from None
            if message.tty and message.rows and message.cols:
                await self._resize(container_id, message.rows, message.cols)
            ctx.stream.send_message(ExecStarted(provider=self.provider.name, gpus=gpus))
            logger.info("[%s] opened a shell in %s (%s)", ctx.peer.name, spec.name, spec.image)
            session = ShellSession(
                f"shell-{secrets.token_hex(6)}", ctx.peer.name, spec.image, spec.name, time.time()
            )
            self._sessions[session.id] = session
            try:
                exit_code = await self._serve(
                    ctx, container_id, terminal, message.tty, session.ended, spec.image
                )
            except ConnectionLostError as exc:
                # The consumer went away: nobody to answer; the container goes below.
                logger.info("[%s] left the shell in %s: %s", ctx.peer.name, spec.name, exc)
                return
            finally:
                self._sessions.pop(session.id, None)
            if exit_code is None:
                logger.info("[%s] shell in %s ended by the owner", ctx.peer.name, spec.name)
                raise AccessDeniedError(f"{self.provider.name}'s owner ended your shell")
            ctx.stream.send_message(ExecExit(exit_code=exit_code), end=True)
            logger.info("[%s] shell in %s exited %d", ctx.peer.name, spec.name, exit_code)
        finally:
            if terminal is not None:
                terminal.close()
            try:
                with contextlib.suppress(GPUMeshError):
                    await in_thread(runtime.remove, container_id)
            finally:
                self._live.discard(container_id)

    def container_spec(
        self, peer: Peer, message: ExecStart, who: JobUser, gpus: list[str] | None = None
    ) -> ContainerSpec:
        """The locked-down container for one shell: a job's limits and user, no host
        path, and the GPUs held for it (none unless it asked)."""
        return ContainerSpec(
            image=message.image,
            command=list(message.command),
            env=dict(message.env),
            labels={
                LABEL_PEER: peer.node_id,
                LABEL_NODE: self.provider.node_id,
                LABEL_KIND: KIND_EXEC,
            },
            name=f"gpumesh-exec-{secrets.token_hex(6)}",
            **asdict(self.containers.limits()),
            user=who.user,
            writable_root=who.writable_root,
            storage_size=who.storage_size,
            gpu_ids=list(gpus or []),
        )

    async def _resize(self, container_id: str, rows: int, cols: int) -> None:
        try:
            await in_thread(self.runtime.resize, container_id, rows, cols)
        except GPUMeshError as exc:  # e.g. the program just exited: not worth failing over
            logger.debug("resize of %s failed: %s", container_id[:12], exc)

    # --- the session ------------------------------------------------------------------------

    async def _serve(
        self,
        ctx: RequestContext,
        container_id: str,
        terminal: Terminal,
        tty: bool,
        ended: asyncio.Event,
        image: str,
    ) -> int | None:
        """Pump bytes both ways until the program exits; return its exit code, or None
        when the owner ended the shell first.

        Raises ConnectionLostError when the consumer's stream or link goes away first.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=_OUTPUT_QUEUE)
        stopping = threading.Event()
        threading.Thread(
            target=_read_output,
            args=(loop, terminal, queue, stopping),
            name="gpumesh-exec-output",
            daemon=True,
        ).start()
        sender = asyncio.create_task(_send_output(ctx.stream, queue, image))
        receiver = asyncio.create_task(self._receive_input(ctx.stream, container_id, terminal, tty))
        closed = asyncio.create_task(ctx.link.wait_closed())
        owner = asyncio.create_task(ended.wait())
        waiter = in_thread(self.runtime.wait, container_id)
        pending: set[asyncio.Future[Any]] = {sender, receiver, closed, owner, waiter}
        try:
            while waiter in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if closed in done:
                    raise ConnectionLostError("the link closed")
                if owner in done:
                    return None
                for task in done - {waiter, owner}:
                    task.result()  # raises when the consumer's stream failed
            state = waiter.result()
            # The attach stream ends with the program: let its last output through.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(sender), _DRAIN_TIMEOUT)
            if state.error and state.exit_code in (ExitCode.NOT_EXECUTABLE, ExitCode.NOT_FOUND):
                newline = b"\r\n" if tty else b"\n"
                await ctx.stream.send_data(f"gpumesh: {state.error}".encode() + newline)
            if state.oom_killed:
                logger.info("shell container %s ran out of memory", container_id[:12])
            return state.exit_code if state.exit_code is not None else ExitCode.JOB_NOT_RUN
        finally:
            stopping.set()
            for task in (sender, receiver, closed, owner):
                task.cancel()
            abandon(waiter)  # the owner ended the session, or the consumer went away

    async def _receive_input(
        self, stream: Stream, container_id: str, terminal: Terminal, tty: bool
    ) -> None:
        """Consumer -> container: DATA to stdin, ExecResize to the TTY."""
        input_open = True
        while True:
            frame = await stream.read_frame()
            if frame is None or (frame.kind is FrameKind.DATA and not frame.body):
                # The consumer's input ended. Without a TTY the program reads EOF;
                # with one, closing stdin would also end its output, so it stays open.
                if input_open and not tty:
                    await in_thread(terminal.close_input)
                input_open = False
                if frame is None:
                    return
                continue
            if frame.kind is FrameKind.MESSAGE:
                message = decode_message(frame.body)
                if isinstance(message, ExecResize):
                    if tty:
                        await self._resize(container_id, message.rows, message.cols)
                    continue
                _unexpected(message)
            if input_open:
                try:
                    await in_thread(terminal.write, frame.body)
                except GPUMeshError:
                    input_open = False  # the program closed its stdin: drop what follows


def _unexpected(message: Message) -> None:
    if isinstance(message, Refusal):
        raise error_from_code(message.code, message.message)
    raise ProtocolError(f"{type(message).__name__} is not part of a shell session")


def _read_output(
    loop: asyncio.AbstractEventLoop,
    terminal: Terminal,
    queue: asyncio.Queue[bytes],
    stopping: threading.Event,
) -> None:
    """Container -> queue, in a daemon thread (reads block); ``b""`` marks the end."""
    try:
        while not stopping.is_set():
            data = terminal.read()
            put = asyncio.run_coroutine_threadsafe(queue.put(data), loop)
            while True:
                try:
                    put.result(timeout=0.5)
                    break
                except concurrent.futures.TimeoutError:
                    if stopping.is_set():  # the session ended with the queue full
                        put.cancel()
                        return
            if not data:
                return
    except (RuntimeError, concurrent.futures.CancelledError):
        return  # the loop is gone (the agent stopped): nothing left to feed


async def _send_output(stream: Stream, queue: asyncio.Queue[bytes], image: str) -> None:
    first = True
    while data := await queue.get():
        if first:  # tini's line, when it could not start the command, is its first
            data, first = shell_output_in_our_words(data, image), False
        await stream.send_data(data)
