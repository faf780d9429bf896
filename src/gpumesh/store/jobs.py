"""The jobs table and the event log of each hosted job."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumesh.errors import NotFoundError
from gpumesh.protocol.messages import JobOutput, JobStatus
from gpumesh.protocol.states import FINAL_STATES, JobRole, JobState
from gpumesh.store.tables import Tables

__all__ = ["JobEvent", "JobRecord", "JobTables", "OutputEntry"]

_FINAL = "(" + ", ".join(sorted(f"'{state}'" for state in FINAL_STATES)) + ")"
"""``('cancelled', 'failed', 'succeeded')``: the final job states as an SQL list."""

_JOB_COLUMNS = [
    "role",
    "job_id",
    "peer_id",
    "peer_name",
    "image",
    "command",
    "env",
    "gpu_memory",
    "gpus",
    "retries",
    "timeout",
    "workdir",
    "state",
    "attempt",
    "exit_code",
    "message",
    "cancel_requested",
    "container_id",
    "log_cursor",
    "last_seq",
    "created_at",
    "started_at",
    "finished_at",
    "peak_gpu_memory",
    "output_bytes",
    "output_dropped",
    "confirmed_at",
    "provider_forgot",
    "mounts",
    "outputs",
    "outputs_to",
    "outputs_state",
    "outputs_seq",
    "outputs_files",
    "outputs_bytes",
    "outputs_note",
    "job_group",
    "max_moves",
    "queue_wait",
    "wait_until",
    "epoch",
    "attempts_before",
    "hops",
]
_JSON_COLUMNS = {"command", "env", "gpus", "log_cursor", "mounts", "hops"}


def _column(name: str, value: object) -> object:
    """``value`` as the jobs table stores column ``name``."""
    return json.dumps(value) if name in _JSON_COLUMNS else value


@dataclass(frozen=True)
class JobRecord:
    """A job as this node knows it: ``hosted`` (ran here) or ``submitted`` (sent to a peer)."""

    role: JobRole
    job_id: str
    peer_id: str
    """The submitter (hosted) or the provider (submitted)."""
    peer_name: str
    image: str
    command: list[str]
    env: dict[str, str]
    gpu_memory: int
    gpus: list[str]
    retries: int
    timeout: float
    workdir: str
    """Hosted: the unpacked workdir on this machine; submitted: the local folder sent."""
    created_at: float
    state: JobState = JobState.QUEUED
    attempt: int = 0
    exit_code: int | None = None
    message: str = ""
    cancel_requested: bool = False
    container_id: str = ""
    log_cursor: dict[str, list[object]] = field(default_factory=dict)
    """Hosted: per stream, where the engine's log was read up to."""
    last_seq: int = 0
    """Hosted: last event written; submitted: last event received."""
    started_at: float | None = None
    finished_at: float | None = None
    peak_gpu_memory: int = 0
    """Most GPU memory the job's processes used at once (sampled while running)."""
    output_bytes: int = 0
    """Hosted: bytes of output (stdout and stderr, every attempt) written so far,
    which is where the next piece of output starts."""
    output_dropped: int = 0
    """Bytes of the oldest output dropped to keep what is stored within the
    provider's ``job_log_limit``. Hosted: exactly; submitted: as far as this node
    has been told (the drop is always a prefix of the output, so a gap that ends at
    offset N says that N bytes were dropped)."""
    confirmed_at: float | None = None
    """Submitted: when the provider last told this node the job's state (its
    acceptance, an event, or an answer to a refresh)."""
    provider_forgot: bool = False
    """Submitted: the provider answered that it no longer knows the job (pruned
    there, or its home was reset): its state here is the last one known."""
    mounts: list[dict[str, Any]] = field(default_factory=list)
    """Sandbox folders mounted into the job. Hosted: each ``{"remote": "/datasets",
    "source": its host path, "target": "/data", "rw": bool}``; submitted: each
    ``{"source": "/datasets", "target": "/data", "rw": bool}``."""
    outputs: str = ""
    """The container path whose finished files come home (``run --outputs``); empty:
    none. Hosted: mounted from ``/gpumesh-outputs/JOB_ID`` of the submitter's sandbox."""
    outputs_to: str = ""
    """Submitted: the local folder the outputs go to (absolute)."""
    outputs_state: str = ""
    """Submitted: ``receiving``, ``complete`` (all fetched, the provider's copy
    released), ``stopped`` (``outputs_note`` says why); empty: no outputs."""
    outputs_seq: int = 0
    """Submitted: the last ``OutputFile.seq`` dealt with (fetched, skipped or refused)."""
    outputs_files: int = 0
    """Submitted: files fetched so far."""
    outputs_bytes: int = 0
    """Submitted: bytes of the files fetched so far."""
    outputs_note: str = ""
    """Submitted: the last entry refused, or why the stream stopped (one line)."""
    job_group: str = ""
    """Submitted: the group the job was placed in (``run --group``), within which it
    moves; empty: a ``--peer`` job, which never moves."""
    max_moves: int = 0
    """Submitted: moves allowed (``run --max-moves``)."""
    queue_wait: float = 0.0
    """Submitted: seconds the job may wait in the queue for a provider each time it
    needs one (``run --wait``); 0: it does not wait."""
    wait_until: float = 0.0
    """Submitted: while the job waits in the queue, until when (wall clock); else 0."""
    epoch: int = 0
    """The hop's fencing epoch (1 for the first; submitted: the newest hop's, raised
    at each move; hosted: the copy running here; 0: from before fencing)."""
    attempts_before: int = 0
    """Starts the job made on earlier hops (its attempt N here is start
    ``attempts_before + N``)."""
    hops: list[dict[str, Any]] = field(default_factory=list)
    """Submitted: each hop the job left, oldest first: ``{"peer", "peer_id", "epoch",
    "attempt", "ended", "reason", "stopped"}`` (``attempt``: the job's starts until
    then; ``stopped``: its provider heard that the job moved)."""

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> JobRecord:
        values = {name: row[name] for name in _JOB_COLUMNS}
        for name in _JSON_COLUMNS:
            values[name] = json.loads(values[name])
        values["cancel_requested"] = bool(values["cancel_requested"])
        values["provider_forgot"] = bool(values["provider_forgot"])
        values["role"] = JobRole(values["role"])
        values["state"] = JobState(values["state"])
        return cls(**values)

    @property
    def duration(self) -> float | None:
        if self.started_at is None:
            return None
        end = self.finished_at if self.finished_at is not None else time.time()
        return max(0.0, end - self.started_at)


@dataclass(frozen=True)
class JobEvent:
    job_id: str
    seq: int
    ts: float
    attempt: int
    kind: str
    """``stdout``, ``stderr`` or ``state`` (data: JSON of state, exit_code, message)."""
    data: bytes
    position: int = -1
    """Output: where ``data`` starts in the job's output (stdout and stderr together,
    every attempt); -1 for state events and output stored before positions were kept."""

    def to_message(self) -> JobOutput | JobStatus:
        """The wire message that carries this event to a follower."""
        if self.kind != "state":
            return JobOutput(
                seq=self.seq,
                attempt=self.attempt,
                stream=self.kind,
                data=self.data,
                offset=self.position,
            )
        info = json.loads(self.data)
        return JobStatus(
            job_id=self.job_id,
            seq=self.seq,
            state=info["state"],
            attempt=self.attempt,
            exit_code=info["exit_code"],
            message=info["message"],
            peak_gpu_memory=info.get("peak_gpu_memory", 0),
            time=self.ts,
            exited=info.get("exited"),
        )


@dataclass(frozen=True)
class OutputEntry:
    """A hosted job's output file found finished (closed or renamed into place)."""

    seq: int
    path: str
    size: int
    mtime_ns: int
    mtime: float


class JobTables(Tables):
    """The store's methods on jobs and their events."""

    def add_job(self, job: JobRecord) -> None:
        values = tuple(_column(name, getattr(job, name)) for name in _JOB_COLUMNS)
        marks = ",".join("?" * len(_JOB_COLUMNS))
        self._execute(f"INSERT INTO jobs ({','.join(_JOB_COLUMNS)}) VALUES ({marks})", values)

    def update_job(self, role: JobRole, job_id: str, **fields: object) -> None:
        if not fields:
            return
        unknown = set(fields) - set(_JOB_COLUMNS)
        if unknown:
            raise ValueError(f"unknown job fields: {sorted(unknown)}")
        sets = ", ".join(f"{name} = ?" for name in fields)
        values = [_column(name, value) for name, value in fields.items()]
        self._execute(
            f"UPDATE jobs SET {sets} WHERE role = ? AND job_id = ?", (*values, role, job_id)
        )

    def delete_job(self, role: JobRole, job_id: str) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM jobs WHERE role = ? AND job_id = ?", (role, job_id))
            if role == JobRole.HOSTED:
                self._db.execute("DELETE FROM job_events WHERE job_id = ?", (job_id,))
                self._db.execute("DELETE FROM job_outputs WHERE job_id = ?", (job_id,))

    # --- outputs ---------------------------------------------------------------------------

    def record_outputs(
        self,
        job_id: str,
        found: Sequence[tuple[str, int, int, float]],
        *,
        whole: bool = False,
        baseline: bool = False,
    ) -> int:
        """Record files of a hosted job's outputs as ready: ``(path, size, mtime_ns,
        mtime)`` each; one whose size and mtime differ from what was last recorded
        (or new) gets the next seq. ``whole``: ``found`` is every file there is (a
        scan), so entries it lacks are forgotten. ``baseline``: ``found`` is what the
        submitter restored before the job started (home already), recorded with seq
        0, which no ``OutputsQuery`` lists (they ask for seq > after >= 0), so only
        a file the job changes since travels. Returns how many got a seq."""
        added = 0
        with self._transaction():
            known = {
                str(row[0]): (int(row[1]), int(row[2]))
                for row in self._db.execute(
                    "SELECT path, size, mtime_ns FROM job_outputs WHERE job_id = ?", (job_id,)
                )
            }
            row = self._db.execute(
                "SELECT coalesce(max(seq), 0) FROM job_outputs WHERE job_id = ?", (job_id,)
            ).fetchone()
            seq = int(row[0])
            for path, size, mtime_ns, mtime in found:
                if known.get(path) == (size, mtime_ns):
                    continue
                known[path] = (size, mtime_ns)
                if not baseline:
                    seq += 1
                    added += 1
                self._db.execute(
                    "INSERT OR REPLACE INTO job_outputs (job_id, path, seq, size, mtime_ns, mtime) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (job_id, path, 0 if baseline else seq, size, mtime_ns, mtime),
                )
            if whole:
                gone = set(known) - {path for path, *_ in found}
                for path in gone:
                    self._db.execute(
                        "DELETE FROM job_outputs WHERE job_id = ? AND path = ?", (job_id, path)
                    )
        return added

    def job_outputs(self, job_id: str, after: int, limit: int) -> list[OutputEntry]:
        """A hosted job's ready outputs after seq ``after``, in seq order."""
        rows = self._query(
            "SELECT seq, path, size, mtime_ns, mtime FROM job_outputs "
            "WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after, limit),
        )
        return [OutputEntry(int(r[0]), str(r[1]), int(r[2]), int(r[3]), float(r[4])) for r in rows]

    def forget_outputs(self, job_id: str) -> None:
        self._execute("DELETE FROM job_outputs WHERE job_id = ?", (job_id,))

    def receiving_outputs(self) -> list[JobRecord]:
        """Submitted jobs whose outputs are still to come home."""
        rows = self._query(
            "SELECT * FROM jobs WHERE role = ? AND outputs_state = 'receiving' ORDER BY created_at",
            (JobRole.SUBMITTED,),
        )
        return [JobRecord.from_row(r) for r in rows]

    def job(self, role: JobRole, job_id: str) -> JobRecord | None:
        rows = self._query("SELECT * FROM jobs WHERE role = ? AND job_id = ?", (role, job_id))
        return JobRecord.from_row(rows[0]) if rows else None

    def find_job(self, query: str, role: JobRole | None = None) -> JobRecord:
        """A job by id or unambiguous id prefix (4+ characters), newest first."""
        query = query.strip().lower()
        if len(query) < 4:
            raise NotFoundError(f"job id {query!r} is too short: type at least 4 characters")
        sql = "SELECT * FROM jobs WHERE substr(job_id, 1, ?) = ?"
        args: tuple[object, ...] = (len(query), query)
        if role is not None:
            sql += " AND role = ?"
            args += (role,)
        rows = self._query(sql + " ORDER BY created_at DESC", args)
        if not rows:
            raise NotFoundError(f"no job {query!r} here: see `gpumesh jobs`")
        ids = {r["job_id"] for r in rows}
        if len(ids) > 1:
            raise NotFoundError(
                f"job id prefix {query!r} matches {len(ids)} jobs: type more of the id"
            )
        return JobRecord.from_row(rows[0])

    def jobs(self, limit: int = 20, role: JobRole | None = None) -> list[JobRecord]:
        if role is None:
            rows = self._query("SELECT * FROM jobs ORDER BY created_at DESC LIMIT ?", (limit,))
        else:
            rows = self._query(
                "SELECT * FROM jobs WHERE role = ? ORDER BY created_at DESC LIMIT ?",
                (role, limit),
            )
        return [JobRecord.from_row(r) for r in rows]

    def kept_jobs(self) -> list[JobRecord]:
        """Submitted jobs the node process keeps: unfinished ones that may move (run
        with ``--group``) or wait in its queue, and ended ones with a hop to stop."""
        rows = self._query(
            "SELECT * FROM jobs WHERE role = ? AND ((state NOT IN "
            f"{_FINAL} AND (job_group != '' OR peer_id = '')) OR hops LIKE '%\"stopped\": false%') "
            "ORDER BY created_at",
            (JobRole.SUBMITTED,),
        )
        return [JobRecord.from_row(r) for r in rows]

    def unconfirmed_submitted_jobs(self, limit: int = 1000) -> list[JobRecord]:
        """Of the ``limit`` newest jobs, the submitted ones not known to have ended
        (and that their providers have not forgotten): those worth asking about."""
        rows = self._query(
            "SELECT * FROM (SELECT * FROM jobs ORDER BY created_at DESC LIMIT ?) "
            f"WHERE role = ? AND provider_forgot = 0 AND peer_id != '' AND state NOT IN {_FINAL} "
            "ORDER BY created_at DESC",
            (limit, JobRole.SUBMITTED),
        )
        return [JobRecord.from_row(r) for r in rows]

    def finished_jobs_before(self, cutoff: float) -> list[JobRecord]:
        rows = self._query(
            f"SELECT * FROM jobs WHERE (state IN {_FINAL} "
            "OR provider_forgot = 1) AND created_at < ? ORDER BY created_at",
            (cutoff,),
        )
        return [JobRecord.from_row(r) for r in rows]

    def hosted_workdirs(self, peer_id: str) -> list[str]:
        """The folders the peer's hosted jobs worked in (their files may still be there)."""
        rows = self._query(
            "SELECT workdir FROM jobs WHERE role = ? AND peer_id = ? AND workdir != ''",
            (JobRole.HOSTED, peer_id),
        )
        return [str(row["workdir"]) for row in rows]

    def unfinished_hosted_jobs(self) -> list[JobRecord]:
        rows = self._query(
            f"SELECT * FROM jobs WHERE role = ? AND state NOT IN {_FINAL} ORDER BY created_at",
            (JobRole.HOSTED,),
        )
        return [JobRecord.from_row(r) for r in rows]

    def append_job_event(
        self,
        job_id: str,
        attempt: int,
        kind: str,
        data: bytes,
        *,
        log_cursor: dict[str, list[object]] | None = None,
        log_limit: int = 0,
        now: float | None = None,
    ) -> int:
        """Append one event to a hosted job's log; returns its sequence number.

        See :meth:`append_job_events`.
        """
        return self.append_job_events(
            job_id, attempt, [(kind, data)], log_cursor=log_cursor, log_limit=log_limit, now=now
        )

    def append_job_events(
        self,
        job_id: str,
        attempt: int,
        events: Sequence[tuple[str, bytes]],
        *,
        log_cursor: dict[str, list[object]] | None = None,
        log_limit: int = 0,
        now: float | None = None,
    ) -> int:
        """Append ``(kind, data)`` events to a hosted job's log in one transaction;
        returns the last sequence number.

        The engine-log cursor moves in the same transaction, so after a crash
        the log is resumed exactly where the stored events end. Output events
        (``stdout``/``stderr``) get their position in the job's output. With
        ``log_limit``, the oldest output is then deleted until what is kept is
        at most that many bytes (state events are kept: a job has few), and
        ``output_dropped`` counts it; a reader learns of the gap from the
        positions, so each is told exactly what it missed.
        """
        when = now or time.time()
        with self._transaction():
            row = self._db.execute(
                "SELECT last_seq, output_bytes, output_dropped FROM jobs "
                "WHERE role = ? AND job_id = ?",
                (JobRole.HOSTED, job_id),
            ).fetchone()
            seq, written, dropped = int(row[0]), int(row[1]), int(row[2])
            for kind, data in events:
                seq += 1
                position = -1
                if kind != "state":
                    position, written = written, written + len(data)
                self._db.execute(
                    "INSERT INTO job_events (job_id, seq, ts, attempt, kind, data, position) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (job_id, seq, when, attempt, kind, data, position),
                )
            if log_limit and written - dropped > log_limit:
                dropped += self._drop_oldest_output(job_id, written - dropped - log_limit)
            self._db.execute(
                "UPDATE jobs SET last_seq = ?, output_bytes = ?, output_dropped = ? "
                "WHERE role = ? AND job_id = ?",
                (seq, written, dropped, JobRole.HOSTED, job_id),
            )
            if log_cursor is not None:
                self._db.execute(
                    "UPDATE jobs SET log_cursor = ? WHERE role = ? AND job_id = ?",
                    (json.dumps(log_cursor), JobRole.HOSTED, job_id),
                )
        return seq

    def _drop_oldest_output(self, job_id: str, excess: int) -> int:
        """Delete the oldest output events of a job, at least ``excess`` bytes of them;
        returns how many bytes went (inside the caller's transaction)."""
        freed, last = 0, 0
        rows = self._db.execute(
            "SELECT seq, length(data) FROM job_events "
            "WHERE job_id = ? AND kind != 'state' ORDER BY seq",
            (job_id,),
        )
        for seq, size in rows:
            freed, last = freed + int(size), int(seq)
            if freed >= excess:
                break
        rows.close()
        self._db.execute(
            "DELETE FROM job_events WHERE job_id = ? AND kind != 'state' AND seq <= ?",
            (job_id, last),
        )
        return freed

    def job_events(self, job_id: str, after_seq: int = 0, limit: int = 1000) -> list[JobEvent]:
        rows = self._query(
            "SELECT * FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after_seq, limit),
        )
        return [
            JobEvent(
                r["job_id"],
                r["seq"],
                r["ts"],
                r["attempt"],
                r["kind"],
                bytes(r["data"]),
                r["position"],
            )
            for r in rows
        ]
