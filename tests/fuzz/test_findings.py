"""What the fuzzer found, each as the smallest input that shows it.

Each is a regression test. A bug found and not fixed yet would be marked
``xfail(strict=True)`` here, with an entry in ``targets.KNOWN_ISSUES``.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from gpumesh.errors import PairingCodeError, ProtocolError
from gpumesh.identity.codes import make_code, verify_code
from gpumesh.identity.invites import InviteMember, make_invite, new_group_id, verify_invite
from gpumesh.identity.keys import Identity
from gpumesh.protocol import relay
from gpumesh.protocol.messages import decode_message

NOW = 1_700_000_000.0
DIGEST = "ab" * 32

# --- fixed: pattern fields took a trailing newline -----------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"t": "job_cancel", "job_id": "abcdefgh\n"},
        {"t": "job_output", "seq": 0, "attempt": 0, "stream": "stdout\n", "data": b""},
        {"t": "file_info", "path": "/a", "exists": True, "kind": "file\n", "size": 0}
        | {"mode": 0, "mtime": 0.0},
        {"t": "channel_put", "path": "/a", "size": 0, "mode": 0, "source": "ab\n"},
        {"t": "app_sync", "name": "app", "manifest_bytes": 0, "digest": DIGEST + "\n"},
        {"t": "exec_start", "image": "i", "command": [], "env": {"PATH\n": "/bin"}}
        | {"tty": False, "rows": 0, "cols": 0},
    ],
    ids=lambda fields: str(fields["t"]),
)
def test_a_pattern_field_with_a_trailing_newline_is_refused(fields: dict[str, object]) -> None:
    # Python's $ matches before a final newline; msgspec's patterns are re.search'ed.
    with pytest.raises(ProtocolError, match="invalid message"):
        decode_message(msgspec.msgpack.encode(fields))


# --- fixed: a relay packet of nested arrays let RecursionError out --------------------


def test_a_relay_hello_nested_past_the_recursion_limit_is_within_the_packet_limit() -> None:
    packet = _nested_hello(1400)
    assert len(packet) <= relay.MAX_PACKET
    assert relay.is_relay_packet(packet)


def test_a_relay_hello_nested_past_the_recursion_limit_is_a_protocol_error() -> None:
    # Found as Hello [b"", [[[...999 deep... nil]]]]: 1007 bytes, unauthenticated.
    with pytest.raises(ProtocolError):
        relay.decode_packet(_nested_hello(1400))


def _nested_hello(depth: int) -> bytes:
    header = bytes([relay.Hello.TYPE]) + relay.MAGIC + bytes([relay.WIRE_VERSION])
    return header + b"\x92\xc4\x00" + b"\x91" * depth + b"\xc0"  # [b"", [[...nil...]]]


# --- fixed: a token whose expiry was NaN never expired ----------------------------------


def test_a_pairing_code_that_expires_at_nan_is_refused(identity: Identity) -> None:
    code = make_code(identity, "alice", ["192.0.2.1:47000"], clock=lambda: NOW, lifetime=math.nan)
    with pytest.raises(PairingCodeError):
        verify_code(code, clock=lambda: NOW + 10 * 365 * 86400)


def test_a_group_invite_that_expires_at_nan_is_refused(identity: Identity) -> None:
    members = [InviteMember("alice", identity.public_key, ["192.0.2.1:47000"], "")]
    invite = make_invite(
        identity, new_group_id(), "research", members, clock=lambda: NOW, lifetime=math.nan
    )
    with pytest.raises(PairingCodeError):
        verify_invite(invite, clock=lambda: NOW + 10 * 365 * 86400)


@pytest.fixture
def identity() -> Identity:
    return Identity.generate()
