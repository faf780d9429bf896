"""A job's output without sockets: credited event sections, gaps a reader is told
of, and the store keeping a job's output within job_log_limit."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import msgspec
import pytest

from gpumesh.errors import ConfigError, FrameTooLargeError, ProtocolError
from gpumesh.protocol.framing import FrameKind, encode_frame
from gpumesh.protocol.joboutput import UNKNOWN, EventSection, OutputPosition, encode_events
from gpumesh.protocol.messages import (
    JobLogs,
    JobOutput,
    JobStatus,
    JobSubmit,
    decode_message,
    encode_message,
)
from gpumesh.store.config import Config
from gpumesh.store.db import MIGRATIONS, Store
from gpumesh.store.jobs import JobRecord


def _output(seq: int, data: bytes, offset: int = -1, stream: str = "stdout") -> JobOutput:
    return JobOutput(seq=seq, attempt=1, stream=stream, data=data, offset=offset)


# --- the credited section -----------------------------------------------------


def test_events_cut_anywhere_into_data_frames_decode_in_order() -> None:
    messages: list[JobOutput | JobStatus] = [
        JobStatus(job_id="abcdef12", seq=1, state="running", attempt=1, exit_code=None, message=""),
        *(_output(seq, bytes([seq]) * (seq * 997 % 32768), 0) for seq in range(2, 60)),
    ]
    data = encode_events(messages)
    for cut in (1, 7, 4096, 256 * 1024):
        section = EventSection()
        decoded = []
        for start in range(0, len(data), cut):
            decoded += section.feed(data[start : start + cut])
        section.end()
        assert decoded == messages


def test_a_section_that_ends_mid_message_is_refused() -> None:
    data = encode_events([_output(1, b"x" * 100)])
    section = EventSection()
    assert section.feed(data[:-1]) == []
    with pytest.raises(ProtocolError, match="middle of a message"):
        section.end()


def test_only_messages_travel_inside_a_section() -> None:
    with pytest.raises(ProtocolError, match="non-message frame"):
        EventSection().feed(encode_frame(FrameKind.DATA, b"nested"))
    with pytest.raises(FrameTooLargeError):  # one message at most 64 KiB, as on the stream
        EventSection().feed(b"\x01" + (1024 * 1024).to_bytes(4, "big"))


# --- what a reader is told ----------------------------------------------------


def test_a_reader_is_told_exactly_the_bytes_it_was_never_sent() -> None:
    reader = OutputPosition()
    assert reader.on_output(0, 10) == 0
    assert reader.on_output(10, 5) == 0
    assert reader.on_output(40, 5) == 25  # 15..40 dropped
    assert reader.known_dropped == 40
    assert reader.on_output(45, 1) == 0
    # A reader starting from the beginning after a drop is told at once.
    late = OutputPosition()
    assert late.on_output(40, 5) == 40
    assert late.known_dropped == 40


def test_an_unknown_offset_tells_nothing() -> None:
    resumed = OutputPosition(UNKNOWN)  # resumed after a seq, offset not known
    assert resumed.on_output(1000, 10) == 0
    assert resumed.on_output(2000, 10) == 990
    older = OutputPosition()
    assert older.on_output(-1, 10) == 0  # an older provider sends no offsets
    assert older.on_output(-1, 10) == 0
    assert older.known_dropped == 0


# --- wire compatibility -------------------------------------------------------


def test_job_messages_from_an_older_peer_decode_with_defaults() -> None:
    old_output = {"t": "job_output", "seq": 3, "attempt": 1, "stream": "stdout", "data": b"hi"}
    assert decode_message(msgspec.msgpack.encode(old_output)) == _output(3, b"hi", -1)
    old_logs = {"t": "job_logs", "job_id": "abcdef12", "after_seq": 0, "follow": True}
    assert decode_message(msgspec.msgpack.encode(old_logs)) == JobLogs(
        job_id="abcdef12", after_seq=0, follow=True, credited=False
    )
    submit = JobSubmit(
        job_id="abcdef12",
        image="busybox",
        command=["true"],
        env={},
        workdir_bytes=0,
        gpu_memory=0,
        retries=0,
        timeout=0.0,
        attach=True,
    )
    assert submit.credited is False  # unset by an older consumer: plain messages


def test_an_older_peer_ignores_the_new_fields() -> None:
    class OldJobOutput(msgspec.Struct, tag="job_output", tag_field="t"):
        seq: int
        attempt: int
        stream: str
        data: bytes

    data = encode_message(_output(3, b"hi", 12345))
    assert msgspec.msgpack.decode(data, type=OldJobOutput) == OldJobOutput(3, 1, "stdout", b"hi")
    with pytest.raises(ProtocolError):
        decode_message(encode_message(_output(3, b"hi", -2)))


# --- the store ----------------------------------------------------------------


def _hosted(store: Store, job_id: str = "abcdef123456") -> str:
    store.add_job(
        JobRecord(
            role="hosted",
            job_id=job_id,
            peer_id="peer",
            peer_name="bob",
            image="busybox",
            command=["true"],
            env={},
            gpu_memory=0,
            gpus=[],
            retries=0,
            timeout=0.0,
            workdir="",
            created_at=time.time(),
        )
    )
    return job_id


def _stored_output(store: Store, job_id: str) -> int:
    rows = store._query(
        "SELECT COALESCE(SUM(length(data)), 0) FROM job_events "
        "WHERE job_id = ? AND kind != 'state'",
        (job_id,),
    )
    return int(rows[0][0])


def test_output_gets_its_position_and_the_cursor_moves_with_it(store: Store) -> None:
    job = _hosted(store)
    state = json.dumps({"state": "running", "exit_code": None, "message": ""}).encode()
    store.append_job_event(job, 1, "state", state)
    last = store.append_job_events(
        job, 1, [("stdout", b"abc"), ("stderr", b"de"), ("stdout", b"")], log_cursor={"x": [1]}
    )
    assert last == 4
    events = store.job_events(job)
    assert [(e.seq, e.kind, e.position) for e in events] == [
        (1, "state", -1),
        (2, "stdout", 0),
        (3, "stderr", 3),
        (4, "stdout", 5),
    ]
    message = events[1].to_message()
    assert isinstance(message, JobOutput) and message.offset == 0
    record = store.job("hosted", job)
    assert record is not None
    assert (record.last_seq, record.output_bytes, record.output_dropped) == (4, 5, 0)
    assert record.log_cursor == {"x": [1]}


def test_the_oldest_output_is_dropped_beyond_the_limit_and_states_are_kept(store: Store) -> None:
    job = _hosted(store)
    limit = 100_000
    state = json.dumps({"state": "running", "exit_code": None, "message": ""}).encode()
    store.append_job_event(job, 1, "state", state, log_limit=limit)
    for n in range(200):
        store.append_job_events(job, 1, [("stdout", b"%07d" % n + b"x" * 993)], log_limit=limit)
        assert _stored_output(store, job) <= limit
    record = store.job("hosted", job)
    assert record is not None
    assert record.output_bytes == 200_000
    assert record.output_dropped + _stored_output(store, job) == 200_000
    events = store.job_events(job)
    assert events[0].kind == "state"  # kept, however old
    output = [e for e in events if e.kind == "stdout"]
    assert output[0].position == record.output_dropped  # the drop is a prefix of the output
    assert output[-1].data.startswith(b"0000199")
    reader = OutputPosition()
    told = sum(reader.on_output(e.position, len(e.data)) for e in output)
    assert told == record.output_dropped > 0


def test_job_log_limit_is_a_size_of_at_least_1mb(tmp_path: Path) -> None:
    config = Config.load(tmp_path / "config.toml")
    assert config.get("job_log_limit") == "64MB"
    assert config.set("job_log_limit", "2MB") == "2MB"
    for bad in ("512KB", "0", "lots"):
        with pytest.raises(ConfigError):
            config.set("job_log_limit", bad)


def test_the_migration_counts_what_jobs_already_stored(tmp_path: Path) -> None:
    path = tmp_path / "gpumesh.db"
    raw = sqlite3.connect(path)
    for migration in MIGRATIONS[:6]:
        raw.executescript(migration)
    raw.execute("PRAGMA user_version = 6")
    raw.execute(
        "INSERT INTO jobs (role, job_id, peer_id, peer_name, image, state, created_at, last_seq) "
        "VALUES ('hosted', 'abcdef123456', 'p', 'bob', 'busybox', 'running', 0, 2)"
    )
    raw.executemany(
        "INSERT INTO job_events (job_id, seq, ts, attempt, kind, data) VALUES (?, ?, 0, 1, ?, ?)",
        [("abcdef123456", 1, "stdout", b"12345"), ("abcdef123456", 2, "state", b"{}")],
    )
    raw.commit()
    raw.close()
    store = Store(path)
    try:
        record = store.job("hosted", "abcdef123456")
        assert record is not None and record.output_bytes == 5
        store.append_job_event("abcdef123456", 1, "stdout", b"678")
        assert [e.position for e in store.job_events("abcdef123456")] == [-1, -1, 5]
    finally:
        store.close()
