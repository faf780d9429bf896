"""What the dashboard's templates lay out: plain values, made from the client
layer's views.

Each class is one row, card or section of a page, with its words and numbers
already formatted; peer-controlled text (names, argv, addresses, messages) stays
plain text here and is escaped by the templates, never in Python.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gpumesh.protocol.states import FINAL_STATES, JobState
from gpumesh.units import format_size

if TYPE_CHECKING:
    from gpumesh.client.views.groups import MemberStatusEntry
    from gpumesh.client.views.joblist import JobListEntry
    from gpumesh.client.views.owner import SessionsView
    from gpumesh.client.views.peers import PeerView
    from gpumesh.control.shareviews import ShareView

__all__ = [
    "GpuCard",
    "GroupCard",
    "JobCard",
    "JobRow",
    "MemberRow",
    "Moment",
    "PeerRow",
    "SessionRow",
    "ShareCard",
    "UserRow",
    "ago",
    "running",
    "size",
]


def ago(when: float | None) -> str:
    """How long ago ``when`` was, in words: ``5 s ago``, ``3 h ago``, ``never``."""
    if not when:
        return "never"
    seconds = max(0, int(time.time() - when))
    if seconds < 60:
        return f"{seconds} s ago"
    if seconds < 3600:
        return f"{seconds // 60} min ago"
    if seconds < 86400:
        return f"{seconds // 3600} h ago"
    return f"{seconds // 86400} d ago"


def size(num_bytes: int | None) -> str:
    """A size as people write it, ``-`` for none."""
    return format_size(num_bytes) if num_bytes else "-"


def running(state: str) -> bool:
    """Whether a job in ``state`` has not ended."""
    return JobState(state) not in FINAL_STATES


@dataclass(frozen=True)
class Moment:
    """A time on this machine's clock: machine-readable, shown, and how long ago."""

    iso: str
    shown: str
    ago: str

    @classmethod
    def of(cls, when: float) -> Moment:
        local = time.localtime(when)
        return cls(
            iso=time.strftime("%Y-%m-%dT%H:%M:%S%z", local),
            shown=time.strftime("%Y-%m-%d %H:%M:%S", local),
            ago=ago(when),
        )


@dataclass(frozen=True)
class JobRow:
    """One job in a table of jobs; a job not yet ended has a stop button."""

    job_id: str
    role: str
    peer: str
    state: str
    exit_code: str
    attempt: int
    tries: int
    asked: str
    peak: str
    command: str
    running: bool

    @classmethod
    def of(cls, job: JobListEntry) -> JobRow:
        return cls(
            job_id=job.job_id,
            role=job.role,
            peer=job.peer,
            state=job.state,
            exit_code="-" if job.exit_code is None else str(job.exit_code),
            attempt=job.attempt,
            tries=job.retries + 1,
            asked=size(job.gpu_memory),
            peak=size(job.peak_gpu_memory),
            command=" ".join(job.command),
            running=running(job.state),
        )


@dataclass(frozen=True)
class JobCard:
    """One job's page: its state, its facts, and what its cancel button sends."""

    job_id: str
    state: str
    exit_code: str
    facts: list[tuple[str, str]]
    cancel_body: str
    """The JSON body of the cancel call (which peer runs it)."""

    @classmethod
    def of(cls, job: JobListEntry) -> JobCard:
        row = JobRow.of(job)
        return cls(
            job_id=job.job_id,
            state=job.state,
            exit_code=row.exit_code,
            facts=[
                ("Peer", job.peer),
                ("Role", job.role),
                ("Image", job.image),
                ("Command", row.command),
                ("Attempt", f"{job.attempt} of {row.tries}"),
                ("GPU memory asked", row.asked),
                ("GPU memory peak", row.peak),
            ],
            cancel_body=json.dumps({"peer": job.peer}),
        )


@dataclass(frozen=True)
class GpuCard:
    """One GPU of this machine and its chart."""

    index: int
    name: str
    used: str
    total: str


@dataclass(frozen=True)
class PeerRow:
    """One paired peer, with its allow or deny and connect buttons."""

    name: str
    allowed: bool
    seen: str
    path: str
    addresses: str
    relay: bool

    @classmethod
    def of(cls, peer: PeerView) -> PeerRow:
        return cls(
            name=peer.name,
            allowed=peer.allowed,
            seen=ago(peer.last_seen),
            path=peer.last_path or "-",
            addresses=", ".join(peer.addresses) or "-",
            relay=bool(peer.relay),
        )


@dataclass(frozen=True)
class MemberRow:
    """One member of a group: how it answered, and why a run would skip it."""

    name: str
    reach: str
    gpus: str
    free: str
    state: str
    why: str

    @classmethod
    def of(cls, m: MemberStatusEntry) -> MemberRow:
        why = "-"
        if m.is_self:
            why = "this node"
        elif not m.paired:
            why = "not paired"
        elif m.allowed is False:
            why = "denied here"
        elif m.reachable is False:
            why = str(m.reach)
        elif m.state == "busy":
            why = "busy"
        reach = "-" if m.reachable is None else str(m.reach) if m.reachable else "no"
        free = format_size(m.free_gpu_memory) if m.free_gpu_memory is not None else "-"
        return cls(m.name, reach, m.gpus or "-", free, m.state or "-", why or "-")


@dataclass(frozen=True)
class GroupCard:
    """A group this node is in, and its members."""

    group_id: str
    name: str
    members: list[MemberRow]


@dataclass(frozen=True)
class UserRow:
    """A peer that uses this machine now: its paths, its running jobs, and whether
    it may still (the deny button) or was denied."""

    name: str
    paths: str
    running: int
    allowed: bool


@dataclass(frozen=True)
class SessionRow:
    """An open shell, desktop connection or CUDA session, with its stop button."""

    kind: str
    route: str
    """The owner API's name for the kind: ``shells``, ``desktop``, ``cuda``."""
    session_id: str
    peer: str
    what: str
    since: str

    @classmethod
    def of(cls, sessions: SessionsView) -> list[SessionRow]:
        """Every open session, the oldest first."""
        found: list[tuple[float, str, str, str, str, str]] = []
        for shell in sessions.shells:
            what = f"{shell.image} ({shell.container})"
            found.append((shell.since, "Shell", "shells", shell.id, shell.peer, what))
        for desk in sessions.desktops:
            what = f"{desk.kind.upper()} on port {desk.port}"
            found.append((desk.since, "Desktop", "desktop", desk.id, desk.peer, what))
        for cuda in sessions.cuda:
            what = f"{format_size(cuda.memory)} on {cuda.device} (pid {cuda.pid})"
            found.append((cuda.since, "CUDA", "cuda", cuda.id, cuda.peer, what))
        return [
            cls(kind, route, session_id, peer, what, ago(since))
            for since, kind, route, session_id, peer, what in sorted(found)
        ]


@dataclass(frozen=True)
class ShareCard:
    """Whether this machine is shared, and where that is changed."""

    control: Literal["here", "elsewhere", "stopping"]
    """``here``: this page's buttons; ``elsewhere``: the command line (no node process
    serves this API); ``stopping``: nowhere now (the node process is stopping)."""
    sharing: bool
    since: Moment | None = None
    udp: str = ""
    options: str = "the defaults"
    ended: Moment | None = None
    how: str = ""
    paused: Moment | None = None
    """Since when the owner has the machine back (``gpumesh pause``); None: not paused."""

    @classmethod
    def of(cls, share: ShareView) -> ShareCard:
        paused = Moment.of(share.paused_since) if share.paused_since is not None else None
        if share.sharing:
            return cls(
                control="here",
                sharing=True,
                since=Moment.of(share.since) if share.since else None,
                udp=share.udp or "",
                options=share.options.describe() if share.options is not None else "the defaults",
                paused=paused,
            )
        ended = share.ended
        return cls(
            control="here",
            sharing=False,
            ended=Moment.of(ended.at) if ended is not None else None,
            how=ended.how if ended is not None else "",
            paused=paused,
        )
