"""Group invites: one signed, copy-pasteable token that lets a node join a group.

A group is a named set of nodes with a random id. An invite is made by a
member and carries what the joiner needs to find everyone: the group's id and
name, every member's name, public key, addresses and relay, and which member
signed it. Layout of ``gpg1_<base64url>``, framed like pairing codes
(:func:`gpumesh.identity.codes.encode_token`)::

    u16 body length | body (msgpack SignedInvite) | u32 CRC32 of everything before
    SignedInvite = {invite: msgpack GroupInvite, signature}
    signature = Ed25519(inviter's key, "gpumesh-group-invite-v1\\0" || invite)

The CRC catches typos and truncation; the signature, by a key that must be in
the invite's own member list, catches tampering (an added member, a changed
address or name). Joining a group grants nothing: members still pair with each
other before either can use the other.
"""

from __future__ import annotations

import base64
import math
import os
import re
import time
from collections.abc import Callable, Sequence

import msgspec

from gpumesh.errors import ConfigError, ExpiredCodeError, IdentityError, PairingCodeError
from gpumesh.identity.codes import (
    CODE_PREFIX,
    MAX_ADDRESSES,
    MAX_BODY_BYTES,
    decode_token,
    encode_token,
)
from gpumesh.identity.hints import check_hints
from gpumesh.identity.keys import (
    PUBLIC_KEY_SIZE,
    Identity,
    NodeId,
    check_node_name,
    node_id_for,
    verify_signature,
)
from gpumesh.units import format_duration

__all__ = [
    "INVITE_LIFETIME",
    "INVITE_PREFIX",
    "MAX_INVITE_LIFETIME",
    "MAX_MEMBERS",
    "GroupInvite",
    "InviteMember",
    "check_group_name",
    "decode_invite",
    "is_group_id",
    "make_invite",
    "new_group_id",
    "verify_invite",
]

INVITE_PREFIX = "gpg1_"
INVITE_LIFETIME = 24 * 3600.0
MAX_INVITE_LIFETIME = 7 * 86400.0
"""Longer invites are refused: the addresses they carry go stale anyway."""
MAX_MEMBERS = 64
# Enough characters for the largest body the u16 length field can announce.
MAX_INVITE_CHARS = len(INVITE_PREFIX) + 4 * math.ceil((MAX_BODY_BYTES + 6) / 3)
_DOMAIN = b"gpumesh-group-invite-v1\x00"
_CLOCK_SKEW = 300.0
_GROUP_ID_RE = re.compile(r"[a-z2-7]{24}")


class InviteMember(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One member of the group as the inviter knows it."""

    name: str
    public_key: bytes
    """Raw Ed25519 public key; pairing with this member must show the same key."""
    addresses: list[str]
    """``host:port`` hints, the one that last worked for the inviter first."""
    relay: str
    """``host:port`` of the member's relay, or empty."""

    @property
    def node_id(self) -> NodeId:
        return node_id_for(self.public_key)


class GroupInvite(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a group invite says."""

    group_id: str
    """24 random base32 characters; two groups with one name stay apart."""
    group_name: str
    inviter: bytes
    """Public key of the member who signed the invite (one of ``members``)."""
    members: list[InviteMember]
    """Every member the inviter knows, the inviter included."""
    expires: float
    """Unix time after which the invite is refused."""
    nonce: bytes
    """16 random bytes so two invites never repeat."""

    @property
    def inviter_member(self) -> InviteMember:
        """The signing member (verified invites always list it)."""
        for member in self.members:
            if member.public_key == self.inviter:
                return member
        raise LookupError("the inviter is not in the member list")


class _SignedInvite(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    invite: bytes
    signature: bytes


_encoder = msgspec.msgpack.Encoder()
_invite_decoder = msgspec.msgpack.Decoder(GroupInvite)
_signed_decoder = msgspec.msgpack.Decoder(_SignedInvite)


def new_group_id() -> str:
    """A fresh random group id (120 bits)."""
    return base64.b32encode(os.urandom(15)).decode("ascii").lower()


def is_group_id(text: str) -> bool:
    return _GROUP_ID_RE.fullmatch(text) is not None


def check_group_name(name: str) -> str:
    """Return ``name`` if it is a valid group name (the node-name rules), else raise."""
    if not _is_name(name):
        raise ConfigError(
            f"invalid group name {name!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def make_invite(
    identity: Identity,
    group_id: str,
    group_name: str,
    members: Sequence[InviteMember],
    *,
    clock: Callable[[], float] = time.time,
    lifetime: float = INVITE_LIFETIME,
) -> str:
    """An invite to ``group_name`` signed by ``identity``, valid for ``lifetime`` seconds.

    ``members`` must include ``identity``'s own key: joiners only accept
    invites signed by a member.
    """
    if not any(m.public_key == identity.public_key for m in members):
        raise ValueError("the inviting node must be one of the group's members")
    if len(members) > MAX_MEMBERS:
        raise ConfigError(
            f"{group_name} has {len(members)} members; an invite carries at most {MAX_MEMBERS}"
        )
    invite = GroupInvite(
        group_id=group_id,
        group_name=group_name,
        inviter=identity.public_key,
        members=[
            InviteMember(m.name, m.public_key, list(m.addresses[:MAX_ADDRESSES]), m.relay)
            for m in members
        ],
        expires=clock() + lifetime,
        nonce=os.urandom(16),
    )
    invite_bytes = _encoder.encode(invite)
    signed = _SignedInvite(invite=invite_bytes, signature=identity.sign(_DOMAIN + invite_bytes))
    body = _encoder.encode(signed)
    if len(body) > MAX_BODY_BYTES:
        raise ConfigError(
            f"the members of {group_name} and their addresses do not fit in one invite"
        )
    return encode_token(INVITE_PREFIX, body)


def decode_invite(code: str) -> tuple[GroupInvite, bytes, bytes]:
    """Parse an invite and check its CRC; returns (invite, invite bytes, signature).

    Does not check the signature, fields or expiry: see :func:`verify_invite`.
    """
    if "".join(code.split()).startswith(CODE_PREFIX):
        # The likeliest mix-up: both tokens come from `gpumesh` and look alike.
        raise PairingCodeError(
            "that is a pairing code, not a group invite: pair with it using "
            "`gpumesh pair '<code>'`, or ask a member for `gpumesh group invite NAME`"
        )
    body = decode_token(
        INVITE_PREFIX,
        code,
        "group invite",
        not_prefixed=(
            "that is not a GPUMesh group invite (invites start with "
            f"{INVITE_PREFIX!r}); copy the whole output of `gpumesh group invite NAME`"
        ),
        max_chars=MAX_INVITE_CHARS,
    )
    try:
        signed = _signed_decoder.decode(body)
        invite = _invite_decoder.decode(signed.invite)
    except msgspec.DecodeError as exc:
        raise PairingCodeError(f"that group invite is malformed ({exc})") from None
    return invite, signed.invite, signed.signature


def verify_invite(code: str, *, clock: Callable[[], float] = time.time) -> GroupInvite:
    """Decode an invite and check its signature, signer, fields and expiry."""
    invite, invite_bytes, signature = decode_invite(code)
    if not verify_signature(invite.inviter, signature, _DOMAIN + invite_bytes):
        raise PairingCodeError(
            "that group invite's signature does not verify: it was altered after it was "
            "made; ask a member for a fresh `gpumesh group invite`"
        )
    if not any(m.public_key == invite.inviter for m in invite.members):
        raise PairingCodeError(
            "that group invite is signed by a node that is not in the group; ask a member "
            "for a fresh `gpumesh group invite`"
        )
    _check_fields(invite)
    now = clock()
    again = (
        f"ask {invite.inviter_member.name} for a fresh `gpumesh group invite {invite.group_name}`"
    )
    if invite.expires < now:
        raise ExpiredCodeError(
            f"that group invite expired {format_duration(now - invite.expires)} ago; {again}"
        )
    # NaN compares false both ways: refused here, or it would never expire.
    if not invite.expires <= now + MAX_INVITE_LIFETIME + _CLOCK_SKEW:
        raise PairingCodeError(
            "that group invite claims to be valid for more than "
            f"{format_duration(MAX_INVITE_LIFETIME)}; check both machines' clocks, then {again}"
        )
    return invite


def _check_fields(invite: GroupInvite) -> None:
    if not is_group_id(invite.group_id):
        raise PairingCodeError("that group invite carries an invalid group id")
    if not _is_name(invite.group_name):
        raise PairingCodeError("that group invite carries an invalid group name")
    if len(invite.members) > MAX_MEMBERS:
        raise PairingCodeError(
            f"that group invite lists {len(invite.members)} members; at most "
            f"{MAX_MEMBERS} are allowed"
        )
    keys = set()
    for member in invite.members:
        if not _is_name(member.name) or len(member.public_key) != PUBLIC_KEY_SIZE:
            raise PairingCodeError("that group invite carries an invalid member")
        if len(member.addresses) > MAX_ADDRESSES:
            raise PairingCodeError(f"that group invite carries invalid addresses for {member.name}")
        try:
            check_hints(member.addresses, member.relay)
        except ValueError as exc:
            field, detail = exc.args
            raise PairingCodeError(
                f"that group invite carries a bad {field} for {member.name}: {detail}; "
                "ask a member for a fresh `gpumesh group invite`"
            ) from None
        if member.public_key in keys:
            raise PairingCodeError(f"that group invite lists {member.name}'s key twice")
        keys.add(member.public_key)
    if len(invite.nonce) != 16:
        raise PairingCodeError("that group invite is malformed")


def _is_name(name: str) -> bool:
    # Group names follow the node-name rules, so both read alike in tables and messages.
    try:
        check_node_name(name)
    except IdentityError:
        return False
    return True
