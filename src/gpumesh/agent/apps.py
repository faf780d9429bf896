"""The provider's side of `gpumesh app`: project folders synced into a peer's sandbox.

An app lives at ``/apps/NAME`` in the peer's sandbox (see
:mod:`gpumesh.agent.files`, which this service reaches only through the narrow
:class:`~gpumesh.agent.deps.SandboxFiles`). A sync is content-addressed and incremental: the
consumer sends a manifest (path, size, mode, SHA-256 of each file), the
provider compares it with its index of what the consumer put there before and
answers which files it needs and which it will delete, then applies a tar of
just those files: each file is unpacked outside the sandbox, checked against
its manifest hash, and renamed into place.

The index (``apps/<peer id>/NAME.json`` under the agent's home, outside the
sandbox) records each synced file's size, mtime and hash; a file whose size or
mtime no longer match (a job rewrote it) is hashed again, and a missing index
is rebuilt from the folder. Only files the consumer synced are ever deleted:
what jobs write there (their outputs) stays until the consumer removes it.

Beside the index, ``NAME.manifest`` keeps the last manifest applied and
its digest. A re-sync may send only a delta against that digest; when the
provider holds another manifest (or none), it answers ``AppNeeds(rebase)``
and the consumer sends the whole manifest.

The app folder is written by the peer's jobs while a sync works in it, so
every step there goes through :class:`gpumesh.files.sandbox.Tree`: files are
hashed, placed, deleted and their folders made relative to descriptors,
never through a symlink; received files are checked in the agent's own
staging folder before they are renamed in.

The running agent keeps both files' contents in memory after writing them
and reads them again only when the files no longer carry the stamp (inode,
size, mtime) they had then: after a restart, or when anything else wrote them.
One walk of the sandbox gives the quota usage and the folder's files with
their size and mtime, against which the index is checked.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import msgspec

from gpumesh.agent.deps import Handlers, OwnedJobs, Provider, RequestContext, SandboxFiles
from gpumesh.agent.sandboxfs import Usage, refusing, sandbox_parts
from gpumesh.blocking import in_thread
from gpumesh.errors import AccessDeniedError, ConfigError, ProtocolError
from gpumesh.files.hashing import SHA256, new_hasher
from gpumesh.files.manifest import Stamp, apply_delta
from gpumesh.files.manifest import digest as digest_of
from gpumesh.files.manifest import stamp as file_stamp
from gpumesh.files.sandbox import Tree, WalkStopped
from gpumesh.files.transfer import NoHash, swallow, unpack_from
from gpumesh.protocol.messages import (
    AppJobDir,
    AppJobDirReply,
    AppNeeds,
    AppPrepare,
    AppSend,
    AppSync,
    AppSynced,
    FileResume,
)

if TYPE_CHECKING:
    from gpumesh.store.peers import Peer
    from gpumesh.transport.stream import Stream

__all__ = ["APPS", "AppService", "app_path", "check_app_name"]

logger = logging.getLogger(__name__)

APPS = "apps"
"""The folder of apps in each sandbox."""
MAX_FILES = 1_000_000

Manifest = dict[str, tuple[int, int, str]]
"""Relative path -> (size, mode, sha256 hex)."""
Index = dict[str, tuple[int, int, str]]
"""Synced file -> (size, mtime_ns, sha256 hex) as it was written."""


PREPARED_FOR = 5.0
"""Seconds a walk begun on ``AppPrepare`` waits for its ``AppSync`` before it goes."""
PREPARED_WALKS = 2
"""Walks begun on ``AppPrepare`` that may run at once for one peer. A walk that
another ``AppPrepare`` replaced stops at its next entry, but counts until it has;
an ``AppPrepare`` past the cap begins none (its sync walks the folder itself)."""

T = TypeVar("T")


@dataclass
class _Walk:
    """A walk of an app's folder under way (or done): the files it lists, the usage."""

    folder: Tree | None
    """The folder walked, once it is open (None: not yet, or there is none)."""
    dry_run: bool
    began: float
    """``time.monotonic()`` when it began."""
    opened: asyncio.Future[None]
    """Done once ``folder`` is set, or known to stay None."""
    listing: dict[str, tuple[int, int]] = field(default_factory=dict)
    task: asyncio.Future[Usage | None] = field(init=False)
    stop: threading.Event = field(default_factory=threading.Event)
    """Set when the walk is let go: its thread ends at the next entry it looks at."""
    checked: tuple[_Synced | None, Index] | None = None
    """A prepared walk's index check, done as soon as it walked: the app's state
    it checked (the sync uses the index only when it loads that same state)."""


@dataclass
class _Synced:
    """One app's state and index as this agent last wrote them."""

    digest: str
    manifest: Manifest
    index: Index
    stamps: tuple[Stamp | None, Stamp | None]
    """Of the state file and the index file, right after writing them."""


class _StateFile(msgspec.Struct):
    digest: str
    files: dict[str, tuple[int, int, str]]


def check_app_name(name: str) -> str:
    """``name`` when it is one plain folder name; refused otherwise."""
    parts = sandbox_parts(name)
    if len(parts) != 1 or parts[0] != name or name.startswith("."):
        raise AccessDeniedError(f"app name {name!r} must be one folder name, not a path")
    return name


def app_path(name: str) -> str:
    """The app's folder, from the sandbox root."""
    return f"/{APPS}/{check_app_name(name)}"


class AppService:
    """Apps in each peer's sandbox."""

    def __init__(
        self, provider: Provider, files: SandboxFiles, jobs: OwnedJobs, *, index_root: Path
    ) -> None:
        self.provider = provider
        self.files = files
        self.jobs = jobs
        self.index_root = index_root
        """``apps/`` of the home: each peer's app indexes (outside every sandbox)."""
        self._synced: dict[tuple[str, str], _Synced] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        """One sync of an app at a time (they share its index)."""
        self._prepared: dict[tuple[str, str], _Walk] = {}
        """Walks begun on ``AppPrepare``, each for the ``AppSync`` of the app to come."""
        self._dropping: set[asyncio.Future[None]] = set()
        self._walking: dict[str, int] = {}
        """By peer id: walks begun on ``AppPrepare`` whose work has not ended yet."""

    def prepared_walks(self, peer_id: str) -> int:
        """Walks begun on ``AppPrepare`` for ``peer_id`` that are running now (at most
        :data:`PREPARED_WALKS`)."""
        return self._walking.get(peer_id, 0)

    def register(self, handlers: Handlers) -> None:
        handlers.add(AppSync, self.handle_sync)
        handlers.add(AppPrepare, self.handle_prepare)
        handlers.add(AppJobDir, self.handle_job_dir)

    def _index_file(self, peer: Peer, name: str) -> Path:
        folder = self.index_root / str(peer.node_id)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return folder / f"{name}.json"

    def _folder(self, peer: Peer, name: str, create: bool) -> Tree | None:
        """The app's folder in the peer's sandbox (made when ``create``), opened, or
        None when there is none yet; refused when a file or a link is where it
        should be (blocking)."""
        try:
            remote = app_path(name)
        except (AccessDeniedError, ConfigError) as exc:
            raise type(exc)(f"{self.provider.name} refused {exc.message}") from None
        parts = (APPS, name)
        with self.files.tree(peer) as tree:
            try:
                return tree.subtree(parts, create=create)
            except FileNotFoundError:
                return None  # a dry run of a new app
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self.files.link_refused(remote) from None
                if exc.errno == errno.ENOTDIR:
                    raise ConfigError(f"{remote} is not a folder on {self.provider.name}") from None
                raise

    @refusing
    async def handle_prepare(self, ctx: RequestContext, message: AppPrepare) -> None:
        """Begin walking the app's folder for the ``AppSync`` that follows. Nothing
        is made (a new app's folder is walked when its sync comes) and nothing is
        answered; while a sync of the app runs, its own walk serves it."""
        ctx.stream.finish()
        check_app_name(message.name)
        key = (str(ctx.peer.node_id), message.name)
        lock = self._locks.get(key)
        if lock is not None and lock.locked():
            return
        self._drop(self._prepared.pop(key, None))
        peer_id = key[0]
        if self._walking.get(peer_id, 0) >= PREPARED_WALKS:
            # Nothing is answered to a prepare: the sync finds no walk, and walks itself.
            logger.info(
                "[%s] app %s: %d walks still running; its sync walks it itself",
                ctx.peer.name,
                message.name,
                self._walking[peer_id],
            )
            return
        # Registered before anything is awaited: the sync right behind it finds it.
        loop = asyncio.get_running_loop()
        walk = _Walk(None, message.dry_run, time.monotonic(), loop.create_future())
        walk.task = asyncio.ensure_future(self._open_and_walk(ctx.peer, message.name, walk))
        walk.task.add_done_callback(swallow)
        self._walking[peer_id] = self._walking.get(peer_id, 0) + 1
        walk.task.add_done_callback(lambda _task: self._walked(peer_id))
        self._prepared[key] = walk
        loop.call_later(PREPARED_FOR, self._expire, key, walk)

    def _walked(self, peer_id: str) -> None:
        left = self._walking.pop(peer_id, 0) - 1
        if left > 0:
            self._walking[peer_id] = left

    async def _open_and_walk(self, peer: Peer, name: str, walk: _Walk) -> Usage | None:
        """Open the app's folder (when there is one: none is made) and walk it."""
        opening = asyncio.ensure_future(in_thread(self._folder, peer, name, False))
        try:
            walk.folder = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_opened)
            raise
        finally:
            _settle(walk.opened)
        if walk.folder is None:
            return None
        usage = await self._walk(peer, name, walk)
        # The index is checked against the walk right away, while the consumer scans.
        index_file = await in_thread(self._index_file, peer, name)
        state_file = index_file.with_name(f"{name}.manifest")
        key = (str(peer.node_id), name)
        synced = await in_thread(_load_synced, self._synced.get(key), state_file, index_file)
        recorded = synced.index if synced is not None else None
        index = await _to_its_end(
            walk.stop,
            in_thread(_current_index, walk.folder, recorded, walk.listing, walk.stop),
        )
        walk.checked = (synced, index)
        return usage

    def _begin_walk(self, peer: Peer, name: str, folder: Tree | None, dry_run: bool) -> _Walk:
        loop = asyncio.get_running_loop()
        walk = _Walk(folder, dry_run, time.monotonic(), loop.create_future())
        walk.opened.set_result(None)
        walk.task = asyncio.ensure_future(self._walk(peer, name, walk))
        walk.task.add_done_callback(swallow)
        return walk

    def _expire(self, key: tuple[str, str], walk: _Walk) -> None:
        if self._prepared.get(key) is walk:
            self._drop(self._prepared.pop(key))

    def _drop(self, walk: _Walk | None) -> None:
        """Let a walk go: stopped, then its folder closed (in the background)."""
        if walk is not None:
            dropping = asyncio.ensure_future(_end_walk(walk))
            self._dropping.add(dropping)
            dropping.add_done_callback(self._dropping.discard)

    def _take_prepared(self, key: tuple[str, str], dry_run: bool) -> _Walk | None:
        """The walk begun for this sync by its ``AppPrepare``, when one began lately."""
        walk = self._prepared.pop(key, None)
        if walk is None:
            return None
        if walk.dry_run != dry_run or time.monotonic() - walk.began > PREPARED_FOR:
            self._drop(walk)
            return None
        return walk

    @refusing
    async def handle_sync(self, ctx: RequestContext, message: AppSync) -> None:
        key = (str(ctx.peer.node_id), message.name)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            await self._sync_locked(ctx, message, key)

    async def _sync_locked(
        self, ctx: RequestContext, message: AppSync, key: tuple[str, str]
    ) -> None:
        # One walk: the files in the folder now (size, mtime) and the quota usage,
        # while the manifest is read and rebuilt. The usage is taken here rather
        # than when the files arrive: a round trip earlier, the same kind of
        # snapshot of the sandbox as the walk always was. A walk begun on the
        # sync's AppPrepare (after the consumer began it) is that snapshot too.
        walk = self._take_prepared(key, message.dry_run)
        if walk is not None:
            opened = walk.opened
            walk.task.add_done_callback(lambda _task: _settle(opened))
            await walk.opened  # set by the walk itself, at the latest when it ends
            if walk.folder is None:  # none then (a new app), or it failed: opened afresh
                await _end_walk(walk)
                walk = None
        if walk is None:
            folder = await in_thread(self._folder, ctx.peer, message.name, not message.dry_run)
            walk = self._begin_walk(ctx.peer, message.name, folder, message.dry_run)
        try:
            index_file = self._index_file(ctx.peer, message.name)
            await self._sync_walking(ctx, message, key, index_file, walk)
        finally:
            await _end_walk(walk)

    async def _walk(self, peer: Peer, name: str, walk: _Walk) -> Usage | None:
        """Fill the walk's listing with the folder's files; the peer's usage unless a
        dry run. Cancelled, it stops the walk and returns once its thread has."""
        if walk.dry_run:
            if walk.folder is not None:
                await _to_its_end(
                    walk.stop, in_thread(walk.folder.tally, ((), walk.listing), walk.stop)
                )
            return None
        listing = ((APPS, name), walk.listing)
        return await _to_its_end(walk.stop, self.files.usage(peer, listing=listing, stop=walk.stop))

    async def _sync_walking(
        self,
        ctx: RequestContext,
        message: AppSync,
        key: tuple[str, str],
        index_file: Path,
        walk: _Walk,
    ) -> None:
        peer, stream = ctx.peer, ctx.stream
        state_file = index_file.with_name(f"{message.name}.manifest")
        raw = await _read_section(stream, message.manifest_bytes, "manifest")
        synced = await in_thread(_load_synced, self._synced.get(key), state_file, index_file)
        if message.base:
            manifest: Manifest | None = None
            if synced is not None and synced.digest == message.base:
                put, remove = _parse_delta(raw)
                manifest = apply_delta(synced.manifest, put, remove)
                if digest_of(manifest) != message.digest:
                    manifest = None
            if manifest is None:
                stream.send_message(
                    AppNeeds(need=0, delete=0, unchanged=0, list_bytes=0, rebase=True), end=True
                )
                logger.info(
                    "[%s] app %s: delta on another base; asked for all", peer.name, message.name
                )
                return
            manifest_digest = message.digest
        else:
            manifest = _parse_manifest(raw)
            manifest_digest = ""
        usage = await walk.task
        folder = walk.folder
        if walk.checked is not None and walk.checked[0] is synced:
            index = walk.checked[1]  # checked against the same state, by the same walk
        else:
            recorded = synced.index if synced is not None else None
            index = await in_thread(_current_index, folder, recorded, walk.listing)
        need = sorted(p for p, entry in manifest.items() if index.get(p, (0, 0, ""))[2] != entry[2])
        delete = sorted(p for p in index if p not in manifest)
        unchanged = len(manifest) - len(need)
        listing_bytes = msgspec.json.encode({"need": need, "delete": delete})
        stream.send_message(
            AppNeeds(
                need=len(need),
                delete=len(delete),
                unchanged=unchanged,
                list_bytes=len(listing_bytes),
            )
        )
        for start in range(0, len(listing_bytes), 1 << 20):
            await stream.send_data(listing_bytes[start : start + (1 << 20)])
        stream.end_data()
        if usage is None or folder is None:  # a dry run (which never makes the folder)
            stream.finish()
            return
        send = await stream.expect(AppSend)
        usage.check(self.provider.name, send.size)
        temp = self.files.partials(peer) / f"app-{secrets.token_hex(8)}"
        received = 0
        limit = max(0, usage.quota - usage.used)
        wanted = send.channel and send.size > 0
        offer = self.files.channels.offer(ctx, wanted, FileResume(offset=0))
        self._synced.pop(key, None)  # until the files say what this sync did
        try:
            # Each file is checked against the manifest's hash when it is applied;
            # the tar's own hash is checked only where the data channel carries it.
            if offer is not None and await self.files.channels.receive_tar(
                ctx, offer, send.size, temp, limit, new_hasher(SHA256)
            ):
                received = send.size
            elif send.size:
                async with unpack_from(temp, limit, NoHash()) as feed:
                    while chunk := await stream.read_data():
                        received += len(chunk)
                        if received > send.size:
                            raise ProtocolError("the app files sent are larger than announced")
                        await feed(chunk)
                    if received != send.size:
                        raise ProtocolError(
                            f"the app files ended after {received} of {send.size} bytes"
                        )
                    await feed(None)
            else:
                while await stream.read_data():
                    raise ProtocolError("the app files sent are larger than announced")
            applied = await in_thread(_apply, temp, folder, manifest, index, need, delete)
            # The files are in place: the reply goes out before the state and the
            # index are written (still under the app's lock). Should they never
            # be written, the next sync's delta names a base this agent does not
            # hold (it asks for the whole manifest) and the old index is checked
            # against the folder as ever (a file it does not list is sent again).
            stream.send_message(
                AppSynced(
                    received=received, written=len(need), deleted=len(delete), unchanged=unchanged
                ),
                end=True,
            )
            try:
                self._synced[key] = await in_thread(
                    _save_synced, (state_file, index_file), (manifest, manifest_digest), applied
                )
            except OSError as exc:
                logger.warning(
                    "[%s] app %s: its index was not saved (%s)", peer.name, message.name, exc
                )
        finally:
            await in_thread(shutil.rmtree, temp, True)
        logger.info(
            "[%s] synced app %s: %d files written, %d deleted, %d unchanged",
            peer.name,
            message.name,
            len(need),
            len(delete),
            unchanged,
        )

    async def handle_job_dir(self, ctx: RequestContext, message: AppJobDir) -> None:
        job = self.jobs.owned(ctx.peer, message.job_id)
        relative = self._job_relative(ctx.peer, job.workdir, message.job_id)
        ctx.stream.send_message(AppJobDirReply(path="/" + relative), end=True)

    def _job_relative(self, peer: Peer, workdir: str, job_id: str) -> str:
        """A job's working folder from the sandbox root, when it lies in the sandbox.

        Worked out from the path the job was given (the sandbox's path and the
        parts it was asked for), never by resolving anything on disk.
        """
        root = str(self.files.sandbox(peer)) + os.sep
        if not workdir.startswith(root) or workdir == root:
            raise ConfigError(
                f"job {job_id} did not run in an app folder: "
                "only jobs started with `gpumesh app run` can be pulled"
            )
        return workdir[len(root) :].replace(os.sep, "/")


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _close_opened(opening: asyncio.Future[Tree | None]) -> None:
    """Close the folder a walk opened after it was let go."""
    if not opening.cancelled() and opening.exception() is None:
        folder = opening.result()
        if folder is not None:
            folder.close()


async def _to_its_end(stop: threading.Event, work: Awaitable[T]) -> T:
    """``work`` (a walk's step in a thread); when cancelled, ``stop`` is set and the
    step is waited for: nothing may close the folder it reads under it."""
    step = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(step)
    except asyncio.CancelledError:
        stop.set()
        step.add_done_callback(swallow)
        await asyncio.wait([step])
        raise


async def _end_walk(walk: _Walk) -> None:
    """Stop ``walk`` (when it still runs: at its next entry) and close its folder
    once it let go."""
    walk.stop.set()
    try:
        await asyncio.wait([walk.task])  # it reads through the folder's descriptor
    finally:
        walk.task.add_done_callback(lambda _task: _close_walked(walk))


def _close_walked(walk: _Walk) -> None:
    if walk.folder is not None:
        walk.folder.close()


async def _read_section(stream: Stream, size: int, what: str) -> bytes:
    data = bytearray()
    while chunk := await stream.read_data():
        data += chunk
        if len(data) > size:
            raise ProtocolError(f"the {what} is larger than announced")
    if len(data) != size:
        raise ProtocolError(f"the {what} ended after {len(data)} of {size} bytes")
    return bytes(data)


def _parse_manifest(raw: bytes) -> Manifest:
    try:
        data = json.loads(raw)
        entries = data["files"]
        if not isinstance(entries, list) or len(entries) > MAX_FILES:
            raise ValueError("files")
        manifest: Manifest = {}
        for path, size, mode, digest in entries:
            if _check_entry(path, size, mode, digest) in manifest:
                raise ValueError(path)
            manifest[path] = (size, mode, digest)
    except (ValueError, TypeError, KeyError) as exc:
        raise ProtocolError(f"the app manifest is not valid ({exc})") from None
    return manifest


def _check_entry(path: object, size: object, mode: object, digest: object) -> str:
    """One manifest entry's fields, checked (types, bounds, a clean sandbox path); its path."""
    if not (
        isinstance(path, str)
        and isinstance(size, int)
        and isinstance(mode, int)
        and isinstance(digest, str)
        and size >= 0
        and 0 <= mode <= 0o777
        and len(digest) == 64
    ):
        raise ValueError(path)
    bytes.fromhex(digest)
    parts = sandbox_parts(path)
    if not parts or "/".join(parts) != path:
        raise ValueError(path)
    return path


def _parse_delta(raw: bytes) -> tuple[Manifest, list[str]]:
    """A delta's entries (checked as a manifest's are) and the paths it removes."""
    try:
        data = json.loads(raw)
        entries, removed = data["put"], data["remove"]
        if not isinstance(entries, list) or not isinstance(removed, list):
            raise ValueError("put")
        if len(entries) + len(removed) > MAX_FILES:
            raise ValueError("too many entries")
        put: Manifest = {}
        for path, size, mode, digest in entries:
            put[_check_entry(path, size, mode, digest)] = (size, mode, digest)
        if not all(isinstance(path, str) for path in removed):
            raise ValueError("remove")
    except (ValueError, TypeError, KeyError) as exc:
        raise ProtocolError(f"the app manifest delta is not valid ({exc})") from None
    return put, [str(path) for path in removed]


def _load_synced(cached: _Synced | None, state_file: Path, index_file: Path) -> _Synced | None:
    """The app's state and index: ``cached`` while both files are the ones written
    with it, else as the files hold them now (None without a usable state file).

    Either file may be missing or broken (then that part is rebuilt); they are
    our own files, written only after what they hold was checked.
    """
    stamps = (file_stamp(state_file), file_stamp(index_file))
    if cached is not None and cached.stamps == stamps and None not in stamps:
        return cached
    state = _load(state_file, _StateFile)
    if state is None:
        return None
    index = _load(index_file, Index)
    return _Synced(state.digest, state.files, index if index is not None else {}, stamps)


def _load(path: Path, kind: type[T]) -> T | None:
    """One of our files as ``kind``; None when it is missing or broken."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=kind)
    except (OSError, msgspec.MsgspecError):
        return None


def _write(path: Path, data: bytes) -> Stamp | None:
    part = path.with_name(path.name + ".tmp")
    part.write_bytes(data)
    os.replace(part, path)
    return file_stamp(path)


def _hash(fd: int) -> str:
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _current_index(
    folder: Tree | None,
    recorded: Index | None,
    listing: dict[str, tuple[int, int]],
    stop: threading.Event | None = None,
) -> Index:
    """Synced file -> (size, mtime_ns, sha256 hex), checked against the folder now.

    ``listing`` holds each regular file in the folder now, with its size and
    mtime (symlinks and what lies behind them are not in it). A recorded
    file that changed since it was synced is hashed again; one that is gone
    drops out. Without an index every file in the folder counts (rebuilt).
    """
    if recorded is None:
        recorded = dict.fromkeys(listing, (-1, -1, ""))
    current: Index = {}
    for rel, (size, mtime_ns, digest) in recorded.items():
        if stop is not None and stop.is_set():
            raise WalkStopped
        found = listing.get(rel)
        if found is None or folder is None:
            continue
        sha = digest
        if found[0] != size or found[1] != mtime_ns or not sha:
            try:
                sha = _hash(folder.open_file(rel.split("/")))  # through its descriptor
            except OSError:
                continue
        current[rel] = (found[0], found[1], sha)
    return current


def _save_synced(files: tuple[Path, Path], applied: tuple[Manifest, str], saved: Index) -> _Synced:
    """Write the state (the manifest and its digest, computed when not given) and
    the index :func:`_apply` gave; what was written, for the next sync."""

    state_file, index_file = files
    manifest, manifest_digest = applied
    manifest_digest = manifest_digest or digest_of(manifest)
    index_stamp = _write(index_file, msgspec.json.encode(saved))
    state_stamp = _write(
        state_file, msgspec.json.encode({"digest": manifest_digest, "files": manifest})
    )
    return _Synced(manifest_digest, manifest, saved, (state_stamp, index_stamp))


def _apply(
    temp: Path,
    folder: Tree,
    manifest: Manifest,
    index: Index,
    need: list[str],
    delete: list[str],
) -> Index:
    """Check and rename the received files into place, delete the ones gone; the new index.

    ``temp`` is the agent's own staging folder (no job reaches it): the files
    there are checked by name. Everything in ``folder`` goes through its
    descriptor.
    """
    for rel in need:
        source = temp / rel
        if source.is_symlink() or not source.is_file():
            raise ProtocolError(f"the app files sent lack {rel}")
        if _hash(os.open(source, os.O_RDONLY | os.O_NOFOLLOW)) != manifest[rel][2]:
            raise ProtocolError(f"{rel} does not match its SHA-256 in the manifest")
    for rel in need:
        source = temp / rel
        parts = rel.split("/")
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, manifest[rel][1] | 0o600)  # jobs may rewrite it
            folder.own(fd)
        finally:
            os.close(fd)
        staged = os.open(source.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            # Whatever the job put in the way (a folder, or a file or link where a
            # folder must be) gives way; nothing is ever followed.
            folder.place(staged, source.name, parts, clear=True)
        finally:
            os.close(staged)
        try:
            st = folder.lstat(parts)
        except OSError:  # a job changed the folder meanwhile: the next sync sends it again
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            index[rel] = (st.st_size, st.st_mtime_ns, manifest[rel][2])
    for rel in delete:
        parts = rel.split("/")
        folder.unlink(parts)
        index.pop(rel, None)
        folder.prune_empty(parts, stop=0)
    return {rel: entry for rel, entry in index.items() if rel in manifest}
