"""The provider's side of `gpumesh app`: project folders synced into a peer's sandbox.

An app lives at ``/apps/NAME`` in the peer's sandbox (see
:mod:`gpumesh.agent.files`). A sync is content-addressed and incremental: the
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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumesh.blocking import in_thread
from gpumesh.errors import AccessDeniedError, ConfigError, ProtocolError
from gpumesh.files.transfer import inside, unpack_from
from gpumesh.protocol.messages import (
    AppJobDir,
    AppJobDirReply,
    AppNeeds,
    AppSend,
    AppSync,
    AppSynced,
    FileResume,
    Message,
)

if TYPE_CHECKING:
    from gpumesh.agent.files import FileService
    from gpumesh.agent.server import RequestContext
    from gpumesh.store.db import Peer
    from gpumesh.transport.stream import Stream

__all__ = ["APPS", "AppService", "app_path", "check_app_name"]

logger = logging.getLogger(__name__)

APPS = "apps"
"""The folder of apps in each sandbox."""
MAX_FILES = 1_000_000

Manifest = dict[str, tuple[int, int, str]]
"""Relative path -> (size, mode, sha256 hex)."""


def check_app_name(name: str) -> str:
    """``name`` when it is one plain folder name; refused otherwise."""
    from gpumesh.agent.files import sandbox_parts

    parts = sandbox_parts(name)
    if len(parts) != 1 or parts[0] != name or name.startswith("."):
        raise AccessDeniedError(f"app name {name!r} must be one folder name, not a path")
    return name


def app_path(name: str) -> str:
    """The app's folder, from the sandbox root."""
    return f"/{APPS}/{check_app_name(name)}"


class AppService:
    """Apps in each peer's sandbox."""

    def __init__(self, files: FileService) -> None:
        self.files = files
        self.index_root = files.agent.home.path / APPS

    def _index_file(self, peer: Peer, name: str) -> Path:
        folder = self.index_root / str(peer.node_id)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return folder / f"{name}.json"

    def _folder(self, peer: Peer, name: str, create: bool) -> Path:
        """The app's real folder in the peer's sandbox (made when ``create``), never outside it."""
        try:
            remote = app_path(name)
        except (AccessDeniedError, ConfigError) as exc:
            raise type(exc)(f"{self.files.agent.name} refused {exc.message}") from None
        folder = self.files.resolve(peer, remote)
        root = os.path.realpath(self.files.sandbox(peer))
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise ConfigError(f"{remote} is not a folder on {self.files.agent.name}")
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        real = os.path.realpath(folder)
        if not inside(real, root) or real == root:
            raise AccessDeniedError(
                f"{self.files.agent.name} refused {remote}: outside your folder"
            )
        return Path(real)

    async def handle_sync(self, ctx: RequestContext, message: Message) -> None:
        assert isinstance(message, AppSync)
        from gpumesh.agent.files import _os_error

        try:
            await self._sync(ctx, message)
        except OSError as exc:
            logger.debug("app sync failed", exc_info=True)
            raise _os_error(exc) from None

    async def _sync(self, ctx: RequestContext, message: AppSync) -> None:
        from gpumesh.files.manifest import apply_delta, digest

        peer, stream = ctx.peer, ctx.stream
        folder = await in_thread(self._folder, peer, message.name, not message.dry_run)
        index_file = self._index_file(peer, message.name)
        state_file = index_file.with_name(f"{message.name}.manifest")
        raw = await _read_section(stream, message.manifest_bytes, "manifest")
        if message.base:
            stored = await in_thread(_load_state, state_file)
            manifest: Manifest | None = None
            if stored is not None and stored[0] == message.base:
                put, remove = _parse_delta(raw)
                manifest = apply_delta(stored[1], put, remove)
                if digest(manifest) != message.digest:
                    manifest = None
            if manifest is None:
                stream.send_message(
                    AppNeeds(need=0, delete=0, unchanged=0, list_bytes=0, rebase=True), end=True
                )
                logger.info(
                    "[%s] app %s: delta on another base; asked for all", peer.name, message.name
                )
                return
        else:
            manifest = _parse_manifest(raw)
        index = await in_thread(_current_index, folder, index_file)
        need = sorted(p for p, entry in manifest.items() if index.get(p, (0, 0, ""))[2] != entry[2])
        delete = sorted(p for p in index if p not in manifest)
        unchanged = len(manifest) - len(need)
        listing = json.dumps({"need": need, "delete": delete}).encode()
        stream.send_message(
            AppNeeds(
                need=len(need), delete=len(delete), unchanged=unchanged, list_bytes=len(listing)
            )
        )
        for start in range(0, len(listing), 1 << 20):
            await stream.send_data(listing[start : start + (1 << 20)])
        stream.end_data()
        if message.dry_run:
            stream.finish()
            return
        send = await stream.expect(AppSend)
        usage = await self.files._usage(peer, exclude="")
        usage.check(self.files.agent.name, send.size)
        stream.send_message(FileResume(offset=0))
        temp = self.files.partials(peer) / f"app-{secrets.token_hex(8)}"
        received = 0
        try:
            if send.size:
                async with unpack_from(temp, max(0, usage.quota - usage.used), _NoHash()) as feed:
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
            await in_thread(_apply, temp, folder, index_file, manifest, index, need, delete)
            await in_thread(_save_state, state_file, manifest)
        finally:
            await in_thread(shutil.rmtree, temp, True)
        stream.send_message(
            AppSynced(
                received=received, written=len(need), deleted=len(delete), unchanged=unchanged
            ),
            end=True,
        )
        logger.info(
            "[%s] synced app %s: %d files written, %d deleted, %d unchanged",
            peer.name,
            message.name,
            len(need),
            len(delete),
            unchanged,
        )

    async def handle_job_dir(self, ctx: RequestContext, message: Message) -> None:
        assert isinstance(message, AppJobDir)
        job = ctx.agent.jobs._owned(ctx, message.job_id)
        relative = await in_thread(self._job_relative, ctx.peer, job.workdir, message.job_id)
        ctx.stream.send_message(AppJobDirReply(path="/" + relative), end=True)

    def _job_relative(self, peer: Peer, workdir_text: str, job_id: str) -> str:
        """A job's working folder from the sandbox root, when it lies in the sandbox."""
        root = os.path.realpath(self.files.sandbox(peer))
        workdir = os.path.realpath(workdir_text) if workdir_text else ""
        if not workdir or not inside(workdir, root) or workdir == root:
            raise ConfigError(
                f"job {job_id} did not run in an app folder: "
                "only jobs started with `gpumesh app run` can be pulled"
            )
        return os.path.relpath(workdir, root).replace(os.sep, "/")

    def resolve_sandbox_dir(self, peer: Peer, remote: str) -> Path:
        """A job's ``sandbox_dir``: an existing folder inside the peer's sandbox (blocking)."""
        folder = self.files.resolve(peer, remote)
        root = os.path.realpath(self.files.sandbox(peer))
        if str(folder) == root or not inside(str(folder), root):
            raise AccessDeniedError(f"{remote!r} is not a folder inside your sandbox")
        if not folder.is_dir():
            raise ConfigError(f"{remote} is not a folder on {self.files.agent.name}: sync it first")
        _open_to_container(folder)
        return folder


class _NoHash:
    def update(self, data: bytes | memoryview, /) -> None:
        return None

    def digest(self) -> bytes:
        return b""


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
    from gpumesh.agent.files import sandbox_parts

    try:
        data = json.loads(raw)
        entries = data["files"]
        if not isinstance(entries, list) or len(entries) > MAX_FILES:
            raise ValueError("files")
        manifest: Manifest = {}
        for path, size, mode, digest in entries:
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
            if not parts or "/".join(parts) != path or path in manifest:
                raise ValueError(path)
            manifest[path] = (size, mode, digest)
    except (ValueError, TypeError, KeyError) as exc:
        raise ProtocolError(f"the app manifest is not valid ({exc})") from None
    return manifest


def _check_entry(path: object, size: object, mode: object, digest: object) -> str:
    from gpumesh.agent.files import sandbox_parts

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


def _load_state(path: Path) -> tuple[str, Manifest] | None:
    """The manifest applied last (our own file: written only after it was checked)."""
    try:
        data = json.loads(path.read_text())
        files = {str(p): (int(e[0]), int(e[1]), str(e[2])) for p, e in data["files"].items()}
        return str(data["digest"]), files
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None


def _save_state(path: Path, manifest: Manifest) -> None:
    from gpumesh.files.manifest import digest

    part = path.with_name(path.name + ".tmp")
    part.write_text(json.dumps({"digest": digest(manifest), "files": manifest}))
    os.replace(part, path)


def _hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _current_index(folder: Path, index_file: Path) -> dict[str, tuple[int, int, str]]:
    """Synced file -> (size, mtime_ns, sha256 hex), checked against the folder now.

    A file that changed since it was synced is hashed again; one that is gone
    drops out. Without an index every file in the folder counts (rebuilt).
    """
    recorded: dict[str, Any] | None = None
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(index_file.read_text())
        if isinstance(loaded, dict):
            recorded = loaded
    if recorded is None:
        recorded = {}
        for base, dirs, names in os.walk(folder):
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(base, d))]
            for name in names:
                rel = os.path.relpath(os.path.join(base, name), folder).replace(os.sep, "/")
                recorded[rel] = [-1, -1, ""]
    current: dict[str, tuple[int, int, str]] = {}
    for rel, entry in recorded.items():
        try:
            size, mtime_ns, digest = int(entry[0]), int(entry[1]), str(entry[2])
        except (TypeError, ValueError, IndexError):
            size, mtime_ns, digest = -1, -1, ""
        path = os.path.join(folder, rel)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if st.st_size != size or st.st_mtime_ns != mtime_ns or not digest:
            try:
                digest = _hash(path)
            except OSError:
                continue
        current[rel] = (st.st_size, st.st_mtime_ns, digest)
    return current


def _apply(
    temp: Path,
    folder: Path,
    index_file: Path,
    manifest: Manifest,
    index: dict[str, tuple[int, int, str]],
    need: list[str],
    delete: list[str],
) -> None:
    """Check and rename the received files into place, delete the ones gone, save the index."""
    real = os.path.realpath(folder)
    for rel in need:
        source = temp / rel
        if source.is_symlink() or not source.is_file():
            raise ProtocolError(f"the app files sent lack {rel}")
        if _hash(str(source)) != manifest[rel][2]:
            raise ProtocolError(f"{rel} does not match its SHA-256 in the manifest")
    for rel in need:
        target = folder / rel
        _make_parents(folder, real, target)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.chmod(temp / rel, manifest[rel][1] | 0o666)  # jobs may rewrite it
        os.replace(temp / rel, target)
        st = os.lstat(target)
        index[rel] = (st.st_size, st.st_mtime_ns, manifest[rel][2])
    for rel in delete:
        target = folder / rel
        if inside(os.path.realpath(target.parent), real):
            with contextlib.suppress(FileNotFoundError):
                if not target.is_dir() or target.is_symlink():
                    target.unlink()
        index.pop(rel, None)
        parent = target.parent
        while parent != folder and inside(str(parent), str(folder)):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
    saved = {rel: list(entry) for rel, entry in index.items() if rel in manifest}
    part = index_file.with_suffix(".tmp")
    part.write_text(json.dumps(saved))
    os.replace(part, index_file)


def _make_parents(folder: Path, real: str, target: Path) -> None:
    """Create ``target``'s folders, replacing a file or symlink in the way, never leaving."""
    current = folder
    for part in target.relative_to(folder).parts[:-1]:
        current = current / part
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            current.unlink()
        current.mkdir(exist_ok=True)
        if not inside(os.path.realpath(current), real):
            raise AccessDeniedError("a folder in the app leads outside it")
        with contextlib.suppress(OSError):
            os.chmod(current, 0o777)


def _open_to_container(folder: Path) -> None:
    """Let the job's container user write the app folder (the sandbox stays private)."""
    for base, dirs, names in os.walk(folder):
        with contextlib.suppress(OSError):
            os.chmod(base, 0o777)
        for name in names:
            path = os.path.join(base, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, os.stat(path).st_mode | 0o666)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(base, d))]
