"""Where submitted jobs stand: a listing asks their providers (``JobQuery``), all at
once and within a bound, and remembers the providers that did not answer so the
next listing does not wait on them again (:class:`SilentProviders`)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumesh.client.jobs import SUBMITTED, record_status
from gpumesh.errors import ConnectionLostError, GPUMeshError, NotFoundError
from gpumesh.protocol.messages import JobQuery, JobStatus

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.store.jobs import JobRecord
    from gpumesh.transport.session import Session

__all__ = ["REFRESH_TIMEOUT", "SilentProviders", "Unconfirmed", "refresh_jobs"]

logger = logging.getLogger(__name__)

REFRESH_TIMEOUT = 3.0
"""How long a listing waits, in all, for providers to say where their jobs stand."""


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
            record_status(node, job_id, jobs[0].peer_id, reply)
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
