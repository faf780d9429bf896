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
import logging
import secrets
import shutil
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from gpumesh.client._events import Watch
from gpumesh.client.bulk import answer_after_offer, why_no_channel
from gpumesh.client.hops import HOP_SPAN, NextHop, status_of, status_problem
from gpumesh.client.outputs import RECEIVING, restore_outputs
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
    LimitError,
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
    from gpumesh.store.peers import Peer
    from gpumesh.transport.session import Session
    from gpumesh.transport.stream import Stream

__all__ = [
    "FINAL",
    "HOSTED",
    "SUBMITTED",
    "ChangeWaiter",
    "JobCallbacks",
    "JobEvent",
    "JobFollow",
    "JobResult",
    "Moved",
    "Output",
    "OutputDropped",
    "Reconnecting",
    "StatusChanged",
    "cancel",
    "cancel_hosted",
    "cancel_job",
    "find_job",
    "follow_job",
    "logs",
    "new_job_id",
    "prune_jobs",
    "run_job",
]

logger = logging.getLogger(__name__)

SUBMITTED = JobRole.SUBMITTED
HOSTED = JobRole.HOSTED
FINAL = FINAL_STATES
_RECONNECT_FOR = 60.0
"""How long a follower keeps redialling a provider that dropped."""
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


@dataclass(frozen=True)
class Moved:
    """The job left a provider and runs on another now (the marker between two hops)."""

    left: str
    """The provider it left."""
    to: str
    """The provider it runs on now."""
    attempt: int
    """Its first start there (counting every start of the job)."""
    reason: str
    """How the hop ended and why (``preempted: ...``, ``unreachable: ...``)."""
    unread: str = ""
    """Why the left hop's output could not all be read now (empty: it was)."""


JobEvent = Output | StatusChanged | OutputDropped | Reconnecting | Moved
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
    waiting: bool = False
    """No provider holds it: it waits in the node process's queue (``run --wait``)."""

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
    """The last event received (of the hop read now)."""
    output: OutputPosition = field(default_factory=OutputPosition)
    peer_id: str = ""
    """The provider of the hop read now."""
    hop: int = 0
    """Which of the job's hops is read now (0: its first provider)."""
    past: bool = False
    """The hop is one the job left: its events are shown, and nothing is recorded."""

    @property
    def cursor(self) -> int:
        """Where the reader is, across hops (see :data:`~gpumesh.client.hops.HOP_SPAN`)."""
        return self.hop * HOP_SPAN + self.seq


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
    hop: NextHop | None = None,
) -> JobResult:
    """Submit ``spec`` to its peer (or the best member of its group); unless
    ``detach``, follow it to the end. ``wait``: seconds the job may wait in the
    node process's queue when no provider can take it now (``run --wait``; it
    then returns the job ``queued``). ``sandbox_dir``: a folder in the peer's
    sandbox to run in (``gpumesh app run``) instead of an uploaded workdir.
    ``reuse``: an open session with ``spec.peer`` to submit on (left open).
    ``hop``: the next copy of a job recorded already (the keeper's move, or its
    placement of a job from the queue)."""
    callbacks = callbacks or JobCallbacks()
    preferred_gpu = ""
    job_id = job_id or new_job_id()
    group = spec.group
    # A new job no provider can take now may wait in the node process's queue.
    queueable = hop is None and wait > 0 and node.keeper is not None and not sandbox_dir
    if spec.group is not None:
        left = hop.left if hop is not None else frozenset()
        try:
            placement = await place_in_group(node, spec.group, spec.gpu_memory, leaving=left)
        except LimitError as exc:
            if queueable:
                return _enqueue(node, spec, job_id, wait, exc)
            raise
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
    if spec.outputs and hop is not None and hop.epoch > 1:
        await restore_outputs(node, peer, job_id, outputs_destination(spec, job_id))
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
        epoch=hop.epoch if hop is not None else 1,
        attempts_before=hop.attempts_before if hop is not None else 0,
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

    try:
        async with session_with(node, peer, reuse, submitted) as (session, answered):
            stream, offer, accepted, no_channel = answered
            if list(accepted.mounts) != [m.target for m in spec.mounts]:
                await refuse_unmounted(session, peer.name, job_id, stream)
            if accepted.outputs != spec.outputs:
                await refuse_unmounted(session, peer.name, job_id, stream, "outputs")
            result.gpus = list(accepted.gpus)
            _record_accepted(node, spec, job_id, (peer, accepted), hop, (group, wait))
            if spec.outputs and node.outputs is not None:
                node.outputs.start(job_id)
            if group is not None and node.keeper is not None:
                node.keeper.start(job_id)  # it may move
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
            reader = _Reader(peer_id=peer.node_id)
            try:
                await _deliver_all(_consume(stream, node, result, reader), callbacks)
            except (ConnectionLostError, UnreachableError) as exc:
                if result.final:
                    return result
                callbacks.reconnecting(exc)
            else:
                return result
    except (LimitError, UnreachableError) as exc:
        if queueable and store.job(SUBMITTED, job_id) is None:  # refused before accepting
            return _enqueue(node, spec, job_id, wait, exc)
        raise

    # Go on from the last event this stream delivered: not from the start again.
    await _deliver_all(_follow(node, peer.node_id, result, reader, follow=True), callbacks)
    return result


def _new_record(
    node: Node, spec: JobSpec, job_id: str, group: str | None, wait: float
) -> JobRecord:
    """A submitted job as this node records it before any provider holds it."""
    outputs_to = str(outputs_destination(spec, job_id)) if spec.outputs else ""
    return JobRecord(
        role=SUBMITTED,
        job_id=job_id,
        peer_id="",
        peer_name=spec.peer or "",
        image=spec.image or str(node.home.config.get("image")),
        command=list(spec.command),
        env=dict(spec.env),
        gpu_memory=spec.gpu_memory,
        gpus=[],
        retries=spec.retries,
        timeout=spec.timeout,
        workdir=str(spec.workdir or ""),
        created_at=time.time(),
        mounts=[dataclasses.asdict(m) for m in spec.mounts],
        outputs=spec.outputs,
        outputs_to=outputs_to,
        outputs_state=RECEIVING if spec.outputs else "",
        job_group=group or "",
        max_moves=spec.max_moves if group else 0,
        queue_wait=wait,
    )


def _record_accepted(
    node: Node,
    spec: JobSpec,
    job_id: str,
    taken: tuple[Peer, JobAccepted],
    hop: NextHop | None,
    asked: tuple[str | None, float],
) -> None:
    """Record the provider that accepted the job: a new record, or the next hop of a
    job recorded already (moved, or placed from the queue)."""
    peer, accepted = taken
    fields: dict[str, Any] = {
        "peer_id": peer.node_id,
        "peer_name": peer.name,
        "gpus": list(accepted.gpus),
        "confirmed_at": time.time(),
        "epoch": hop.epoch if hop is not None else 1,
        "attempts_before": hop.attempts_before if hop is not None else 0,
    }
    store = node.home.store
    if hop is None:
        group, wait = asked
        store.add_job(dataclasses.replace(_new_record(node, spec, job_id, group, wait), **fields))
        return
    fields.update(state=JobState.QUEUED, message="", wait_until=0.0, last_seq=0, attempt=0)
    fields.update(provider_forgot=0, exit_code=None)
    if spec.outputs:
        fields.update(outputs_state=RECEIVING, outputs_seq=0)
    store.update_job(SUBMITTED, job_id, **fields)


def _enqueue(node: Node, spec: JobSpec, job_id: str, wait: float, why: GPUMeshError) -> JobResult:
    """No provider can take the job now: it waits in the node process's queue, which
    places it as soon as one can (:class:`gpumesh.client.moves.JobKeeper`)."""
    record = dataclasses.replace(
        _new_record(node, spec, job_id, spec.group, wait),
        message=f"waiting for a provider: {why.message}",
        wait_until=time.time() + wait,
    )
    node.home.store.add_job(record)
    assert node.keeper is not None
    node.keeper.start(job_id)
    return dataclasses.replace(JobResult.of_record(record), waiting=True)


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
            elif isinstance(event, Reconnecting):
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
        if not reader.past:
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
        state = job_state(message.state)
        if reader.past:
            # A hop the job left: how it went on there, but not its end (the marker
            # between hops says why it was left).
            return [] if state in FINAL_STATES else [StatusChanged.of(message)]
        if not record_status(node, result.job_id, reader.peer_id, message):
            return []  # refused (an older hop's), or the keeper's to move
        result.state = state
        result.attempt = message.attempt
        result.exit_code = message.exit_code
        result.message = message.message
        return [StatusChanged.of(message)]
    raise ProtocolError(f"unexpected {type(message).__name__} in a job's event stream")


def record_status(
    node: Node, job_id: str, peer_id: str, status: JobStatus, *, keeper: bool = False
) -> bool:
    """Apply a provider's status of a job this node submitted; False when it was not
    applied: it is not from the job's newest hop (refused and logged), or it preempts
    a group's job, which the node process's keeper then moves (or ends; ``keeper``:
    the keeper itself asks, and decides)."""
    store = node.home.store
    job = store.job(SUBMITTED, job_id)
    if job is None:
        return False
    problem = status_problem(job, peer_id, status)
    if problem is not None:
        logger.warning("[job %s] a status (%s) refused: %s", job_id, status.state, problem)
        return False
    if status.state == JobState.PREEMPTED and job.job_group and node.keeper is not None:
        # The hop ended, not the job: its keeper moves it, or ends it when it may not.
        store.update_job(SUBMITTED, job_id, attempt=status.attempt, message=status.message)
        if not keeper:
            node.keeper.poke(job_id)
        return False
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
    when = status.time or time.time()
    if status.started:
        fields["started_at"] = status.started
    elif status.state == JobState.RUNNING and job.started_at is None:
        fields["started_at"] = when
    if status.state in FINAL_STATES:
        fields["finished_at"] = when
    store.update_job(SUBMITTED, job_id, **fields)
    return True


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
        """The sequence number of the last event read (0: none yet; across a moved
        job's hops, see :data:`~gpumesh.client.hops.HOP_SPAN`). A follow started with
        ``after_seq`` set to it resumes right after, with nothing lost or repeated."""
        return self._reader.cursor

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
    hop, seq = divmod(after_seq, HOP_SPAN)
    reader = _Reader(seq, OutputPosition(0 if seq == 0 else UNKNOWN), hop=hop)
    events = _follow_hops(node, job.job_id, result, reader, follow=follow)
    return JobFollow(job, result, events, reader)


async def _follow_hops(
    node: Node, job_id: str, result: JobResult, reader: _Reader, *, follow: bool
) -> AsyncGenerator[JobEvent, None]:
    """A submitted job's events across its hops: each hop's from its provider, a
    :class:`Moved` marker between two; with ``follow``, until the job ends wherever
    it moved. A hop the job left is read as far as its provider answers now."""
    store = node.home.store
    said = ""
    """The queue's last word shown."""
    while (job := store.job(SUBMITTED, job_id)) is not None:
        if reader.hop < len(job.hops):
            hop = job.hops[reader.hop]
            reader.peer_id, reader.past = str(hop["peer_id"]), True
            unread = ""
            try:
                async for event in _follow(node, reader.peer_id, result, reader, patience=5.0):
                    yield event
            except GPUMeshError as exc:  # gone, silent, or it denied us since
                unread = exc.message
            if follow:
                job = await _until(node, job_id, reader.hop + 1, placed=True)
            else:
                job = store.job(SUBMITTED, job_id)
            if job is None or (len(job.hops) <= reader.hop + 1 and not job.peer_id):
                break  # ended before a next hop, or not followed
            to = job.hops[reader.hop + 1]["peer"] if len(job.hops) > reader.hop + 1 else None
            yield Moved(
                str(hop["peer"]),
                str(to or job.peer_name),
                int(hop["attempt"]) + 1,
                f"{hop['ended']}: {hop['reason']}",
                unread,
            )
            reader.hop, reader.seq, reader.output = reader.hop + 1, 0, OutputPosition()
            continue
        if not job.peer_id:
            if job.state in FINAL_STATES or not follow:
                break
            if job.message != said:
                said = job.message
                yield StatusChanged(status_of(job), exited=False)
            await asyncio.sleep(_POLL)
            continue
        reader.peer_id, reader.past = job.peer_id, False
        try:
            async for event in _follow(node, job.peer_id, result, reader, follow=follow):
                yield event
                if isinstance(event, Reconnecting) and _moved_from(node, job_id, reader.hop):
                    break
        except (ConnectionLostError, UnreachableError):
            if not _may_move(node, job_id):
                raise
            continue  # silent for long: followed again, unless its keeper moved it
        if not follow:
            break
        # The provider ended it there: the job ended, or its keeper moves it on.
        job = await _until(node, job_id, reader.hop)
        if job is None or len(job.hops) <= reader.hop:
            break
    job = store.job(SUBMITTED, job_id)
    if job is not None and job.state in FINAL_STATES and not result.final:
        # It ended in this node (moves used up, or no provider in time): say how.
        _update(result, job)
        yield StatusChanged(status_of(job), exited=False)


async def _until(node: Node, job_id: str, hop: int, *, placed: bool = False) -> JobRecord | None:
    """The job's record once it ended or left hop ``hop`` (``placed``: or has a
    provider again); None: the job was forgotten. Its keeper writes the store."""
    while True:
        job = node.home.store.job(SUBMITTED, job_id)
        if job is None or job.state in FINAL or len(job.hops) > hop or (placed and job.peer_id):
            return job
        await asyncio.sleep(_POLL)


def _moved_from(node: Node, job_id: str, hop: int) -> bool:
    """Whether the job left hop ``hop``."""
    job = node.home.store.job(SUBMITTED, job_id)
    return job is not None and len(job.hops) > hop


def _may_move(node: Node, job_id: str) -> bool:
    """Whether the node process keeps the job, moving it should its provider stay silent."""
    job = node.home.store.job(SUBMITTED, job_id)
    return node.keeper is not None and job is not None and bool(job.job_group)


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
    node: Node,
    peer_id: str,
    result: JobResult,
    reader: _Reader,
    *,
    follow: bool = False,
    patience: float = _RECONNECT_FOR,
) -> AsyncGenerator[JobEvent, None]:
    """One provider's events of the job, after ``reader``'s; a dropped link is
    redialled for ``patience`` seconds."""
    deadline = time.monotonic() + patience
    reader.peer_id = peer_id
    while True:
        try:
            async with node.live_session(peer_id) as session:
                deadline = time.monotonic() + patience  # from the last working link
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
    if not job.peer_id and job.state not in FINAL_STATES:
        # Waiting in the queue (or between two hops): no provider holds it.
        node.home.store.update_job(
            SUBMITTED,
            job.job_id,
            state=JobState.CANCELLED,
            cancel_requested=1,
            message="cancelled while it waited for a provider",
            finished_at=time.time(),
        )
        if node.keeper is not None:
            node.keeper.poke(job.job_id)
        return JobResult.of_record(node.home.store.find_job(job.job_id, role=SUBMITTED))
    node.home.store.update_job(SUBMITTED, job.job_id, cancel_requested=1)
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
    record_status(node, reply.job_id, peer.node_id, reply)
    return result


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
