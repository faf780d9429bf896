"""Jobs from the consumer's side: run, follow logs, cancel, list.

The consumer keeps a reference to every job it submits (role ``submitted``
in its store) and updates it from the events it receives. A job's events
(output, state changes, output dropped, reconnects) come as an async iterator
(:func:`logs`, :class:`JobFollow`); :class:`JobCallbacks` adapts them for
callers that prefer callbacks (the CLI prints them, the dashboard will push
them to a browser). Events
arrive at the pace this node reads them (it asks for them credited:
:mod:`gpumesh.protocol.joboutput`). A dropped link while following is redialled
and resumed after the last event seen, so no line is lost or repeated; output
the provider dropped (its ``job_log_limit``) is told where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import shutil
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec

from gpumesh.client._events import Watch
from gpumesh.client.bulk import answer_after_offer, why_no_channel
from gpumesh.client.outputs import RECEIVING
from gpumesh.client.placement import Placement
from gpumesh.client.submit import (
    place_in_group,
    refuse_unmounted,
    send_workdir,
    session_with,
    until_received,
)
from gpumesh.client.views.jobs import JobResultView
from gpumesh.errors import (
    AgentError,
    ConnectionLostError,
    GPUMeshError,
    NotFoundError,
    ProtocolError,
    UnreachableError,
    error_from_code,
)
from gpumesh.files.hashing import offered
from gpumesh.files.pack import scan, tar_size
from gpumesh.protocol.framing import FrameKind
from gpumesh.protocol.joboutput import UNKNOWN, EventSection, OutputPosition
from gpumesh.protocol.messages import (
    ImagePull,
    JobAccepted,
    JobCancel,
    JobLogs,
    JobMount,
    JobOutput,
    JobQuery,
    JobStatus,
    JobSubmit,
    Message,
    Refusal,
    decode_message,
)
from gpumesh.protocol.states import (
    FINAL_STATES,
    OWNER_CANCELLED,
    JobRole,
    JobState,
    job_state,
)
from gpumesh.store.jobs import JobRecord

if TYPE_CHECKING:
    from gpumesh.client.bulk import NoChannel
    from gpumesh.client.jobspec import JobSpec
    from gpumesh.client.node import Node
    from gpumesh.protocol.messages import ChannelOffer
    from gpumesh.transport.session import Session
    from gpumesh.transport.stream import Stream

__all__ = [
    "FINAL",
    "HOSTED",
    "REFRESH_TIMEOUT",
    "SUBMITTED",
    "ChangeWaiter",
    "JobCallbacks",
    "JobEvent",
    "JobFollow",
    "JobResult",
    "Output",
    "OutputDropped",
    "Reconnecting",
    "StatusChanged",
    "Unconfirmed",
    "cancel",
    "cancel_hosted",
    "cancel_job",
    "find_job",
    "follow_job",
    "logs",
    "new_job_id",
    "prune_jobs",
    "refresh_jobs",
    "run_job",
]

logger = logging.getLogger(__name__)

SUBMITTED = JobRole.SUBMITTED
HOSTED = JobRole.HOSTED
FINAL = FINAL_STATES
_RECONNECT_FOR = 60.0
"""How long a follower keeps redialling a provider that dropped."""
REFRESH_TIMEOUT = 3.0
"""How long a listing waits, in all, for providers to say where their jobs stand."""
_REREAD = 5.0
"""Seconds a follower of a hosted job in the agent's process waits to be told of
events before it re-reads anyway."""
_POLL = 0.2
"""Seconds between reads of a hosted job's events by a follower in another process
(the agent runs in the node process, and tells its own followers)."""


def new_job_id() -> str:
    return secrets.token_hex(6)


def _ignore(*_args: object) -> None:
    return None


@dataclass
class JobCallbacks:
    """Where a followed job's events go."""

    stdout: Callable[[bytes], None] = _ignore
    stderr: Callable[[bytes], None] = _ignore
    status: Callable[[JobStatus], None] = _ignore
    accepted: Callable[[JobAccepted], None] = _ignore
    pull: Callable[[ImagePull], None] = _ignore
    """How the provider's pull of the job's image goes, before it accepts the job."""
    upload: Callable[[int, int], None] = _ignore
    """(bytes sent, total) while the workdir uploads."""
    placed: Callable[[Placement], None] = _ignore
    """Where ``run --group`` put the job, and why not elsewhere."""
    reconnecting: Callable[[GPUMeshError], None] = _ignore
    dropped: Callable[[int], None] = _ignore
    """Bytes of output the provider dropped (beyond its ``job_log_limit``, the oldest
    first) that this reader was never sent, just before the output that comes next."""


@dataclass(frozen=True)
class Output:
    """Bytes the job wrote."""

    stream: str
    """``stdout`` or ``stderr``."""
    data: bytes


@dataclass(frozen=True)
class StatusChanged:
    """The job entered a state (or began an attempt)."""

    status: JobStatus
    exited: bool
    """The attempt's program exited on its own: ``status.message`` only repeats its
    exit code (else it says why the job ended: a timeout, a cancel, an error)."""

    @classmethod
    def of(cls, status: JobStatus) -> StatusChanged:
        if status.exited is not None:
            return cls(status, status.exited)
        # A provider (or a stored event) from before JobStatus.exited: its message
        # then said "exited N" exactly when the program exited on its own.
        return cls(status, status.message.startswith("exited "))

    @property
    def state(self) -> JobState:
        return job_state(self.status.state)


@dataclass(frozen=True)
class OutputDropped:
    """Bytes of output the provider dropped (beyond its ``job_log_limit``, the oldest
    first) that this reader was never sent, just before the output that comes next."""

    count: int


@dataclass(frozen=True)
class Reconnecting:
    """The link to the provider dropped; the follow redials and resumes."""

    error: GPUMeshError


JobEvent = Output | StatusChanged | OutputDropped | Reconnecting
"""What following a job yields."""


@dataclass
class JobResult:
    job_id: str
    peer: str
    state: JobState
    exit_code: int | None
    attempt: int
    message: str
    gpus: list[str] = field(default_factory=list)
    output_dropped: int = 0
    """Bytes of the job's oldest output its provider dropped, as far as known."""
    workdir_channel: str = ""
    """What carried the workdir: ``tls`` (the data channel), ``quic``, or empty (none)."""
    workdir_no_channel: str = ""
    """With ``quic``: why not the data channel (see :class:`gpumesh.client.bulk.NoChannel`)."""
    role: JobRole = JobRole.SUBMITTED
    """Whether this node submitted the job or hosts it."""

    @classmethod
    def of_record(cls, job: JobRecord) -> JobResult:
        """Where a job stands as this node's store last recorded it."""
        return cls(
            job.job_id,
            job.peer_name,
            job.state,
            job.exit_code,
            job.attempt,
            job.message,
            list(job.gpus),
            job.output_dropped,
            role=job.role,
        )

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


@dataclass
class _Reader:
    """How far a consumer got in a job's events, so a resumed follow neither loses
    nor repeats anything."""

    seq: int = 0
    """The last event received."""
    output: OutputPosition = field(default_factory=OutputPosition)


async def run_job(
    node: Node,
    spec: JobSpec,
    *,
    detach: bool = False,
    callbacks: JobCallbacks | None = None,
    job_id: str | None = None,
    wait: float = 0.0,
    sandbox_dir: str = "",
    reuse: Session | None = None,
) -> JobResult:
    """Submit ``spec`` to its peer (or the best member of its group); unless
    ``detach``, follow it to the end. ``wait``: seconds a group placement may
    wait for a member to free up. ``sandbox_dir``: a folder in the peer's
    sandbox to run in (``gpumesh app run``) instead of an uploaded workdir.
    ``reuse``: an open session with ``spec.peer`` to submit on (left open)."""
    callbacks = callbacks or JobCallbacks()
    preferred_gpu = ""
    if spec.group is not None:
        placement = await place_in_group(node, spec.group, spec.gpu_memory, wait=wait)
        callbacks.placed(placement)
        assert placement.chosen is not None
        spec = dataclasses.replace(spec, peer=placement.chosen.name, group=None)
        if placement.chosen.gpu is not None:
            preferred_gpu = str(placement.chosen.gpu.index)
    if spec.peer is None:
        raise NotFoundError("no peer given: use --peer NAME (or set GPUMESH_PEER)")
    peer = node.peer(spec.peer)
    image = spec.image or str(node.home.config.get("image"))
    plan = None
    workdir_bytes = 0
    if spec.workdir is not None:
        plan = scan(spec.workdir, exclude_paths=[node.home.path])
        workdir_bytes = tar_size(plan)
    job_id = job_id or new_job_id()
    submit = JobSubmit(
        job_id=job_id,
        image=image,
        command=list(spec.command),
        env=dict(spec.env),
        workdir_bytes=workdir_bytes,
        gpu_memory=spec.gpu_memory,
        retries=spec.retries,
        timeout=spec.timeout,
        attach=not detach,
        gpu=preferred_gpu,
        sandbox_dir=sandbox_dir,
        credited=True,
        mounts=[JobMount(source=m.source, target=m.target, rw=m.rw) for m in spec.mounts],
        pull_progress=True,
        knows_preempted=True,
        outputs=spec.outputs,
    )
    store = node.home.store
    result = JobResult(job_id, peer.name, JobState.QUEUED, None, 0, "")

    async def submitted(
        session: Session,
    ) -> tuple[Stream, ChannelOffer | None, JobAccepted, NoChannel | None]:
        # Safe to send twice: a provider that has the job id accepts it again and
        # follows it from its first event; it never starts a second copy.
        no_channel = why_no_channel(node, peer, session) if plan is not None else None
        sent = submit
        if plan is not None and no_channel is None:
            sent = msgspec.structs.replace(submit, channel=True, hashes=offered())
        stream = session.open_stream()
        stream.send_message(sent)
        offer, accepted = await answer_after_offer(stream, JobAccepted, None, callbacks.pull)
        return stream, offer, accepted, no_channel

    async with session_with(node, peer, reuse, submitted) as (session, answered):
        stream, offer, accepted, no_channel = answered
        if list(accepted.mounts) != [m.target for m in spec.mounts]:
            await refuse_unmounted(session, peer.name, job_id, stream)
        if accepted.outputs != spec.outputs:
            await refuse_unmounted(session, peer.name, job_id, stream, "outputs")
        result.gpus = list(accepted.gpus)
        store.add_job(
            JobRecord(
                role=SUBMITTED,
                job_id=job_id,
                peer_id=peer.node_id,
                peer_name=peer.name,
                image=image,
                command=list(spec.command),
                env=dict(spec.env),
                gpu_memory=spec.gpu_memory,
                gpus=list(accepted.gpus),
                retries=spec.retries,
                timeout=spec.timeout,
                workdir=str(spec.workdir or ""),
                created_at=(now := time.time()),
                confirmed_at=now,
                mounts=[dataclasses.asdict(m) for m in spec.mounts],
                outputs=spec.outputs,
                outputs_to=str(outputs_destination(spec, job_id)) if spec.outputs else "",
                outputs_state=RECEIVING if spec.outputs else "",
            )
        )
        if spec.outputs and node.outputs is not None:
            node.outputs.start(job_id)
        callbacks.accepted(accepted)
        if plan is not None:
            await send_workdir(
                node,
                session,
                peer,
                stream,
                (offer, no_channel),
                plan,
                workdir_bytes,
                callbacks,
                result,
            )
        if detach:
            stream.finish()
            if plan is not None:
                await until_received(stream)
            return result
        reader = _Reader()
        try:
            await _deliver_all(_consume(stream, node, result, reader), callbacks)
        except (ConnectionLostError, UnreachableError) as exc:
            if result.final:
                return result
            callbacks.reconnecting(exc)
        else:
            return result
    # Go on from the last event this stream delivered: not from the start again.
    await _deliver_all(_follow(node, peer.node_id, result, reader, follow=True), callbacks)
    return result


def outputs_destination(spec: JobSpec, job_id: str) -> Path:
    """Where a job's outputs go: ``outputs_to``, else ``JOB_ID`` under ``outputs_under``
    (``./gpumesh-outputs`` of this process when neither is given)."""
    if spec.outputs_to is not None:
        return spec.outputs_to
    under = spec.outputs_under or Path.cwd() / "gpumesh-outputs"
    return under / job_id


async def _deliver_all(events: AsyncGenerator[JobEvent, None], callbacks: JobCallbacks) -> None:
    """The callbacks as an adapter over an iterator of events."""
    async with contextlib.aclosing(events) as each:
        async for event in each:
            if isinstance(event, Output):
                (callbacks.stdout if event.stream == "stdout" else callbacks.stderr)(event.data)
            elif isinstance(event, StatusChanged):
                callbacks.status(event.status)
            elif isinstance(event, OutputDropped):
                callbacks.dropped(event.count)
            else:
                callbacks.reconnecting(event.error)


async def _consume(
    stream: Stream, node: Node, result: JobResult, reader: _Reader
) -> AsyncGenerator[JobEvent, None]:
    """Yield events until the provider ends the stream, moving ``reader`` along.

    Events come inside a credited section (DATA frames: credit goes back as each
    is read, so the provider waits for us) or, from an older provider, as plain
    messages.
    """
    store = node.home.store
    section = EventSection()
    while True:
        frame = await stream.read_frame()
        if frame is None:
            break
        messages: list[Message]
        if frame.kind is FrameKind.MESSAGE:
            messages = [decode_message(frame.body)]
        elif frame.body:
            messages = section.feed(frame.body)
        else:
            section.end()
            continue
        for message in messages:
            for event in _deliver(node, message, result, reader):
                yield event
        store.update_job(
            SUBMITTED, result.job_id, last_seq=reader.seq, output_dropped=result.output_dropped
        )


def _deliver(node: Node, message: Message, result: JobResult, reader: _Reader) -> list[JobEvent]:
    if isinstance(message, Refusal):
        raise error_from_code(message.code, message.message)
    if isinstance(message, JobOutput):
        if message.seq <= reader.seq:
            return []  # already delivered
        reader.seq = message.seq
        events: list[JobEvent] = []
        dropped = reader.output.on_output(message.offset, len(message.data))
        if dropped:
            result.output_dropped = max(result.output_dropped, reader.output.known_dropped)
            events.append(OutputDropped(dropped))
        events.append(Output(message.stream, message.data))
        return events
    if isinstance(message, JobStatus):
        if message.seq and message.seq <= reader.seq:
            return []
        reader.seq = max(reader.seq, message.seq)
        result.state = job_state(message.state)
        result.attempt = message.attempt
        result.exit_code = message.exit_code
        result.message = message.message
        _record_status(node, result.job_id, message)
        return [StatusChanged.of(message)]
    raise ProtocolError(f"unexpected {type(message).__name__} in a job's event stream")


def _record_status(node: Node, job_id: str, status: JobStatus) -> None:
    fields: dict[str, object] = {
        "state": job_state(status.state),
        "attempt": status.attempt,
        "message": status.message,
        "confirmed_at": time.time(),
    }
    if status.exit_code is not None:
        fields["exit_code"] = status.exit_code
    if status.peak_gpu_memory:
        fields["peak_gpu_memory"] = status.peak_gpu_memory
    job = node.home.store.job(SUBMITTED, job_id)
    when = status.time or time.time()
    if job is not None:
        if status.started:
            fields["started_at"] = status.started
        elif status.state == JobState.RUNNING and job.started_at is None:
            fields["started_at"] = when
        if status.state in FINAL_STATES:
            fields["finished_at"] = when
    node.home.store.update_job(SUBMITTED, job_id, **fields)


class JobFollow(Watch[JobEvent]):
    """A job's events, to read with ``async for`` (once); ``result`` is where the job
    stands, updated as events arrive (final once the events of an ended job ran out)."""

    def __init__(
        self,
        job: JobRecord,
        result: JobResult,
        events: AsyncGenerator[JobEvent, None],
        reader: _Reader | None = None,
    ) -> None:
        self.job = job
        self.result = result
        self._events = events
        self._reader = reader or _Reader()

    @property
    def seq(self) -> int:
        """The sequence number of the last event read (0: none yet). A follow started
        with ``after_seq`` set to it resumes right after, with nothing lost or repeated."""
        return self._reader.seq

    def view(self) -> JobResultView:
        """Where the job stood when last seen, as ``gpumesh.Mesh`` returns it."""
        return JobResultView.of(self.result)


class ChangeWaiter(Protocol):
    """What an in-process follower of hosted jobs waits on: the agent's job service."""

    async def wait_changed(self, timeout: float) -> None:
        """Return when a hosted job gets events, or after ``timeout`` seconds."""


def find_job(node: Node, job_id: str | None = None) -> JobRecord:
    """The job ``job_id`` names (an id or a unique prefix; submitted or hosted), or
    with None the most recent one."""
    store = node.home.store
    if job_id is not None:
        return store.find_job(job_id)
    recent = store.jobs(limit=1)
    if not recent:
        raise NotFoundError("no jobs yet: start one with `gpumesh run`")
    return recent[0]


def logs(
    node: Node,
    job_id: str | None = None,
    *,
    follow: bool = False,
    changes: ChangeWaiter | None = None,
    after_seq: int = 0,
) -> JobFollow:
    """A job's events from its start (the most recent job when ``job_id`` is None):
    a job this node submitted from its provider, one it hosts from its own store.
    ``follow``: until the job ends. ``changes``: in the agent's own process, its job
    service (else hosted jobs are woken by the agent through a socket).
    ``after_seq``: start after that event (a :attr:`JobFollow.seq` read before)."""
    job = find_job(node, job_id)
    if job.role == SUBMITTED:
        return _submitted_follow(node, job, follow=follow, after_seq=after_seq)
    result = JobResult.of_record(job)
    reader = _Reader(after_seq, OutputPosition(0 if after_seq == 0 else UNKNOWN))
    events = _hosted(node, job, result, reader, follow=follow, changes=changes)
    return JobFollow(job, result, events, reader)


def _submitted_follow(node: Node, job: JobRecord, *, follow: bool, after_seq: int) -> JobFollow:
    result = JobResult(
        job.job_id,
        job.peer_name,
        job.state,
        job.exit_code,
        job.attempt,
        job.message,
        output_dropped=job.output_dropped,
    )
    # From the start, a gap before the first output is output dropped; from
    # further on, where the output stood is not known here.
    reader = _Reader(after_seq, OutputPosition(0 if after_seq == 0 else UNKNOWN))
    return JobFollow(job, result, _follow(node, job.peer_id, result, reader, follow=follow), reader)


async def follow_job(
    node: Node,
    job_id: str,
    *,
    follow: bool = True,
    after_seq: int = 0,
    callbacks: JobCallbacks | None = None,
) -> JobResult:
    """Stream a submitted job's events from its provider, redialling on drops."""
    job = node.home.store.find_job(job_id, role=SUBMITTED)
    events = _submitted_follow(node, job, follow=follow, after_seq=after_seq)
    await _deliver_all(events._events, callbacks or JobCallbacks())
    return events.result


async def _follow(
    node: Node, peer_id: str, result: JobResult, reader: _Reader, *, follow: bool
) -> AsyncGenerator[JobEvent, None]:
    deadline = time.monotonic() + _RECONNECT_FOR
    while True:
        try:
            async with node.live_session(peer_id) as session:
                deadline = time.monotonic() + _RECONNECT_FOR  # from the last working link
                stream = session.open_stream()
                # Our side stays open: it carries the credit back.
                stream.send_message(
                    JobLogs(
                        job_id=result.job_id,
                        after_seq=reader.seq,
                        follow=follow,
                        credited=True,
                        knows_preempted=True,
                    )
                )
                async with contextlib.aclosing(_consume(stream, node, result, reader)) as events:
                    async for event in events:
                        yield event
                return
        except (ConnectionLostError, UnreachableError) as exc:
            if result.final or time.monotonic() > deadline:
                raise
            yield Reconnecting(exc)
            await asyncio.sleep(1.0)


async def cancel(node: Node, job_id: str, *, peer: str | None = None) -> JobResult:
    """Cancel a job by its id (or a unique prefix): one this node submitted (its
    provider stops it), or, without ``peer``, one a peer runs here (this home's
    `gpumesh share` stops it). ``peer``: the provider, for a job not in this store."""
    store = node.home.store
    if peer is not None:
        return await cancel_job(node, peer, job_id)
    try:
        job = store.find_job(job_id, role=SUBMITTED)
    except NotFoundError:
        try:
            hosted = store.find_job(job_id, role=HOSTED)
        except NotFoundError:
            raise NotFoundError(
                f"no job {job_id!r} submitted from here or hosted here: see `gpumesh "
                "jobs`, or give the provider of a job you submitted with --peer"
            ) from None
        return await cancel_hosted(node, hosted.job_id)
    return await cancel_job(node, job.peer_id, job.job_id)


async def cancel_job(node: Node, peer_query: str, job_id: str) -> JobResult:
    """Ask the provider to cancel a job this node submitted."""
    peer = node.peer(peer_query)
    with contextlib.suppress(NotFoundError):
        job_id = node.home.store.find_job(job_id, role=SUBMITTED).job_id

    async def ask(session: Session) -> Message:
        # Safe to send twice: a job cancelled already is answered with its end.
        return await session.request(JobCancel(job_id=job_id, knows_preempted=True), timeout=60)

    reply = await node.on_session(peer.node_id, ask)
    if not isinstance(reply, JobStatus):
        raise ProtocolError(f"{peer.name} answered a cancel with {type(reply).__name__}")
    result = JobResult(
        reply.job_id,
        peer.name,
        job_state(reply.state, peer.name),
        reply.exit_code,
        reply.attempt,
        reply.message,
    )
    if node.home.store.job(SUBMITTED, reply.job_id) is not None:
        _record_status(node, reply.job_id, reply)
    return result


@dataclass(frozen=True)
class Unconfirmed:
    """A provider that did not say where some of its jobs stand this time: they keep
    the state it last confirmed (``JobRecord.confirmed_at``)."""

    peer: str
    reason: str
    job_ids: frozenset[str]


class SilentProviders:
    """The providers of unfinished jobs that did not say where their jobs stand
    the last time they were asked, and why (one per :class:`~gpumesh.client.node.Node`,
    so in the node process one for its life).

    A listing does not wait on them again: their jobs keep the state last
    confirmed, with that reason, while they are asked again in the background
    (one question at a time each); the first answer takes them off the list.
    The node process's warm sessions tell it of a provider whose keep-alive
    went unanswered (:attr:`~gpumesh.client.pool.SessionPool.on_silent`), so a
    provider that was switched off is not waited on even by the first listing
    after that was found; otherwise only that first listing waits."""

    def __init__(self) -> None:
        self._reasons: dict[str, str] = {}
        """Peer id -> why it did not answer."""
        self._asking: dict[str, asyncio.Task[Unconfirmed | None]] = {}

    def reason(self, peer_id: str) -> str | None:
        return self._reasons.get(peer_id)

    def went_silent(self, peer_id: str, reason: str) -> None:
        """``peer_id`` stopped answering elsewhere (its warm session's keep-alive)."""
        self._reasons[peer_id] = reason

    def heard(self, peer_id: str, answer: Unconfirmed | None) -> None:
        """What asking ``peer_id`` gave: None (it answered for every job) or not."""
        if answer is None:
            self._reasons.pop(peer_id, None)
        else:
            self._reasons[peer_id] = answer.reason

    def ask_again(self, peer_id: str, ask: Callable[[], Awaitable[Unconfirmed | None]]) -> None:
        """Ask ``peer_id`` again in the background, unless that is under way."""
        running = self._asking.get(peer_id)
        if running is not None and not running.done():
            return

        async def again() -> Unconfirmed | None:
            answer = await ask()
            self.heard(peer_id, answer)
            return answer

        self._asking[peer_id] = asyncio.get_running_loop().create_task(again())


async def refresh_jobs(
    node: Node, *, limit: int = 1000, timeout: float = REFRESH_TIMEOUT
) -> list[Unconfirmed]:
    """Ask the providers of this node's unfinished submitted jobs (of its ``limit``
    newest jobs) where they stand and
    record what they say (state, exit code, times), so a job that ended while nobody
    followed it shows as ended. One session per provider, all at once, and never
    more than ``timeout`` seconds in all; a provider that did not answer last time
    is not waited on (:class:`SilentProviders`). A job its provider no longer knows
    is marked so (``provider_forgot``) and not asked about again."""
    pending: dict[str, list[JobRecord]] = {}
    for job in node.home.store.unconfirmed_submitted_jobs(limit):
        pending.setdefault(job.peer_id, []).append(job)
    silent = node.silent_providers
    asked: dict[str, list[JobRecord]] = {}
    unconfirmed: list[Unconfirmed] = []
    for peer_id, jobs in pending.items():
        reason = silent.reason(peer_id)
        if reason is None:
            asked[peer_id] = jobs
            continue
        silent.ask_again(peer_id, functools.partial(_refresh_peer, node, jobs, timeout))
        ids = frozenset(job.job_id for job in jobs)
        unconfirmed.append(Unconfirmed(jobs[0].peer_name, reason, ids))
    answers = await asyncio.gather(*(_refresh_peer(node, jobs, timeout) for jobs in asked.values()))
    for peer_id, answer in zip(asked, answers, strict=True):
        silent.heard(peer_id, answer)
    return unconfirmed + [answer for answer in answers if answer is not None]


async def _refresh_peer(node: Node, jobs: list[JobRecord], timeout: float) -> Unconfirmed | None:
    unanswered = {job.job_id for job in jobs}
    reasons: list[str] = []

    async def query(session: Session, job_id: str) -> None:
        try:
            reply = await session.request(
                JobQuery(job_id=job_id, knows_preempted=True), timeout=timeout
            )
        except NotFoundError:
            node.home.store.update_job(SUBMITTED, job_id, provider_forgot=1)
        except ConnectionLostError:
            raise  # the whole session's: asked again on a new one (or the reason)
        except GPUMeshError as exc:
            reasons.append(exc.message)
            return
        else:
            if not isinstance(reply, JobStatus) or reply.job_id != job_id:
                reasons.append(f"answered a job query with {type(reply).__name__}")
                return
            _record_status(node, job_id, reply)
        unanswered.discard(job_id)

    async def ask(session: Session) -> None:
        # Queries only: safe to send again should a warm session die under them.
        await asyncio.gather(*(query(session, job_id) for job_id in sorted(unanswered)))

    try:
        async with asyncio.timeout(timeout):
            await node.on_session(jobs[0].peer_id, ask, timeout=timeout)
    except TimeoutError:
        reasons.append(f"no answer within {timeout:g}s")
    except GPUMeshError as exc:
        reasons.append(exc.message)
    if not unanswered:
        return None
    logger.info("jobs on %s not confirmed: %s", jobs[0].peer_name, reasons)
    return Unconfirmed(jobs[0].peer_name, reasons[0] if reasons else "", frozenset(unanswered))


async def cancel_hosted(node: Node, job_id: str, *, timeout: float = 60.0) -> JobResult:
    """Cancel a job a peer runs on this node (the owner's cancel): recorded in the
    store, carried out by this home's running agent, which is told at once."""

    store = node.home.store
    job = store.find_job(job_id, role=HOSTED)
    if job.state not in FINAL_STATES:
        store.update_job(HOSTED, job.job_id, cancel_requested=1, message=OWNER_CANCELLED)
        if not node.home.agent_changed():
            raise AgentError(
                f"no `gpumesh share` runs for {node.home.path}: job {job.job_id} is stopped "
                "when it starts (its cancel is recorded)"
            )
        deadline = time.monotonic() + timeout
        while (current := store.job(HOSTED, job.job_id)) is not None and (
            current.state not in FINAL_STATES
        ):
            if time.monotonic() > deadline:
                raise AgentError(
                    f"job {job.job_id} is still {current.state} after {timeout:.0f}s: see "
                    "`gpumesh jobs`, and the agent's log if it stays so"
                )
            await asyncio.sleep(0.1)
        job = current or job
    return JobResult.of_record(job)


async def _hosted(
    node: Node,
    job: JobRecord,
    result: JobResult,
    reader: _Reader,
    *,
    follow: bool,
    changes: ChangeWaiter | None,
) -> AsyncGenerator[JobEvent, None]:
    store = node.home.store
    while True:
        events = store.job_events(job.job_id, reader.seq, 100)
        for event in events:
            reader.seq = event.seq
            message = event.to_message()
            if isinstance(message, JobStatus):
                yield StatusChanged.of(message)
                continue
            dropped = reader.output.on_output(message.offset, len(message.data))
            if dropped:
                yield OutputDropped(dropped)
            yield Output(message.stream, message.data)
        current = store.job(HOSTED, job.job_id)
        assert current is not None
        _update(result, current)
        if events:
            continue
        if not follow or (current.state in FINAL_STATES and reader.seq >= current.last_seq):
            return
        if changes is not None:
            await changes.wait_changed(_REREAD)
        else:
            await asyncio.sleep(_POLL)


def _update(result: JobResult, job: JobRecord) -> None:
    result.state = job.state
    result.exit_code = job.exit_code
    result.attempt = job.attempt
    result.message = job.message
    result.gpus = list(job.gpus)
    result.output_dropped = job.output_dropped


def prune_jobs(node: Node, older_than: float, *, dry_run: bool = False) -> list[JobRecord]:
    """Forget finished jobs created more than ``older_than`` seconds ago.

    Hosted jobs also lose their logs and workdir on this machine. Running jobs
    are never touched; a submitted job its provider no longer knows counts as finished.
    """

    store = node.home.store
    old = store.finished_jobs_before(time.time() - older_than)
    if not dry_run:
        for job in old:
            store.delete_job(job.role, job.job_id)
            if job.role == HOSTED:
                shutil.rmtree(node.home.jobs_dir / job.job_id, ignore_errors=True)
    return old
