"""files/hashing: which hash a transfer uses, and the hashers themselves."""

from __future__ import annotations

import hashlib

import pytest
from blake3 import blake3

from gpumesh.errors import ProtocolError
from gpumesh.files.hashing import BLAKE3, SHA256, choose, label, new_hasher, offered, taken


def test_the_answering_side_prefers_blake3_and_falls_back_to_sha256() -> None:
    assert choose(offered()) == BLAKE3
    assert choose([SHA256, BLAKE3]) == BLAKE3  # our preference, not the list's order
    assert choose([SHA256]) == SHA256
    assert choose([]) == SHA256  # an older peer lists nothing
    assert choose(["md5", "future-hash"]) == SHA256  # none we know: the common ground


def test_the_requester_takes_only_what_it_offered() -> None:
    assert taken("", offered()) == SHA256  # an older peer names nothing
    assert taken(BLAKE3, offered()) == BLAKE3
    with pytest.raises(ProtocolError, match="not offered"):
        taken(BLAKE3, [SHA256])
    with pytest.raises(ProtocolError, match="not offered"):
        taken("md5", offered())


def test_hashers_compute_the_real_digests_from_pieces() -> None:
    data = bytes(range(256)) * 5000
    for name, reference in ((SHA256, hashlib.sha256(data)), (BLAKE3, blake3(data))):
        hasher = new_hasher(name)
        hasher.update(data[:1000])
        hasher.update(memoryview(data)[1000:])
        assert hasher.digest() == reference.digest()
        assert len(hasher.digest()) == 32  # what the wire's digest fields hold
    with pytest.raises(ProtocolError):
        new_hasher("md5")
    assert (label(SHA256), label(BLAKE3)) == ("SHA-256", "BLAKE3")
