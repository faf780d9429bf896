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
from collections.abc import Mapping

__all__ = ["Entry", "Manifest", "apply_delta", "delta", "digest"]

Entry = tuple[int, int, str]
"""(size, mode, sha256 hex) of one file."""
Manifest = Mapping[str, Entry]


def digest(files: Manifest) -> str:
    """SHA-256 (hex) of the manifest in a canonical form: sorted, compact JSON."""
    canonical = [[path, *files[path]] for path in sorted(files)]
    text = json.dumps(canonical, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def delta(old: Manifest, new: Manifest) -> tuple[list[list[object]], list[str]]:
    """What turns ``old`` into ``new``: entries added or changed, paths removed."""
    put: list[list[object]] = [
        [path, *entry] for path, entry in new.items() if tuple(old.get(path, ())) != entry
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
