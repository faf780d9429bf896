"""App manifests: their digest, and the delta between two of them (pure, no I/O).

A manifest maps each synced file's path to (size, mode, SHA-256 hex). Both
ends of ``gpumesh app sync`` compute the same digest of the same manifest, so
a consumer can send only what changed since the manifest the provider last
applied (named by its digest), and the provider can check that the manifest
it rebuilds from that delta is the one the consumer holds.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import msgspec

__all__ = ["Entry", "Manifest", "Stamp", "apply_delta", "compact_json", "delta", "digest", "stamp"]

Entry = tuple[int, int, str]
"""(size, mode, sha256 hex) of one file."""
Manifest = Mapping[str, Entry]

Stamp = tuple[int, int, int]
"""(inode, size, mtime_ns) of a state or cache file, to tell whether another writer
changed it since it was last read or written."""


def stamp(path: Path) -> Stamp | None:
    """``path``'s :data:`Stamp`; None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def digest(files: Manifest) -> str:
    """SHA-256 (hex) of the manifest in a canonical form: sorted, compact JSON."""
    canonical = [[path, *files[path]] for path in sorted(files)]
    return hashlib.sha256(compact_json(canonical)).hexdigest()


def compact_json(value: object) -> bytes:
    """``json.dumps(value, separators=(",", ":"))`` as bytes, for lists of text and ints.

    msgspec writes the same bytes several times faster, except that json
    escapes every character past ``~`` (``\\u007f`` and all non-ASCII text)
    where msgspec writes it as UTF-8: those rare manifests take json's way.
    """
    try:
        encoded = msgspec.json.encode(value)
    except (TypeError, OverflowError, msgspec.EncodeError):
        encoded = b"\x7f"  # not ASCII-safe: take the slow path
    if encoded.isascii() and b"\x7f" not in encoded:
        return encoded
    return json.dumps(value, separators=(",", ":")).encode()


def delta(old: Manifest, new: Manifest) -> tuple[list[list[object]], list[str]]:
    """What turns ``old`` into ``new``: entries added or changed, paths removed."""
    put: list[list[object]] = [
        [path, *entry] for path, entry in new.items() if old.get(path) != entry
    ]
    remove = [path for path in old if path not in new]
    return put, remove


def apply_delta(base: Manifest, put: Mapping[str, Entry], remove: list[str]) -> dict[str, Entry]:
    """``base`` with ``put`` added or replaced and ``remove`` taken out."""
    files = dict(base)
    for path in remove:
        files.pop(path, None)
    files.update(put)
    return files
