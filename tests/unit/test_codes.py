"""identity/codes: pairing codes round-trip, and every refusal has its own message and class.

Tampering tests rebuild the token by hand from the layout documented in
codes.py (``u16 body length | msgpack {offer, signature} | u32 CRC32``) with a
correct CRC, so only the signature can catch them.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from gpumesh.errors import ExpiredCodeError, PairingCodeError
from gpumesh.identity.codes import (
    CODE_LIFETIME,
    CODE_PREFIX,
    decode_code,
    make_code,
    verify_code,
)
from gpumesh.identity.keys import Identity
from tests.badhints import BAD_HINTS

NOW = 1_700_000_000.0
URLSAFE = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"

# One code for the hypothesis tests (they cannot take function-scoped fixtures).
_IDENTITY = Identity.generate()
_CODE = make_code(_IDENTITY, "alice", ["192.0.2.1:47000"], "relay.example.org:4799")


def at(t: float) -> Any:
    return lambda: t


def _raw(code: str) -> bytes:
    payload = code[len(CODE_PREFIX) :]
    return base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))


def _pack(body: bytes) -> str:
    raw = struct.pack("!H", len(body)) + body
    raw += struct.pack("!I", zlib.crc32(raw))
    return CODE_PREFIX + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def _unpack(code: str) -> tuple[dict[str, Any], bytes]:
    """The offer (as a dict) and signature inside a code."""
    raw = _raw(code)
    signed = msgspec.msgpack.decode(raw[2:-4])
    return msgspec.msgpack.decode(signed["offer"]), signed["signature"]


def _repack(offer: dict[str, Any], signature: bytes) -> str:
    offer_bytes = msgspec.msgpack.encode(offer)
    return _pack(msgspec.msgpack.encode({"offer": offer_bytes, "signature": signature}))


def _message(exc: pytest.ExceptionInfo[BaseException]) -> str:
    return str(exc.value)


# --- round trip ---------------------------------------------------------------


def test_round_trip_carries_everything(identity: Identity) -> None:
    code = make_code(
        identity, "alice", ["192.0.2.1:47000", "[2001:db8::1]:47000"], "relay:4799", clock=at(NOW)
    )
    assert code.startswith("gpm1_")
    offer = verify_code(code, clock=at(NOW + 10))
    assert offer.name == "alice"
    assert offer.public_key == identity.public_key
    assert offer.node_id == identity.node_id
    assert offer.addresses == ["192.0.2.1:47000", "[2001:db8::1]:47000"]
    assert offer.relay == "relay:4799"
    assert offer.expires == NOW + 3600
    assert CODE_LIFETIME == 3600
    assert len(offer.nonce) == 16


def test_relay_defaults_to_empty(identity: Identity) -> None:
    assert verify_code(make_code(identity, "bob", [])).relay == ""


def test_two_codes_of_one_node_differ(identity: Identity) -> None:
    first = make_code(identity, "alice", ["192.0.2.1:1"], clock=at(NOW))
    second = make_code(identity, "alice", ["192.0.2.1:1"], clock=at(NOW))
    assert first != second


def test_code_uses_only_url_safe_characters(identity: Identity) -> None:
    code = make_code(identity, "alice", ["192.0.2.1:47000"])
    assert set(code[len(CODE_PREFIX) :]) <= set(URLSAFE)


def test_more_than_16_addresses_are_cut_to_16(identity: Identity) -> None:
    addresses = [f"192.0.2.{i}:47000" for i in range(20)]
    assert verify_code(make_code(identity, "alice", addresses)).addresses == addresses[:16]


def test_whitespace_and_newlines_in_a_pasted_code_are_tolerated() -> None:
    chunks = [_CODE[i : i + 40] for i in range(0, len(_CODE), 40)]
    pasted = "  \n" + "\n".join(chunks) + " \r\n\t"
    assert verify_code(pasted) == verify_code(_CODE)
    spaced = " ".join(_CODE[i : i + 7] for i in range(0, len(_CODE), 7))
    assert verify_code(spaced).public_key == _IDENTITY.public_key


# --- expiry -------------------------------------------------------------------


def test_code_is_valid_until_it_expires(identity: Identity) -> None:
    code = make_code(identity, "alice", [], clock=at(NOW))
    verify_code(code, clock=at(NOW + 3599))
    verify_code(code, clock=at(NOW + 3600))


def test_expired_code_is_refused(identity: Identity) -> None:
    code = make_code(identity, "alice", [], clock=at(NOW))
    with pytest.raises(ExpiredCodeError) as info:
        verify_code(code, clock=at(NOW + 3600 + 30 * 60))
    assert "expired 30 min ago" in _message(info)
    assert "fresh `gpumesh pair-code`" in _message(info)


def test_code_claiming_more_than_an_hour_is_refused(identity: Identity) -> None:
    code = make_code(identity, "alice", [], clock=at(NOW), lifetime=2 * 3600)
    with pytest.raises(PairingCodeError, match="more than an hour") as info:
        verify_code(code, clock=at(NOW))
    assert not isinstance(info.value, ExpiredCodeError)


def test_a_few_minutes_of_clock_skew_is_tolerated(identity: Identity) -> None:
    code = make_code(identity, "alice", [], clock=at(NOW + 120))
    verify_code(code, clock=at(NOW))


# --- malformed codes ----------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello", "gpm2_AAAA", "GPM1_AAAA", "ssh-ed25519 AAAA"])
def test_text_without_the_prefix_is_not_a_code(text: str) -> None:
    with pytest.raises(PairingCodeError, match="not a GPUMesh pairing code") as info:
        verify_code(text)
    assert "gpm1_" in _message(info)


@pytest.mark.parametrize("bad", ["é", "€", "\x00"])
def test_non_base64_characters_are_refused(bad: str) -> None:
    middle = len(_CODE) // 2
    with pytest.raises(PairingCodeError, match="characters that do not belong"):
        verify_code(_CODE[:middle] + bad + _CODE[middle + 1 :])


@pytest.mark.parametrize("bad", ["!", ".", "*"])
def test_an_inserted_non_base64_character_is_refused(bad: str) -> None:
    # A lenient base64 decoder would drop the stray character and accept the code.
    for name in ["a", "ab", "abc", "abcd"]:  # covers every payload length mod 4
        code = make_code(_IDENTITY, name, [])
        middle = len(code) // 2
        with pytest.raises(PairingCodeError, match="characters that do not belong"):
            verify_code(code[:middle] + bad + code[middle:])


def test_too_long_code_is_refused() -> None:
    with pytest.raises(PairingCodeError, match="too long"):
        verify_code(CODE_PREFIX + "A" * 5000)


@given(st.integers(min_value=0, max_value=len(_CODE) - 1))
def test_a_code_cut_anywhere_is_refused(cut: int) -> None:
    with pytest.raises(PairingCodeError):
        verify_code(_CODE[:cut])


@given(st.integers(min_value=len(CODE_PREFIX), max_value=len(_CODE) - 1))
def test_a_code_cut_in_its_payload_is_reported_as_cut(cut: int) -> None:
    assume((cut - len(CODE_PREFIX)) % 4 != 1)  # see the xfail test below
    with pytest.raises(PairingCodeError) as info:
        verify_code(_CODE[:cut])
    assert "truncated" in _message(info) or "cut" in _message(info)


def test_a_code_cut_after_4n_plus_1_characters_says_truncated() -> None:
    payload_chars = (len(_CODE) - len(CODE_PREFIX)) // 2
    payload_chars -= payload_chars % 4
    with pytest.raises(PairingCodeError, match="truncated"):
        verify_code(_CODE[: len(CODE_PREFIX) + payload_chars + 1])


def test_extra_characters_after_a_code_are_refused() -> None:
    with pytest.raises(PairingCodeError, match="extra characters"):
        verify_code(_CODE + "AAAA")


@given(
    position=st.integers(min_value=len(CODE_PREFIX), max_value=len(_CODE) - 1),
    char=st.sampled_from(URLSAFE),
)
def test_a_one_character_typo_is_caught_before_parsing(position: int, char: str) -> None:
    typo = _CODE[:position] + char + _CODE[position + 1 :]
    if _raw(typo) == _raw(_CODE):
        # Same character, or a change in the unused low bits of the last one:
        # the code still carries exactly the same bytes.
        assert verify_code(typo) == verify_code(_CODE)
        return
    with pytest.raises(PairingCodeError) as info:
        verify_code(typo)
    assert any(word in _message(info) for word in ("checksum", "truncated", "extra"))


def test_valid_crc_around_a_body_that_is_not_msgpack_is_malformed() -> None:
    with pytest.raises(PairingCodeError, match="malformed"):
        verify_code(_pack(b"\xc1\xc1\xc1"))


def test_valid_crc_around_an_offer_missing_fields_is_malformed() -> None:
    offer, signature = _unpack(_CODE)
    del offer["nonce"]
    with pytest.raises(PairingCodeError, match="malformed"):
        verify_code(_repack(offer, signature))


def test_decode_code_does_not_check_the_signature() -> None:
    offer, _ = _unpack(_CODE)
    offer["name"] = "mallory"
    decoded, _, _ = decode_code(_repack(offer, b"\x00" * 64))
    assert decoded.name == "mallory"


# --- tampering (valid CRC, broken signature) ----------------------------------


def test_rebuilding_a_code_unchanged_still_verifies() -> None:
    # Guards the tampering tests below: the hand-made re-encoding is faithful.
    offer, signature = _unpack(_CODE)
    assert verify_code(_repack(offer, signature)) == verify_code(_CODE)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", "mallory"),
        ("public_key", Identity.generate().public_key),
        ("addresses", ["203.0.113.66:47000"]),
        ("relay", "evil.example.org:4799"),
        ("expires", NOW + 10 * 365 * 86400),
        ("nonce", b"\x00" * 16),
    ],
    ids=lambda value: value if isinstance(value, str) and value.isidentifier() else "changed",
)
def test_a_tampered_field_fails_the_signature(field: str, value: object) -> None:
    offer, signature = _unpack(_CODE)
    assert offer[field] != value
    offer[field] = value
    with pytest.raises(PairingCodeError, match="signature does not verify") as info:
        verify_code(_repack(offer, signature))
    assert not isinstance(info.value, ExpiredCodeError)


def test_a_tampered_signature_is_refused() -> None:
    offer, signature = _unpack(_CODE)
    forged = bytes([signature[0] ^ 1]) + signature[1:]
    with pytest.raises(PairingCodeError, match="signature does not verify"):
        verify_code(_repack(offer, forged))


def test_a_signature_from_another_key_is_refused(other_identity: Identity) -> None:
    offer, _ = _unpack(_CODE)
    offer_bytes = msgspec.msgpack.encode(offer)
    signature = other_identity.sign(b"gpumesh-pairing-offer-v1\x00" + offer_bytes)
    with pytest.raises(PairingCodeError, match="signature does not verify"):
        verify_code(_repack(offer, signature))


def test_a_signature_without_the_domain_prefix_is_refused(identity: Identity) -> None:
    offer, _ = _unpack(make_code(identity, "alice", []))
    offer_bytes = msgspec.msgpack.encode(offer)
    with pytest.raises(PairingCodeError, match="signature does not verify"):
        verify_code(_repack(offer, identity.sign(offer_bytes)))


def test_a_short_public_key_is_refused() -> None:
    offer, signature = _unpack(_CODE)
    offer["public_key"] = offer["public_key"][:31]
    with pytest.raises(PairingCodeError, match="signature does not verify"):
        verify_code(_repack(offer, signature))


# --- signed but invalid fields ------------------------------------------------


def test_a_signed_code_with_an_invalid_name_is_refused(identity: Identity) -> None:
    with pytest.raises(PairingCodeError, match="invalid node name"):
        verify_code(make_code(identity, "bad name!", []))


def test_a_signed_code_with_an_overlong_address_is_refused(identity: Identity) -> None:
    with pytest.raises(PairingCodeError, match=r"bad address: 'hhh.*over 255 characters"):
        verify_code(make_code(identity, "alice", ["h" * 300 + ":1"]))


def test_a_signed_code_with_an_overlong_relay_is_refused(identity: Identity) -> None:
    with pytest.raises(PairingCodeError, match=r"bad relay: 'rrr.*over 255 characters"):
        verify_code(make_code(identity, "alice", [], "r" * 300 + ":1"))


@pytest.mark.parametrize("hint", BAD_HINTS)
def test_a_signed_code_with_a_bad_address_is_refused(identity: Identity, hint: str) -> None:
    code = make_code(identity, "alice", ["192.0.2.1:47000", hint])
    with pytest.raises(PairingCodeError) as caught:
        verify_code(code)
    message = str(caught.value)
    assert message.startswith("that pairing code carries a bad address: ")
    assert "ask the peer for a fresh `gpumesh pair-code`" in message
    assert "\n" not in message and "\x1b" not in message


@pytest.mark.parametrize("hint", [h for h in BAD_HINTS if h != "192.0.2.1"])
def test_a_signed_code_with_a_bad_relay_is_refused(identity: Identity, hint: str) -> None:
    with pytest.raises(PairingCodeError, match=r"^that pairing code carries a bad relay: "):
        verify_code(make_code(identity, "alice", ["192.0.2.1:47000"], hint))


@pytest.mark.parametrize(
    "hint",
    ["192.0.2.1:1", "[2001:db8::1]:65535", "node-1.example.org:47000", "localhost:4799", "a.b.:9"],
)
def test_ip_literals_and_host_names_are_taken(identity: Identity, hint: str) -> None:
    offer = verify_code(make_code(identity, "alice", [hint], hint))
    assert offer.addresses == [hint] and offer.relay == hint


def test_a_relay_hint_may_leave_out_its_port(identity: Identity) -> None:
    assert verify_code(make_code(identity, "alice", [], "relay.example.org")).relay == (
        "relay.example.org"
    )
