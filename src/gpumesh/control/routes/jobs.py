"""Routes of jobs: submit (its run streamed), list, one job, cancel, its events."""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gpumesh.client import jobs, runs
from gpumesh.client.bodies import CancelBody, JobBody, PruneBody
from gpumesh.client.jobrefresh import refresh_jobs
from gpumesh.client.jobs import cancel, find_job, logs, prune_jobs, run_job
from gpumesh.client.jobspec import build_spec, queue_wait
from gpumesh.client.outputs import RECEIVING
from gpumesh.client.runs import watch_run
from gpumesh.client.views import ErrorView
from gpumesh.client.views.joblist import JobListEntry, PrunedJob
from gpumesh.client.views.jobs import (
    Dropped,
    JobEventView,
    JobResultView,
    Moved,
    Output,
    Reconnecting,
    Status,
)
from gpumesh.client.views.outputs import OutputsView
from gpumesh.client.views.runs import (
    AcceptedView,
    CandidateView,
    PlacedView,
    PullingView,
    QueuedView,
    StepView,
    UploadingView,
)
from gpumesh.control.call import Call
from gpumesh.control.streams import KEEPALIVE, EventStream, paced_events, sse
from gpumesh.errors import BadRequestError, GPUMeshError

if TYPE_CHECKING:
    from gpumesh.client.node import Node

__all__ = [
    "get_job",
    "get_job_events",
    "get_jobs",
    "post_cancel",
    "post_job",
    "post_prune",
    "run_event",
]


OUTPUTS_WAIT = 600.0
"""Longest an attached run waits, after its job ended, for its outputs to come."""


async def get_jobs(call: Call) -> object:
    node = call.node
    limit = call.number("limit", 20, least=1, most=1000)
    unconfirmed: dict[str, str] = {}
    if not call.flag("offline") and node.home.store.unconfirmed_submitted_jobs(limit):
        for answer in await refresh_jobs(node, limit=limit):
            unconfirmed.update(dict.fromkeys(answer.job_ids, answer.reason))
    return [JobListEntry.of(j, unconfirmed) for j in node.home.store.jobs(limit=limit)]


async def get_job(call: Call) -> object:
    return JobListEntry.of(find_job(call.node, call.param("job_id")), {})


async def post_job(call: Call) -> object:
    """Submit a job to a peer or to the best member of a group; returns once the
    provider accepted it (follow it with the events route)."""

    body: JobBody = call.body
    if body.workdir is not None:
        call.refuse_cookie("workdir")
    if body.outputs:
        call.refuse_cookie("outputs")
    if not body.peer and not body.group:
        raise BadRequestError(
            "The job names no place to run: give `peer` (a paired node) or `group`."
        )
    spec = build_spec(
        image=body.image,
        command=body.command,
        env_items=[f"{k}={v}" for k, v in body.env.items()],
        workdir=body.workdir,
        gpu_memory=body.gpu_memory,
        retries=body.retries,
        timeout=body.timeout,
        peer=body.peer,
        group=body.group,
        mounts=body.mounts,
        outputs=body.outputs,
        outputs_to=body.outputs_to,
        outputs_under=body.outputs_under,
        max_moves=body.max_moves,
    )
    wait = queue_wait(body.wait)
    if call.flag("stream"):
        run = watch_run(call.node, spec, wait=wait)
        return EventStream(_run_events(run, call.node if spec.outputs else None))
    return JobResultView.of(await run_job(call.node, spec, detach=True, wait=wait))


async def _run_events(run: Any, outputs: Node | None = None) -> AsyncIterator[bytes]:
    """A run as Server-Sent Events: its steps (``placedview``, ``pullingview``,
    ``acceptedview``, ``uploadingview``), then the job's events as the events route
    sends them (numbered: resume that route with ``after``), then (``outputs``: the
    node whose receiver brings them home) an ``outputsview`` once its outputs came
    (or after :data:`OUTPUTS_WAIT`), then ``end``. Leaving early cancels a
    submission still under way (an accepted job keeps running)."""

    try:
        async for event in run:
            yield run_event(event, run.seq)
        if outputs is not None and outputs.outputs is not None and run.result is not None:
            deadline = time.monotonic() + OUTPUTS_WAIT
            record = None
            while time.monotonic() < deadline:
                wait = min(KEEPALIVE, deadline - time.monotonic())
                record = await outputs.outputs.settled(run.result.job_id, wait)
                receiving = record is not None and record.outputs_state == RECEIVING
                if not receiving or not outputs.outputs.running(run.result.job_id):
                    break
                yield b": keep-alive\n\n"
            view = None if record is None else OutputsView.of(record)
            if view is not None:
                yield sse("outputsview", view)
        yield sse("end", JobResultView.of(run.result))
    except GPUMeshError as exc:
        yield sse("error", ErrorView(exc.code, exc.message))
    finally:
        await run.aclose()


async def post_cancel(call: Call) -> object:
    body: CancelBody = call.body
    return JobResultView.of(await cancel(call.node, call.param("job_id"), peer=body.peer))


async def post_prune(call: Call) -> object:
    body: PruneBody = call.body
    removed = prune_jobs(call.node, body.older_than, dry_run=body.dry_run)
    return [PrunedJob.of(job) for job in removed]


async def get_job_events(call: Call) -> object:
    """A job's events as Server-Sent Events. Each output and status event carries
    its sequence number as the event's id: a client that reconnects with
    ``Last-Event-ID`` (as a browser's EventSource does) or ``after`` resumes right
    after it. The stream ends with an ``end`` event (the job's result), or an
    ``error`` event."""

    job = find_job(call.node, call.param("job_id"))  # an unknown job is a plain 404
    after = call.number("after", 0, most=2**62)
    last = call.request.headers.get("last-event-id")
    if last is not None:
        try:
            after = max(0, int(last))
        except ValueError:
            raise BadRequestError(f"Last-Event-ID {last!r} is not a sequence number") from None
    follow = logs(call.node, job.job_id, follow=call.flag("follow", True), after_seq=after)
    return EventStream(_job_events(follow))


def run_event(event: Any, seq: int) -> bytes:
    """One event of a run (a step of its submission, or the job's own) as an SSE
    event; only output and status events carry ``seq`` as their id."""

    step = _step_view(event)
    if step is not None:
        return sse(type(step).__name__.lower(), step)
    view = _event_view(event, seq)
    # Only output and status events are resumable points: a drop notice shares
    # its output's number and a reconnect has none.
    numbered = isinstance(event, jobs.Output | jobs.StatusChanged)
    return sse(type(view).__name__.lower(), view, seq if numbered else None)


def _job_events(follow: Any) -> AsyncIterator[bytes]:
    return paced_events(
        follow,
        lambda event: run_event(event, follow.seq),
        lambda: sse("end", JobResultView.of(follow.result)),
    )


def _event_view(event: jobs.JobEvent, seq: int) -> JobEventView:
    """A followed job's event as its view; ``seq``: the follow's sequence number then."""

    if isinstance(event, jobs.Output):
        text = event.data.decode("utf-8", errors="replace")
        return Output(seq, event.stream, base64.b64encode(event.data).decode("ascii"), text)
    if isinstance(event, jobs.StatusChanged):
        status = event.status
        return Status(
            seq, event.state, status.attempt, status.exit_code, status.message, event.exited
        )
    if isinstance(event, jobs.OutputDropped):
        return Dropped(seq, event.count)
    if isinstance(event, jobs.Moved):
        return Moved(seq, event.left, event.to, event.attempt, event.reason, event.unread)
    return Reconnecting(seq, event.error.code, event.error.message)


def _step_view(event: runs.RunEvent) -> StepView | None:
    """A step before the job runs as its view; None for the job's own events."""

    if isinstance(event, runs.Placed):
        placement = event.placement
        assert placement.chosen is not None
        candidates = [CandidateView(c.name, c.eligible, c.reason) for c in placement.candidates]
        chosen = placement.chosen
        return PlacedView(CandidateView(chosen.name, chosen.eligible, chosen.reason), candidates)
    if isinstance(event, runs.Pulling):
        pull = event.pull
        return PullingView(
            pull.image, pull.layers, pull.layers_done, pull.downloaded, pull.total, pull.done
        )
    if isinstance(event, runs.Accepted):
        accepted = event.accepted
        return AcceptedView(accepted.job_id, accepted.provider, list(accepted.gpus))
    if isinstance(event, runs.Uploading):
        return UploadingView(event.sent, event.total)
    if isinstance(event, runs.Queued):
        return QueuedView(event.job_id, event.message)
    return None
