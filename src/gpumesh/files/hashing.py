"""Which hash checks a transfer end to end: chosen per transfer, in this one place.

A request that moves file bytes (``FilePut``, ``FileGet``, ``ChannelPut``,
``ChannelGet``, ``DirPut``, ``DirGet``) lists in ``hashes`` the algorithms the
requester can check, and the answering side names the one it picked in its
first reply (``hash`` on ``FileResume``, ``FileInfo`` or ``ChannelOffer``).
The digest then travels where the SHA-256 always did (the ``sha256`` field on
the wire, ``digest`` in Python). A node from before this negotiation sends no
list and names nothing: both mean SHA-256, which every version checks, so a
copy between an old and a new node still runs, with SHA-256.

BLAKE3 is preferred: on the machines measured (``bench/hash.py``) it hashes
about three times as fast as SHA-256 on one core, and a copy hashes every
byte on both ends. Its ``update`` releases the GIL, as ``hashlib``'s does for
large buffers, so hashing runs beside the thread moving the bytes.

Knows nothing of peers or sockets; the names here are what goes on the wire.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from blake3 import blake3

from gpumesh.errors import ProtocolError
from gpumesh.files.transfer import Hasher

__all__ = [
    "BLAKE3",
    "PREFERENCE",
    "SHA256",
    "choose",
    "label",
    "new_hasher",
    "offered",
    "taken",
]

SHA256 = "sha256"
"""What a peer from before the negotiation uses, and every peer can check."""
BLAKE3 = "blake3"
PREFERENCE = (BLAKE3, SHA256)
"""The algorithms this node checks, the one it would rather use first."""

BLAKE3_THREADS = 1
"""Threads one BLAKE3 hasher may use for a large ``update``. One: in a copy the
other cores are already moving, encrypting and writing the bytes (measured with
``bench/hash.py``: on 2 cores more threads only pay when nothing else runs)."""

_LABELS = {SHA256: "SHA-256", BLAKE3: "BLAKE3"}


def offered() -> list[str]:
    """What a requester lists in ``hashes``."""
    return list(PREFERENCE)


def choose(hashes: Sequence[str]) -> str:
    """The answering side's pick from a request's ``hashes``: the first of ours it
    lists; SHA-256 when it lists none we know (an older peer lists nothing)."""
    return next((name for name in PREFERENCE if name in hashes), SHA256)


def taken(reply: str, asked: Sequence[str]) -> str:
    """The algorithm a reply names, checked against what the request offered.

    Empty: the peer is from before the negotiation and uses SHA-256.
    """
    if not reply:
        return SHA256
    if reply not in asked:
        raise ProtocolError(f"the peer picked the hash {reply!r}, which was not offered")
    return reply


def new_hasher(name: str) -> Hasher:
    """A fresh hasher for ``name`` (one of :data:`PREFERENCE`)."""
    if name == BLAKE3:
        return blake3(max_threads=BLAKE3_THREADS)
    if name == SHA256:
        return hashlib.sha256()
    raise ProtocolError(f"unknown hash {name!r}")


def label(name: str) -> str:
    """``name`` as people write it (``SHA-256``, ``BLAKE3``)."""
    return _LABELS.get(name, name)
