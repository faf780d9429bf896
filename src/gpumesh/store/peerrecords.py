"""Paired peers' signed address records, as this node last received them.

One small file per peer (``peer-addresses/<node id>``, written whole and
renamed into place, so the agent and a ``gpumesh sync`` of the same home may
both write): the record's bytes exactly as the peer signed them, its
signature, and whether the node handed it over itself as findable (only such
a record is handed on to other paired peers). A record learned second-hand
is kept only for its sequence number: an older one is never taken again.

Nothing here trusts the files: every reader verifies the signature against
the key it pinned for that peer (:mod:`gpumesh.protocol.listing`).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import msgspec

from gpumesh.store.config import Config

__all__ = ["PeerRecords", "StoredRecord", "findable"]

_NODE_ID = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")
MAX_FILE_BYTES = 8192


def findable(config: Config) -> bool:
    """Whether this node asked to be findable by its peers' peers (``announce_addresses``)."""
    return bool(config.get("announce_addresses"))


class StoredRecord(msgspec.Struct, frozen=True):
    record: bytes
    signature: bytes
    findable: bool
    """The node itself handed it over and asked to be findable."""
    received: float
    """Unix time it arrived here."""


class PeerRecords:
    """The ``peer-addresses`` folder of a home."""

    def __init__(self, home_path: Path) -> None:
        self.path = home_path / "peer-addresses"

    def _file(self, node_id: str) -> Path:
        if not _NODE_ID.match(node_id):
            raise ValueError(f"not a node id: {node_id[:70]!r}")
        return self.path / node_id

    def get(self, node_id: str) -> StoredRecord | None:
        try:
            with self._file(node_id).open("rb") as handle:
                data = handle.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return None
        if len(data) > MAX_FILE_BYTES:
            return None
        try:
            return msgspec.msgpack.decode(data, type=StoredRecord)
        except msgspec.DecodeError:
            return None

    def save(self, node_id: str, stored: StoredRecord) -> None:
        target = self._file(node_id)
        self.path.mkdir(mode=0o700, exist_ok=True)
        temporary = target.with_name(f".{node_id}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()  # left by a process of this pid that died mid-write
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(msgspec.msgpack.encode(stored))
        os.replace(temporary, target)

    def forget(self, node_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._file(node_id).unlink()
