"""identity/invites: group invites round-trip, and every refusal has its own message and class.

Tampering tests rebuild the token by hand from the layout documented in
invites.py (``u16 body length | msgpack {invite, signature} | u32 CRC32``)
with a correct CRC, so only the signature (or the field checks) can catch them.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.errors import ConfigError, ExpiredCodeError, PairingCodeError
from gpumesh.identity.codes import CODE_PREFIX, decode_token, encode_token, make_code
from gpumesh.identity.invites import (
    INVITE_LIFETIME,
    INVITE_PREFIX,
    MAX_INVITE_LIFETIME,
    MAX_MEMBERS,
    InviteMember,
    check_group_name,
    decode_invite,
    is_group_id,
    make_invite,
    new_group_id,
    verify_invite,
)
from gpumesh.identity.keys import Identity
from tests.badhints import BAD_HINTS

NOW = 1_700_000_000.0
URLSAFE = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
DOMAIN = b"gpumesh-group-invite-v1\x00"

# One invite for the hypothesis tests (they cannot take function-scoped fixtures).
_ALICE = Identity.generate()
_BOB = Identity.generate()
_GROUP_ID = new_group_id()


def member(identity: Identity, name: str, *addresses: str, relay: str = "") -> InviteMember:
    return InviteMember(name, identity.public_key, list(addresses), relay)


_MEMBERS = [
    member(_ALICE, "alice-pc", "192.0.2.1:47000", relay="relay.example.org:4799"),
    member(_BOB, "bob", "198.51.100.7:47000", "127.0.0.1:47000"),
]
_CODE = make_invite(_ALICE, _GROUP_ID, "research", _MEMBERS)


def at(t: float) -> Any:
    return lambda: t


def _raw(code: str) -> bytes:
    payload = code[len(INVITE_PREFIX) :]
    return base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))


def _pack(body: bytes) -> str:
    raw = struct.pack("!H", len(body)) + body
    raw += struct.pack("!I", zlib.crc32(raw))
    return INVITE_PREFIX + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def _unpack(code: str) -> tuple[dict[str, Any], bytes]:
    """The invite (as a dict) and signature inside a code."""
    signed = msgspec.msgpack.decode(_raw(code)[2:-4])
    return msgspec.msgpack.decode(signed["invite"]), signed["signature"]


def _repack(invite: dict[str, Any], signature: bytes) -> str:
    invite_bytes = msgspec.msgpack.encode(invite)
    return _pack(msgspec.msgpack.encode({"invite": invite_bytes, "signature": signature}))


def _resign(invite: dict[str, Any], identity: Identity) -> str:
    """A genuinely signed invite with whatever fields the test wants."""
    invite_bytes = msgspec.msgpack.encode(invite)
    signature = identity.sign(DOMAIN + invite_bytes)
    return _pack(msgspec.msgpack.encode({"invite": invite_bytes, "signature": signature}))


def _message(exc: pytest.ExceptionInfo[BaseException]) -> str:
    return str(exc.value)


# --- round trip ---------------------------------------------------------------


def test_round_trip_carries_the_group_and_every_member() -> None:
    code = make_invite(_ALICE, _GROUP_ID, "research", _MEMBERS, clock=at(NOW))
    assert code.startswith("gpg1_")
    invite = verify_invite(code, clock=at(NOW + 10))
    assert invite.group_id == _GROUP_ID
    assert invite.group_name == "research"
    assert invite.inviter == _ALICE.public_key
    assert invite.inviter_member.name == "alice-pc"
    assert invite.members == _MEMBERS
    assert [m.node_id for m in invite.members] == [_ALICE.node_id, _BOB.node_id]
    assert invite.members[0].relay == "relay.example.org:4799"
    assert invite.expires == NOW + INVITE_LIFETIME
    assert INVITE_LIFETIME == 24 * 3600
    assert len(invite.nonce) == 16


def test_any_member_may_sign_an_invite() -> None:
    invite = verify_invite(make_invite(_BOB, _GROUP_ID, "research", _MEMBERS))
    assert invite.inviter_member.name == "bob"


def test_the_inviter_must_be_a_member() -> None:
    with pytest.raises(ValueError, match="must be one of the group's members"):
        make_invite(Identity.generate(), _GROUP_ID, "research", _MEMBERS)


def test_two_invites_to_one_group_differ() -> None:
    first = make_invite(_ALICE, _GROUP_ID, "research", _MEMBERS, clock=at(NOW))
    second = make_invite(_ALICE, _GROUP_ID, "research", _MEMBERS, clock=at(NOW))
    assert first != second


def test_invite_uses_only_url_safe_characters() -> None:
    assert set(_CODE[len(INVITE_PREFIX) :]) <= set(URLSAFE)


def test_whitespace_and_newlines_in_a_pasted_invite_are_tolerated() -> None:
    chunks = [_CODE[i : i + 40] for i in range(0, len(_CODE), 40)]
    assert verify_invite("  \n" + "\n".join(chunks) + " \r\n\t") == verify_invite(_CODE)


def test_more_than_16_addresses_per_member_are_cut_to_16() -> None:
    addresses = [f"192.0.2.{i}:47000" for i in range(20)]
    code = make_invite(_ALICE, _GROUP_ID, "g", [member(_ALICE, "alice", *addresses)])
    assert verify_invite(code).members[0].addresses == addresses[:16]


def test_a_full_group_fits_and_one_more_member_is_refused() -> None:
    others = [
        member(Identity.generate(), f"node{i}", f"192.0.2.{i}:47000")
        for i in range(MAX_MEMBERS - 1)
    ]
    code = make_invite(_ALICE, _GROUP_ID, "big", [_MEMBERS[0], *others])
    assert len(verify_invite(code).members) == MAX_MEMBERS
    extra = member(Identity.generate(), "one-too-many")
    with pytest.raises(ConfigError, match=f"at most {MAX_MEMBERS}"):
        make_invite(_ALICE, _GROUP_ID, "big", [_MEMBERS[0], *others, extra])


def test_members_whose_addresses_do_not_fit_are_refused_when_making() -> None:
    long_addresses = [f"{'h' * 250}{i:02d}:1" for i in range(16)]
    crowd = [member(Identity.generate(), f"n{i}", *long_addresses) for i in range(20)]
    with pytest.raises(ConfigError, match="do not fit in one invite"):
        make_invite(_ALICE, _GROUP_ID, "g", [_MEMBERS[0], *crowd])


def test_group_ids_are_random_and_well_formed() -> None:
    ids = {new_group_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(is_group_id(i) for i in ids)
    assert not is_group_id("research")
    assert not is_group_id(new_group_id().upper())


@pytest.mark.parametrize("name", ["research", "lab-2", "a", "x" * 63, "team.gpu_1"])
def test_valid_group_names(name: str) -> None:
    assert check_group_name(name) == name


@pytest.mark.parametrize("name", ["", "-lab", "two words", "x" * 64, "é", "lab!"])
def test_invalid_group_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="invalid group name"):
        check_group_name(name)


# --- shared framing -----------------------------------------------------------


def test_token_framing_round_trips_any_body() -> None:
    body = bytes(range(256)) * 3
    assert decode_token("x1_", encode_token("x1_", body), "thing", not_prefixed="no") == body


def test_token_framing_refuses_bodies_the_length_field_cannot_hold() -> None:
    with pytest.raises(ValueError, match="at most 65535 bytes"):
        encode_token("x1_", bytes(65536))


def test_token_framing_names_the_token_in_messages() -> None:
    token = encode_token("x1_", b"hello")
    with pytest.raises(PairingCodeError, match="that widget has a bad checksum"):
        decode_token(
            "x1_",
            token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1],
            "widget",
            not_prefixed="no",
        )
    with pytest.raises(PairingCodeError, match=r"^not one of ours$"):
        decode_token("x1_", "hello", "widget", not_prefixed="not one of ours")


# --- expiry -------------------------------------------------------------------


def test_invite_is_valid_until_it_expires() -> None:
    code = make_invite(_ALICE, _GROUP_ID, "research", _MEMBERS, clock=at(NOW))
    verify_invite(code, clock=at(NOW + INVITE_LIFETIME - 1))
    verify_invite(code, clock=at(NOW + INVITE_LIFETIME))


def test_expired_invite_is_refused_and_says_whom_to_ask() -> None:
    code = make_invite(_ALICE, _GROUP_ID, "research", _MEMBERS, clock=at(NOW), lifetime=3600)
    with pytest.raises(ExpiredCodeError) as info:
        verify_invite(code, clock=at(NOW + 3600 + 2 * 3600))
    assert "that group invite expired 2h ago" in _message(info)
    assert "ask alice-pc for a fresh `gpumesh group invite research`" in _message(info)


def test_a_custom_lifetime_is_honoured() -> None:
    code = make_invite(_ALICE, _GROUP_ID, "research", _MEMBERS, clock=at(NOW), lifetime=60)
    assert verify_invite(code, clock=at(NOW + 59)).expires == NOW + 60
    with pytest.raises(ExpiredCodeError):
        verify_invite(code, clock=at(NOW + 61))


def test_invite_claiming_more_than_the_maximum_is_refused() -> None:
    code = make_invite(
        _ALICE, _GROUP_ID, "research", _MEMBERS, clock=at(NOW), lifetime=MAX_INVITE_LIFETIME + 3600
    )
    with pytest.raises(PairingCodeError, match="more than 7d") as info:
        verify_invite(code, clock=at(NOW))
    assert not isinstance(info.value, ExpiredCodeError)


def test_the_maximum_lifetime_and_some_clock_skew_are_tolerated() -> None:
    code = make_invite(
        _ALICE, _GROUP_ID, "research", _MEMBERS, clock=at(NOW + 120), lifetime=MAX_INVITE_LIFETIME
    )
    verify_invite(code, clock=at(NOW))


# --- foreign and malformed invites --------------------------------------------


def test_a_pairing_code_is_recognised_and_pointed_to_pair() -> None:
    code = make_code(_ALICE, "alice-pc", ["192.0.2.1:47000"])
    with pytest.raises(
        PairingCodeError, match="that is a pairing code, not a group invite"
    ) as info:
        verify_invite(code)
    assert "gpumesh pair" in _message(info)
    assert not isinstance(info.value, ExpiredCodeError)


@pytest.mark.parametrize("text", ["", "hello", "gpg2_AAAA", "GPG1_AAAA", "gpm2_AAAA"])
def test_text_without_the_prefix_is_not_an_invite(text: str) -> None:
    with pytest.raises(PairingCodeError, match="not a GPUMesh group invite") as info:
        verify_invite(text)
    assert "gpg1_" in _message(info)


def test_a_pairing_code_relabelled_as_an_invite_is_malformed() -> None:
    # Same framing, other prefix: the CRC passes, the body is not an invite.
    code = make_code(_ALICE, "alice-pc", [])
    with pytest.raises(PairingCodeError, match="that group invite is malformed"):
        verify_invite(INVITE_PREFIX + code[len(CODE_PREFIX) :])


@pytest.mark.parametrize("bad", ["é", "€", "\x00", "!", "."])
def test_non_base64_characters_are_refused(bad: str) -> None:
    middle = len(_CODE) // 2
    with pytest.raises(PairingCodeError, match="group invite contains characters that do not"):
        verify_invite(_CODE[:middle] + bad + _CODE[middle + 1 :])


def test_too_long_invite_is_refused() -> None:
    with pytest.raises(PairingCodeError, match="group invite is too long"):
        verify_invite(INVITE_PREFIX + "A" * 100_000)


def test_an_invite_longer_than_a_pairing_code_is_fine() -> None:
    others = [member(Identity.generate(), f"node{i}", f"192.0.2.{i}:47000") for i in range(40)]
    code = make_invite(_ALICE, _GROUP_ID, "big", [_MEMBERS[0], *others])
    assert len(code) > 4096  # the pairing-code limit
    assert len(verify_invite(code).members) == 41


@given(st.integers(min_value=0, max_value=len(_CODE) - 1))
def test_an_invite_cut_anywhere_is_refused(cut: int) -> None:
    with pytest.raises(PairingCodeError):
        verify_invite(_CODE[:cut])


@given(st.integers(min_value=len(INVITE_PREFIX), max_value=len(_CODE) - 1))
def test_an_invite_cut_in_its_payload_is_reported_as_truncated(cut: int) -> None:
    with pytest.raises(PairingCodeError, match="that group invite is truncated"):
        verify_invite(_CODE[:cut])


def test_extra_characters_after_an_invite_are_refused() -> None:
    with pytest.raises(PairingCodeError, match="group invite has extra characters"):
        verify_invite(_CODE + "AAAA")


@given(
    position=st.integers(min_value=len(INVITE_PREFIX), max_value=len(_CODE) - 1),
    char=st.sampled_from(URLSAFE),
)
def test_a_one_character_typo_is_caught_before_parsing(position: int, char: str) -> None:
    typo = _CODE[:position] + char + _CODE[position + 1 :]
    if _raw(typo) == _raw(_CODE):
        # Same character, or a change in the unused low bits of the last one.
        assert verify_invite(typo) == verify_invite(_CODE)
        return
    with pytest.raises(PairingCodeError) as info:
        verify_invite(typo)
    assert any(word in _message(info) for word in ("checksum", "truncated", "extra"))


def test_valid_crc_around_a_body_that_is_not_msgpack_is_malformed() -> None:
    with pytest.raises(PairingCodeError, match="group invite is malformed"):
        verify_invite(_pack(b"\xc1\xc1\xc1"))


def test_valid_crc_around_an_invite_missing_fields_is_malformed() -> None:
    invite, signature = _unpack(_CODE)
    del invite["nonce"]
    with pytest.raises(PairingCodeError, match="malformed"):
        verify_invite(_repack(invite, signature))


def test_unknown_fields_are_refused() -> None:
    invite, _ = _unpack(_CODE)
    invite["admin"] = True
    with pytest.raises(PairingCodeError, match="malformed"):
        verify_invite(_resign(invite, _ALICE))


def test_decode_invite_does_not_check_the_signature() -> None:
    invite, _ = _unpack(_CODE)
    invite["group_name"] = "mallory-club"
    decoded, _, _ = decode_invite(_repack(invite, b"\x00" * 64))
    assert decoded.group_name == "mallory-club"


# --- tampering (valid CRC, broken signature) ----------------------------------


def test_rebuilding_an_invite_unchanged_still_verifies() -> None:
    # Guards the tampering tests below: the hand-made re-encoding is faithful.
    invite, signature = _unpack(_CODE)
    assert verify_invite(_repack(invite, signature)) == verify_invite(_CODE)


_MALLORY = Identity.generate()


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("group_id", lambda v: new_group_id()),
        ("group_name", lambda v: "mallory-club"),
        ("inviter", lambda v: _BOB.public_key),
        ("expires", lambda v: v + 86400),
        ("nonce", lambda v: b"\x00" * 16),
        (
            "members",
            lambda v: [
                *v,
                {
                    "name": "mallory",
                    "public_key": _MALLORY.public_key,
                    "addresses": [],
                    "relay": "",
                },
            ],
        ),
        ("members", lambda v: v[:1]),
        ("members", lambda v: [{**v[0], "addresses": ["203.0.113.66:47000"]}, v[1]]),
        ("members", lambda v: [v[0], {**v[1], "public_key": _MALLORY.public_key}]),
        ("members", lambda v: [{**v[0], "relay": "evil.example.org:4799"}, v[1]]),
        ("members", lambda v: [v[0], {**v[1], "name": "bobby"}]),
    ],
    ids=[
        "group_id",
        "group_name",
        "inviter",
        "expires",
        "nonce",
        "member-added",
        "member-removed",
        "address",
        "key",
        "relay",
        "member-name",
    ],
)
def test_a_tampered_field_fails_the_signature(field: str, change: Any) -> None:
    invite, signature = _unpack(_CODE)
    changed = change(invite[field])
    assert invite[field] != changed
    invite[field] = changed
    with pytest.raises(PairingCodeError, match="signature does not verify") as info:
        verify_invite(_repack(invite, signature))
    assert not isinstance(info.value, ExpiredCodeError)


def test_a_tampered_signature_is_refused() -> None:
    invite, signature = _unpack(_CODE)
    forged = bytes([signature[0] ^ 1]) + signature[1:]
    with pytest.raises(PairingCodeError, match="signature does not verify"):
        verify_invite(_repack(invite, forged))


def test_a_signature_by_another_member_than_the_named_inviter_is_refused() -> None:
    invite, _ = _unpack(_CODE)
    with pytest.raises(PairingCodeError, match="signature does not verify"):
        verify_invite(_resign(invite, _BOB))  # inviter still says alice


def test_a_pairing_code_signature_does_not_sign_an_invite() -> None:
    invite, _ = _unpack(_CODE)
    invite_bytes = msgspec.msgpack.encode(invite)
    signature = _ALICE.sign(b"gpumesh-pairing-offer-v1\x00" + invite_bytes)
    with pytest.raises(PairingCodeError, match="signature does not verify"):
        verify_invite(_repack(invite, signature))


def test_a_signature_without_the_domain_prefix_is_refused() -> None:
    invite, _ = _unpack(_CODE)
    with pytest.raises(PairingCodeError, match="signature does not verify"):
        verify_invite(_repack(invite, _ALICE.sign(msgspec.msgpack.encode(invite))))


def test_a_short_inviter_key_is_refused() -> None:
    invite, signature = _unpack(_CODE)
    invite["inviter"] = invite["inviter"][:31]
    with pytest.raises(PairingCodeError, match="signature does not verify"):
        verify_invite(_repack(invite, signature))


def test_an_invite_signed_by_an_outsider_is_refused() -> None:
    # Mallory signs correctly, but is not in the member list she sends.
    invite, _ = _unpack(_CODE)
    invite["inviter"] = _MALLORY.public_key
    with pytest.raises(PairingCodeError, match="signed by a node that is not in the group"):
        verify_invite(_resign(invite, _MALLORY))


# --- signed but invalid fields ------------------------------------------------


def _signed_with(**changes: Any) -> str:
    invite, _ = _unpack(_CODE)
    invite.update(changes)
    return _resign(invite, _ALICE)


def _alice_with(**changes: Any) -> dict[str, Any]:
    invite, _ = _unpack(_CODE)
    return {**invite["members"][0], **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"group_id": "not-an-id"}, "invalid group id"),
        ({"group_name": "bad name!"}, "invalid group name"),
        ({"nonce": b"short"}, "malformed"),
        ({"members": [_alice_with(name="bad name!")]}, "invalid member"),
        (
            {"members": [_alice_with(addresses=["h" * 300 + ":1"])]},
            "bad address for alice-pc: 'hhh",
        ),
        ({"members": [_alice_with(addresses=["192.0.2.1:1"] * 17)]}, "invalid addresses"),
        ({"members": [_alice_with(relay="r" * 300)]}, "bad relay for alice-pc: 'rrr"),
        ({"members": [_alice_with(), _alice_with(name="alice-again")]}, "key twice"),
    ],
    ids=[
        "group-id",
        "group-name",
        "nonce",
        "member-name",
        "long-address",
        "17-addresses",
        "relay",
        "duplicate-key",
    ],
)
def test_a_signed_invite_with_invalid_fields_is_refused(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(PairingCodeError, match=message) as info:
        verify_invite(_signed_with(**changes))
    assert not isinstance(info.value, ExpiredCodeError)


@pytest.mark.parametrize("hint", BAD_HINTS)
def test_a_signed_invite_with_a_bad_address_is_refused(hint: str) -> None:
    members = [_alice_with(addresses=["192.0.2.1:47000", hint])]
    with pytest.raises(PairingCodeError) as caught:
        verify_invite(_signed_with(members=members))
    message = str(caught.value)
    assert message.startswith("that group invite carries a bad address for alice-pc: ")
    assert message.endswith("; ask a member for a fresh `gpumesh group invite`")


@pytest.mark.parametrize("hint", [h for h in BAD_HINTS if h != "192.0.2.1"])
def test_a_signed_invite_with_a_bad_relay_is_refused(hint: str) -> None:
    with pytest.raises(
        PairingCodeError, match=r"^that group invite carries a bad relay for alice-pc: "
    ):
        verify_invite(_signed_with(members=[_alice_with(relay=hint)]))


def test_a_signed_invite_with_too_many_members_is_refused() -> None:
    crowd = [
        {
            "name": f"n{i}",
            "public_key": Identity.generate().public_key,
            "addresses": [],
            "relay": "",
        }
        for i in range(MAX_MEMBERS)
    ]
    with pytest.raises(PairingCodeError, match=f"at most {MAX_MEMBERS}"):
        verify_invite(_signed_with(members=[_alice_with(), *crowd]))
