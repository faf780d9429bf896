"""The consumer's side of `gpumesh app`: sync a project folder, pull a job's outputs.

A sync sends a manifest of the folder (what ``.gpumeshignore`` and the
defaults let through: each regular file's path, size, mode and SHA-256) and
then only the files the provider says it lacks, as one tar. Hashes are cached
in ``$GPUMESH_HOME/appcache/`` keyed by (path, size, mtime_ns), so an
unchanged tree is not read again. Symlinks and empty folders are not synced.

The manifest the provider confirmed last is kept there too, per (peer, app),
with its digest: a re-sync sends only the delta against it (the provider
applies it only on the same base, else asks for the whole manifest), so an
unchanged tree of 10,000 files costs a few hundred bytes, not a megabyte.

A long-lived process (the node process) keeps what it read and wrote of
those files in memory, each with the stamp (inode, size, mtime_ns) the file
had: it is read again only when the stamp changed (another process wrote
it). It keeps each folder's last scan too (:class:`gpumesh.files.pack.ScanMemo`),
so a file listed again unchanged is not decided again; on Linux the memo
also watches the folder (inotify), and a re-scan lists again only the
subfolders something changed in.

As a sync begins, ``AppPrepare`` tells the provider to walk its copy while
this side scans (a provider without it refuses that stream only).

Nothing here prints; results go to the caller.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from gpumesh.blocking import in_thread
from gpumesh.client.bulk import NoChannel, answer_after_offer, receive_tar, send_tar, why_no_channel
from gpumesh.client.cpdownload import remove_part
from gpumesh.client.files import STALL_TIMEOUT
from gpumesh.client.jobs import new_job_id, run_job
from gpumesh.errors import ConfigError, NotFoundError, ProtocolError
from gpumesh.files.hashing import SHA256, label, new_hasher, offered, taken
from gpumesh.files.manifest import Stamp, delta, digest
from gpumesh.files.manifest import stamp as file_stamp
from gpumesh.files.pack import PackPlan, ScanMemo, scan, tar_size
from gpumesh.files.transfer import NoHash, merge_into, tar_chunks, unpack_from
from gpumesh.protocol.messages import (
    JOB_ID_PATTERN,
    AppJobDir,
    AppJobDirReply,
    AppNeeds,
    AppPrepare,
    AppSend,
    AppSync,
    AppSynced,
    DirGet,
    FileDone,
    FileInfo,
    FileResume,
    FileStat,
)
from gpumesh.protocol.states import JobRole

if TYPE_CHECKING:
    from gpumesh.client.jobs import JobCallbacks, JobResult
    from gpumesh.client.jobspec import JobSpec
    from gpumesh.client.node import Node
    from gpumesh.files.pack import PackEntry, Skipped
    from gpumesh.store.peers import Peer
    from gpumesh.transport.session import Session
    from gpumesh.transport.stream import Stream

__all__ = [
    "AppRun",
    "SyncResult",
    "app_folder",
    "job_folder",
    "pull_folder",
    "pull_job",
    "pull_out",
    "run_app",
    "sync_app",
]

_CHUNK = 1 << 20
SMALL_TAR = 1 << 20
"""A tar of fewer bytes goes over QUIC on the session already open: a data
channel's TCP connect and TLS handshake cost more than such bytes do."""


@dataclass
class SyncResult:
    """What one sync did (or, with ``dry_run``, would do)."""

    peer: str
    remote: str
    """The app's folder in the sandbox, ``/apps/NAME``."""
    dry_run: bool
    bytes_sent: int = 0
    """Bytes of the files sent, their contents (0 on a dry run; the tar that carries
    them adds 512 bytes of header a file and rounds each up to 512)."""
    manifest_bytes: int = 0
    """Bytes of the manifest sent (the list of files and their hashes, or its delta)."""
    manifest: str = "full"
    """``delta`` when only the changes since the last confirmed manifest were sent
    (and accepted), ``full`` when the whole list was."""
    sent: list[str] = field(default_factory=list)
    """Files sent (on a dry run: that would be sent)."""
    deleted: list[str] = field(default_factory=list)
    unchanged: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    seconds: float = 0.0
    channel: str = ""
    """What carried the files: ``tls`` (the data channel), ``quic``, or empty (none sent)."""
    no_channel: str = ""
    """With ``quic``: why not the data channel (see :class:`gpumesh.client.bulk.NoChannel`)."""


@dataclass
class AppRun:
    """What ``run_app`` did: the sync, the job, and the folder pulled back."""

    sync: SyncResult
    job: JobResult
    out_remote: str = ""
    """The app's folder pulled back (``/apps/NAME/OUT``), or empty without ``out``."""
    pulled: bool = False
    """False with ``out`` when the job left no such folder: nothing was pulled."""


@contextlib.asynccontextmanager
async def _on(
    node: Node,
    peer: Peer,
    session: Session | None,
    before: Callable[[Session], None] | None = None,
) -> AsyncIterator[Session]:
    """``session`` when it is given and still open, else a new one (closed after).
    ``before``: a notice safe to send twice, sent on the session before anything
    else (on a warm one, before the ping that checks it is alive)."""
    if session is not None and not session.link.is_closed:
        if before is not None:
            before(session)
        yield session
        return
    async with node.live_session(peer.node_id, before=before) as opened:
        yield opened


def app_folder(name: str) -> str:
    """``/apps/NAME`` for a local folder's name."""
    return f"/apps/{name}"


def _cache_file(node: Node, key: str, prefix: str = "") -> Path:
    """``$GPUMESH_HOME/appcache/PREFIX<hash of key>.json``."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    folder = node.home.appcache_dir
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder / f"{prefix}{digest}.json"


_HELD_MAX = 64
"""Files and folder scans kept in memory at most (each app sync needs three)."""
_held: dict[str, tuple[Stamp, object]] = {}
"""Our own cache and state files as last read or written, by path, with their stamp."""
_scans: dict[str, ScanMemo] = {}
_WATCHED_MAX = 8
"""Folders whose scans the kernel watches at most (each takes one of the user's
inotify instances, of which there are few)."""
_held_lock = threading.Lock()


def _read_held(path: Path, kind: type[Any]) -> Any:
    """``path`` decoded as ``kind``: what was held of it while its stamp is the same.

    Raises ``OSError`` or ``msgspec.MsgspecError`` as reading it would."""
    stamp = file_stamp(path)
    held = _held.get(str(path))
    if stamp is not None and held is not None and held[0] == stamp:
        return held[1]
    value = msgspec.json.decode(path.read_bytes(), type=kind)
    if stamp is not None:  # stat-ed before reading: a write between only costs a re-read
        _hold(str(path), (stamp, value))
    return value


def _write_held(path: Path, value: object) -> None:
    """Write ``path`` (whole, by rename) and hold ``value`` as its contents."""
    part = path.with_name(path.name + ".tmp")
    part.write_bytes(msgspec.json.encode(value))
    os.replace(part, path)
    stamp = file_stamp(path)
    if stamp is not None:
        _hold(str(path), (stamp, value))


def _hold(key: str, held: tuple[Stamp, object]) -> None:
    with _held_lock:
        if len(_held) >= _HELD_MAX and key not in _held:
            _held.clear()
        _held[key] = held


def _scan_memo(folder: Path) -> ScanMemo:
    key = os.path.abspath(folder)
    with _held_lock:
        memo = _scans.get(key)
        if memo is None:
            if len(_scans) >= _HELD_MAX:
                _scans.clear()  # a watch goes with its memo (its descriptor closed)
            watching = sum(held.watching for held in _scans.values()) < _WATCHED_MAX
            memo = _scans[key] = ScanMemo(watch=watching)
        return memo


def _manifest(
    node: Node, folder: Path
) -> tuple[PackPlan, list[tuple[str, int, int, str]], dict[str, PackEntry]]:
    """Scan ``folder`` and hash its files (through the cache): the plan and the manifest."""

    plan = scan(folder, exclude_paths=[node.home.path], memo=_scan_memo(folder))
    cache_path = _cache_file(node, str(plan.root))
    cache: dict[str, tuple[int, int, str]] = {}
    with contextlib.suppress(OSError, msgspec.MsgspecError):
        cache = _read_held(cache_path, dict[str, tuple[int, int, str]])
    entries: list[tuple[str, int, int, str]] = []
    by_path: dict[str, PackEntry] = {}
    fresh: dict[str, tuple[int, int, str]] = {}
    changed = False
    for entry in plan.files:
        if entry.kind != "file":
            continue
        path, size, mtime_ns = entry.path, entry.size, entry.mtime_ns
        # The scan's own stat: size and mtime as they were when the file was listed.
        cached = cache.get(path)
        if cached is not None and cached[0] == size and cached[1] == mtime_ns:
            fresh[path] = cached
            digest = cached[2]
        else:
            digest = _hash(plan.root / path, size)
            fresh[path] = (size, mtime_ns, digest)
            changed = True
        entries.append((path, size, entry.mode, digest))
        by_path[path] = entry
    if changed or len(fresh) != len(cache):
        _write_held(cache_path, fresh)
    return plan, entries, by_path


class _State(msgspec.Struct):
    digest: str
    files: dict[str, tuple[int, int, str]]


def _load_state(path: Path) -> tuple[str, dict[str, tuple[int, int, str]]] | None:
    try:
        state: _State = _read_held(path, _State)
    except (OSError, msgspec.MsgspecError):
        return None
    return state.digest, state.files


def _hash(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    read = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            read += len(chunk)
    if read != size:
        raise ConfigError(f"{path} changed while it was scanned; sync again")
    return digest.hexdigest()


async def sync_app(
    node: Node,
    peer_query: str,
    folder: Path,
    *,
    name: str | None = None,
    dry_run: bool = False,
    incremental: bool = True,
    reuse: Session | None = None,
) -> SyncResult:
    """Sync ``folder`` into the peer's ``/apps/NAME`` (NAME: the folder's name).

    ``incremental=False`` sends the whole manifest even when a delta would do.
    ``reuse``: an open session with the peer to use (else one is opened).
    """

    started = time.perf_counter()
    peer = node.peer(peer_query)
    name = name if name is not None else await in_thread(_name_of, folder)
    # Where the manifest the peer confirmed for this app is kept.
    state_file = _cache_file(node, f"{peer.node_id!s}\n{name}", "sync-")
    # The folder is scanned (and the last confirmed manifest read) while we dial.
    scanning = in_thread(_scan_with_state, node, folder, state_file if incremental else None)
    scanning.add_done_callback(_retrieved)
    # The provider walks its copy while we scan ours, even while a warm session is
    # checked.
    prepare = functools.partial(_prepare, name=name, dry_run=dry_run)
    async with _on(node, peer, reuse, before=prepare) as session:
        plan, entries, by_path, state = await scanning
        result = SyncResult(peer.name, app_folder(name), dry_run, skipped=list(plan.skipped))
        files = {path: (size, mode, sha) for path, size, mode, sha in entries}
        current = digest(files)
        bases = [state[0], ""] if state is not None else [""]
        for base in bases:
            if base and state is not None:
                put, remove = delta(state[1], files)
                body = msgspec.json.encode({"put": put, "remove": remove})
            else:  # the whole manifest, only when no delta was accepted
                body = msgspec.json.encode({"files": entries})
            stream = session.open_stream()
            try:
                stream.send_message(
                    AppSync(
                        name=name,
                        manifest_bytes=len(body),
                        dry_run=dry_run,
                        base=base,
                        digest=current if base else "",
                    )
                )
                await _send_bytes(stream, body)
                result.manifest_bytes += len(body)
                result.manifest = "delta" if base else "full"
                needs = await stream.expect(AppNeeds)
                if needs.rebase:
                    continue  # the provider holds another manifest: send it all
                await _apply_needs(
                    (node, session, peer), stream, needs, plan, by_path, result, folder
                )
            finally:
                session.link.forget_stream(stream.stream_id)
            break
        else:
            raise ProtocolError(f"{peer.name} asked for the whole manifest twice")
    if not dry_run:
        await in_thread(_write_held, state_file, _State(current, files))
    result.seconds = time.perf_counter() - started
    return result


def _prepare(session: Session, name: str, dry_run: bool) -> None:
    """Tell the provider a sync of ``name`` begins, so that it walks its copy while
    we scan ours (a provider that does not know the message refuses its stream:
    nothing is waited for, nothing read)."""
    stream = session.open_stream()
    try:
        stream.send_message(AppPrepare(name=name, dry_run=dry_run), end=True)
    finally:
        session.link.forget_stream(stream.stream_id)


def _scan_with_state(
    node: Node, folder: Path, state_file: Path | None
) -> tuple[
    PackPlan,
    list[tuple[str, int, int, str]],
    dict[str, PackEntry],
    tuple[str, dict[str, tuple[int, int, str]]] | None,
]:
    plan, entries, by_path = _manifest(node, folder)
    state = _load_state(state_file) if state_file is not None else None
    return plan, entries, by_path, state


def _retrieved(future: Any) -> None:
    if not future.cancelled():
        future.exception()


async def _apply_needs(
    where: tuple[Node, Session, Peer],
    stream: Stream,
    needs: AppNeeds,
    plan: PackPlan,
    by_path: dict[str, PackEntry],
    result: SyncResult,
    folder: Path,
) -> None:
    """Read what the provider lacks, and (unless a dry run) send it as one tar."""

    node, session, peer = where
    listing = json.loads(await _read_bytes(stream, needs.list_bytes))
    need = [str(path) for path in listing["need"]]
    if any(path not in by_path for path in need):
        raise ProtocolError(f"{peer.name} asked for a file that was not offered")
    result.sent = need
    result.deleted = [str(path) for path in listing["delete"]]
    result.unchanged = needs.unchanged
    if result.dry_run:
        stream.finish()
        return
    subset = PackPlan(plan.root, tuple(by_path[path] for path in need), ())
    size = await in_thread(tar_size, subset) if need else 0
    no_channel = why_no_channel(node, peer, session) if need else None
    if need and no_channel is None and size < SMALL_TAR:
        no_channel = NoChannel.SMALL
    stream.send_message(AppSend(size=size, channel=bool(need) and no_channel is None))
    offer, _resume = await answer_after_offer(stream, FileResume)
    if need:
        digest = None
        if offer is not None:
            # AppSend names no hash: its tar is checked with SHA-256 (as over QUIC).
            digest = await send_tar(
                node, session, peer, stream, offer, subset, size, SHA256, _ignore, STALL_TIMEOUT
            )
        result.channel = "tls" if digest is not None else "quic"
        if digest is None:
            result.no_channel = no_channel or (
                NoChannel.FAILED if offer is not None else NoChannel.NOT_OFFERED
            )
            await _send_tar_quic(stream, subset, size, folder)
    else:
        stream.end_data()
    stream.finish()
    done = await stream.expect(AppSynced)
    if done.received != size:
        raise ProtocolError(f"{peer.name} received {done.received} of {size} bytes")
    result.bytes_sent = subset.total_bytes if need else 0  # what the files hold, not the tar


async def _send_tar_quic(stream: Stream, subset: PackPlan, size: int, folder: Path) -> None:
    sent = 0
    async with contextlib.aclosing(tar_chunks(subset, NoHash())) as chunks:
        async for chunk in chunks:
            await stream.send_data(chunk)
            sent += len(chunk)
    if sent != size:
        raise ConfigError(f"{folder} changed while it was packed; sync again")
    stream.end_data()


def _ignore(_count: int) -> None:
    return None


def _name_of(folder: Path) -> str:
    if not folder.is_dir():
        raise NotFoundError(f"{folder} is not an existing folder")
    name = Path(os.path.abspath(folder)).name
    if not name:
        raise ConfigError(f"{folder} has no name to sync it under")
    return name


async def _send_bytes(stream: Stream, data: bytes) -> None:
    for start in range(0, len(data), _CHUNK):
        await stream.send_data(data[start : start + _CHUNK])
    stream.end_data()


async def _read_bytes(stream: Stream, size: int) -> bytes:
    data = bytearray()
    while chunk := await stream.read_data():
        data += chunk
        if len(data) > size:
            raise ProtocolError("the peer sent more than it announced")
    if len(data) != size:
        raise ProtocolError("the peer sent less than it announced")
    return bytes(data)


# --- pulling ---------------------------------------------------------------------------------


async def run_app(
    node: Node,
    peer_query: str,
    folder: Path,
    spec: JobSpec,
    *,
    out: Path | None = None,
    callbacks: JobCallbacks | None = None,
    synced: Callable[[SyncResult], None] | None = None,
    job_id: str | None = None,
) -> AppRun:
    """Sync ``folder``, run ``spec`` in it and, with ``out``, pull the app's folder
    named like ``out`` back into ``out``: all on one session with the peer (a
    follow that had to redial goes on on its new link, and so does the pull).
    ``synced`` hears of the sync before the job starts."""

    peer = node.peer(peer_query)
    async with node.live_session(peer.node_id) as session:
        sync = await sync_app(node, peer.node_id, folder, reuse=session)
        if synced is not None:
            synced(sync)
        job = await run_job(
            node,
            spec,
            callbacks=callbacks,
            job_id=job_id or new_job_id(),
            sandbox_dir=sync.remote,
            reuse=session,
        )
        run = AppRun(sync, job)
        if out is not None:
            await pull_out(node, peer.node_id, run, out, reuse=session)
    return run


async def pull_out(
    node: Node, peer_query: str, run: AppRun, out: Path, *, reuse: Session | None = None
) -> None:
    """Pull the app's folder named like ``out`` into ``out`` once ``run``'s job ended
    (``run.pulled`` stays False when the job left no such folder)."""
    out_name = Path(await in_thread(os.path.abspath, out)).name
    run.out_remote = f"{run.sync.remote}/{out_name}"
    try:
        await pull_folder(node, peer_query, run.out_remote, out, reuse=reuse)
    except NotFoundError:
        return
    run.pulled = True


def app_job(node: Node, query: str, peer_query: str = "") -> tuple[Peer, str]:
    """The provider and full id of the job ``query`` names for ``app
    pull``: a job this node started, by its id or a prefix of it, its provider
    known from the record; else, with ``peer_query`` given, a full id there (a
    job started from another machine)."""

    try:
        record = node.home.store.find_job(query, role=JobRole.SUBMITTED)
    except NotFoundError:
        if not peer_query:
            raise NotFoundError(
                f"no job {query!r} was started from here: give its full id and its "
                "provider with --peer, or see `gpumesh jobs`"
            ) from None
        if not re.match(JOB_ID_PATTERN, query):
            raise NotFoundError(
                f"no job {query!r} was started from here: give the job's full id "
                "(a prefix works only for jobs started from this node)"
            ) from None
        return node.peer(peer_query), query
    if peer_query and node.peer(peer_query).node_id != record.peer_id:
        raise NotFoundError(
            f"job {record.job_id} ran on {record.peer_name}, not on {peer_query}: leave out --peer"
        )
    return node.home.store.peer_by_id(record.peer_id), record.job_id


async def pull_job(
    node: Node, peer_query: str, job_id: str, dest: Path, *, reuse: Session | None = None
) -> tuple[str, int]:
    """Copy the folder a past ``app run`` job ran in into ``dest``, on one session:
    the folder's path there and the tar's bytes."""
    peer = node.peer(peer_query)
    async with _on(node, peer, reuse) as session:
        remote = await job_folder(node, peer.node_id, job_id, reuse=session)
        return remote, await pull_folder(node, peer.node_id, remote, dest, reuse=session)


async def job_folder(
    node: Node, peer_query: str, job_id: str, *, reuse: Session | None = None
) -> str:
    """The sandbox folder a past ``app run`` job ran in (``/apps/NAME``)."""
    peer = node.peer(peer_query)
    async with _on(node, peer, reuse) as session:
        stream = session.open_stream()
        try:
            stream.send_message(AppJobDir(job_id=job_id), end=True)
            reply = await stream.expect(AppJobDirReply)
        finally:
            session.link.forget_stream(stream.stream_id)
    return reply.path


async def pull_folder(
    node: Node, peer_query: str, remote: str, dest: Path, *, reuse: Session | None = None
) -> int:
    """Copy the sandbox folder ``remote`` to ``dest`` (created, or merged into); its tar bytes.

    Raises ``NotFoundError`` when ``remote`` is not a folder there.
    """
    peer = node.peer(peer_query)
    async with _on(node, peer, reuse) as session:
        info = await _stat(session, remote)
        if not info.exists or info.kind != "dir":
            raise NotFoundError(f"{peer.name}:{remote} is not a folder")
        return await _get_folder(node, session, peer, remote, dest)


async def _stat(session: Session, remote: str) -> FileInfo:
    stream = session.open_stream()
    try:
        stream.send_message(FileStat(path=remote), end=True)
        return await stream.expect(FileInfo)
    finally:
        session.link.forget_stream(stream.stream_id)


async def _get_folder(node: Node, session: Session, peer: Peer, remote: str, dest: Path) -> int:
    """The folder's tar, over the data channel when one opens, unpacked and placed."""

    temp = dest.with_name(dest.name + ".gpumesh-part")
    await in_thread(_prepare_dest, dest, temp)
    wanted = why_no_channel(node, peer, session) is None
    stream = session.open_stream()
    try:
        asked = offered()
        # Not ended: credit flows back.
        stream.send_message(DirGet(path=remote, hashes=asked, channel=wanted))
        offer, info = await answer_after_offer(stream, FileInfo)
        hash_name = taken(info.hash, asked)
        received = None
        if offer is not None:
            unpacked = await receive_tar(
                node,
                session,
                peer,
                stream,
                offer,
                info.size,
                hash_name,
                temp,
                _ignore,
                STALL_TIMEOUT,
            )
            received = None if unpacked is None else info.size
        try:
            if received is None:
                received = await _get_folder_quic(stream, peer, remote, temp, info.size, hash_name)
            await in_thread(_place, temp, dest)
        finally:
            await in_thread(remove_part, temp)
    finally:
        with contextlib.suppress(Exception):
            stream.finish()
        session.link.forget_stream(stream.stream_id)
    return received


async def _get_folder_quic(
    stream: Stream, peer: Peer, remote: str, temp: Path, size: int, hash_name: str
) -> int:
    hasher = new_hasher(hash_name)
    received = 0
    async with unpack_from(temp, size, hasher) as feed:
        while chunk := await stream.read_data():
            received += len(chunk)
            if received > size:
                raise ProtocolError(f"{peer.name} sent more than the folder's size")
            await feed(chunk)
        await feed(None)
    done = await stream.expect(FileDone)
    if received != size or done.digest != hasher.digest():
        raise ProtocolError(
            f"the copy of {peer.name}:{remote} did not match its {label(hash_name)} hash"
        )
    return received


def _prepare_dest(dest: Path, temp: Path) -> None:
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise ConfigError(f"{dest} is not a folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_part(temp)


def _place(temp: Path, dest: Path) -> None:
    if not dest.exists():
        os.rename(temp, dest)
        return
    merge_into(temp, dest)
