"""``gpumesh group`` through the real CLI, across several node homes.

Every command runs in a fresh process, so each step also shows that group
state lives in the store and survives restarts. Every failure a user can
cause ends in one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import base64
import json
import sqlite3
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpumesh.identity.codes import CODE_PREFIX
from gpumesh.identity.invites import (
    INVITE_PREFIX,
    InviteMember,
    make_invite,
    new_group_id,
    verify_invite,
)
from gpumesh.identity.keys import Identity
from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _init, _one_line_error

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


def _ok(home: Path, *args: str) -> str:
    result = gpumesh(home, *args)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stdout


def _json(home: Path, *args: str) -> Any:
    return json.loads(_ok(home, *args, "--json"))


def _access(home: Path, group: str) -> dict[str, str]:
    return {m["name"]: m["access"] for m in _json(home, "group", "members", group)}


def _pair_both(a: Path, b: Path) -> None:
    _ok(b, "pair", _ok(a, "pair-code").strip())
    _ok(a, "pair", _ok(b, "pair-code").strip())


@pytest.fixture
def homes(tmp_path: Path) -> tuple[Path, Path, Path]:
    alice, bob, carol = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _init(alice, "alice-pc", 47101)
    _init(bob, "bob", 47102)
    _init(carol, "carol", 47103)
    return alice, bob, carol


def test_create_invite_join_pair_add_and_restart(homes: tuple[Path, Path, Path]) -> None:
    alice, bob, carol = homes
    assert "No groups yet" in _ok(alice, "group", "list")
    assert _json(alice, "group", "list") == []

    created = _ok(alice, "group", "create", "research")
    assert "Created group research" in created
    assert "gpumesh group invite research" in created
    invite = _ok(alice, "group", "invite", "research").strip()
    assert invite.startswith(INVITE_PREFIX)
    assert "\n" not in invite

    # bob joins: he learns alice's key and address, but is not paired with her yet.
    joined = _ok(bob, "group", "join", invite)
    assert "Joined group research" in joined
    assert "via alice-pc: 2 members" in joined
    assert "alice-pc: not paired: ask for their `gpumesh pair-code`" in joined
    members = {m["name"]: m for m in _json(bob, "group", "members", "research")}
    assert members["alice-pc"]["access"] == "not paired"
    assert members["alice-pc"]["paired"] is False
    assert members["alice-pc"]["addresses"] == ["127.0.0.1:47101"]
    assert members["alice-pc"]["hint"] == "not paired: ask for their `gpumesh pair-code`"
    assert members["bob"]["is_self"] is True
    assert members["bob"]["access"] == "self"
    human = _ok(bob, "group", "members", "research")
    assert "this node" in human
    assert "alice-pc: not paired: ask for their `gpumesh pair-code`" in human

    # alice cannot add bob before pairing with him.
    _one_line_error(gpumesh(alice, "group", "add", "research", "bob"), 2, "no paired peer named")

    _pair_both(alice, bob)
    assert _access(bob, "research") == {"alice-pc": "allowed", "bob": "self"}
    assert "paired, allowed" in _ok(bob, "group", "members", "research")
    added = _ok(alice, "group", "add", "research", "bob")
    assert "Added bob to research (2 members)" in added
    assert "already a member" in _ok(alice, "group", "add", "research", "bob")
    assert _access(alice, "research") == {"alice-pc": "self", "bob": "allowed"}

    _ok(bob, "deny", "alice-pc")
    assert _access(bob, "research")["alice-pc"] == "denied"
    assert "gpumesh allow alice-pc" in _ok(bob, "group", "members", "research")

    # carol joins with a newer invite, which now lists bob too.
    joined = _json(carol, "group", "join", _ok(alice, "group", "invite", "research").strip())
    assert joined["inviter"] == "alice-pc"
    assert joined["already_member"] is False
    assert {m["name"]: m["access"] for m in joined["members"]} == {
        "alice-pc": "not paired",
        "bob": "not paired",
        "carol": "self",
    }

    # Fresh processes, same answers: everything lives in each node's store.
    lists = [_json(home, "group", "list") for home in (alice, bob, carol)]
    assert len({entry[0]["group_id"] for entry in lists}) == 1
    assert [(entry[0]["name"], entry[0]["member_count"]) for entry in lists] == [
        ("research", 2),
        ("research", 2),
        ("research", 3),
    ]
    assert lists[0][0]["joined_via"] is None
    assert lists[1][0]["joined_via"] == "alice-pc"
    assert (lists[0][0]["usable"], lists[0][0]["others"]) == (1, 1)
    table = _ok(carol, "group", "list")
    assert "research" in table
    assert "joined via alice-pc" in table


def test_invite_expires_flag_and_member_invites(homes: tuple[Path, Path, Path]) -> None:
    alice, bob, carol = homes
    _ok(alice, "group", "create", "lab")
    before = time.time()
    code = _ok(alice, "group", "invite", "lab", "--expires", "1h").strip()
    invite = verify_invite(code)
    assert before + 3600 - 5 <= invite.expires <= time.time() + 3600
    _ok(bob, "group", "join", code)
    # Any member may invite: carol joins with bob's invite and learns of alice.
    joined = _json(carol, "group", "join", _ok(bob, "group", "invite", "lab").strip())
    assert joined["inviter"] == "bob"
    assert sorted(m["name"] for m in joined["members"]) == ["alice-pc", "bob", "carol"]
    # Joining again refreshes instead of failing.
    again = _ok(carol, "group", "join", _ok(alice, "group", "invite", "lab").strip())
    assert "Refreshed group lab" in again


# --- who may change a known group ---------------------------------------------


def _key(home: Path) -> bytes:
    return Identity.load(home / "identity.key").public_key


def _stored_members(home: Path) -> list[tuple[str, str, str, str]]:
    """Every group member row as the node's store holds it (name, addresses, relay)."""
    raw = sqlite3.connect(home / "gpumesh.db")
    try:
        rows = raw.execute(
            "SELECT group_id, name, addresses, relay FROM group_members ORDER BY group_id, node_id"
        )
        return [(str(a), str(b), str(c), str(d)) for a, b, c, d in rows]
    finally:
        raw.close()


def test_a_forged_invite_into_a_known_group_is_refused_and_changes_nothing(
    homes: tuple[Path, Path, Path],
) -> None:
    alice, bob, carol = homes
    _ok(alice, "group", "create", "research")
    _ok(alice, "pair", _ok(carol, "pair-code").strip())
    _ok(alice, "group", "add", "research", "carol")
    _ok(bob, "group", "join", _ok(alice, "group", "invite", "research").strip())
    _ok(bob, "pair", _ok(alice, "pair-code").strip())  # alice paired, carol not
    (group,) = _json(bob, "group", "list")
    members, peers, rows = (
        _json(bob, "group", "members", "research"),
        _json(bob, "peers"),
        _stored_members(bob),
    )

    stranger = Identity.generate()
    evil = ["203.0.113.66:47000"]
    forged = make_invite(
        stranger,
        group["group_id"],
        "research",
        [
            InviteMember("mallory", stranger.public_key, evil, ""),
            InviteMember("alice-evil", _key(alice), evil, "203.0.113.66:4799"),
            InviteMember("carol-evil", _key(carol), evil, "203.0.113.66:4799"),
        ],
    )
    refused = gpumesh(bob, "group", "join", forged)
    _one_line_error(
        refused,
        2,
        f"that invite to group research ({group['group_id'][:12]}) is signed by mallory "
        f"({stranger.node_id.short})",
    )
    assert "ask a member you know for an invite" in refused.stderr
    assert _json(bob, "group", "members", "research") == members
    assert _json(bob, "peers") == peers
    assert _stored_members(bob) == rows
    assert _json(bob, "group", "list") == [group]


def test_a_members_invite_still_refreshes_the_group(homes: tuple[Path, Path, Path]) -> None:
    alice, bob, carol = homes
    _ok(alice, "group", "create", "research")
    _ok(bob, "group", "join", _ok(alice, "group", "invite", "research").strip())
    _ok(alice, "config", "set", "listen_port", "47199")  # alice moved; bob never paired her
    again = _ok(bob, "group", "join", _ok(alice, "group", "invite", "research").strip())
    assert "Refreshed group research" in again
    assert "via alice-pc" in again
    members = {m["name"]: m for m in _json(bob, "group", "members", "research")}
    assert members["alice-pc"]["addresses"] == ["127.0.0.1:47199"]
    # Carol, known to bob as a member once alice's invite lists her, may refresh it too.
    _ok(carol, "group", "join", _ok(alice, "group", "invite", "research").strip())
    _ok(alice, "pair", _ok(carol, "pair-code").strip())
    _ok(alice, "group", "add", "research", "carol")
    _ok(bob, "group", "join", _ok(alice, "group", "invite", "research").strip())
    by_carol = _json(bob, "group", "join", _ok(carol, "group", "invite", "research").strip())
    assert (by_carol["inviter"], by_carol["already_member"]) == ("carol", True)


def test_invite_data_never_replaces_a_paired_peers_name_or_addresses(
    homes: tuple[Path, Path, Path],
) -> None:
    alice, bob, carol = homes
    _ok(alice, "group", "create", "research")
    _ok(carol, "group", "join", _ok(alice, "group", "invite", "research").strip())
    # Alice renames and moves after carol learned of her; bob pairs the new alice.
    _ok(alice, "config", "set", "node_name", "alice-new")
    _ok(alice, "config", "set", "listen_port", "47199")
    _ok(bob, "pair", _ok(alice, "pair-code").strip())
    paired = [("alice-new", '["127.0.0.1:47199"]', "")]

    # Carol's invite (a real member's, with a stale view of alice) starts the group on bob.
    _ok(bob, "group", "join", _ok(carol, "group", "invite", "research").strip())
    assert _access(bob, "research") == {
        "alice-new": "allowed",
        "bob": "self",
        "carol": "not paired",
    }
    assert [r[1:] for r in _stored_members(bob) if r[1].startswith("alice")] == paired
    # A stranger's new group listing alice with its own name and addresses.
    stranger = Identity.generate()
    evil = ["203.0.113.66:47000"]
    _ok(
        bob,
        "group",
        "join",
        make_invite(
            stranger,
            new_group_id(),
            "lab",
            [
                InviteMember("mallory", stranger.public_key, evil, ""),
                InviteMember("alice-evil", _key(alice), evil, "203.0.113.66:4799"),
            ],
        ),
    )
    assert _access(bob, "lab") == {"alice-new": "allowed", "bob": "self", "mallory": "not paired"}
    assert [r[1:] for r in _stored_members(bob) if r[1].startswith("alice")] == paired * 2
    (alice_peer,) = _json(bob, "peers")
    assert (alice_peer["name"], alice_peer["addresses"]) == ("alice-new", ["127.0.0.1:47199"])


# --- bad input ----------------------------------------------------------------


def _tamper(code: str, change: Any) -> str:
    """Change the signed invite, keep the signature, recompute the CRC."""
    payload = code[len(INVITE_PREFIX) :]
    raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    signed = msgspec.msgpack.decode(raw[2:-4])
    invite = msgspec.msgpack.decode(signed["invite"])
    change(invite)
    signed["invite"] = msgspec.msgpack.encode(invite)
    body = msgspec.msgpack.encode(signed)
    data = struct.pack("!H", len(body)) + body
    data += struct.pack("!I", zlib.crc32(data))
    return INVITE_PREFIX + base64.urlsafe_b64encode(data).decode().rstrip("=")


def _add_mallory(invite: dict[str, Any]) -> None:
    invite["members"].append(
        {
            "name": "mallory",
            "public_key": Identity.generate().public_key,
            "addresses": ["203.0.113.66:47000"],
            "relay": "",
        }
    )


@pytest.fixture
def alice_invite(homes: tuple[Path, Path, Path]) -> str:
    alice = homes[0]
    _ok(alice, "group", "create", "research")
    return _ok(alice, "group", "invite", "research").strip()


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda c: "hello there", "not a GPUMesh group invite"),
        (lambda c: c[:60], "group invite is truncated"),
        (lambda c: c[:40] + ("A" if c[40] != "A" else "B") + c[41:], "bad checksum"),
        (lambda c: c[:30] + "!!" + c[32:], "characters that do not belong"),
        (lambda c: c + "AAAA", "extra characters"),
        (lambda c: _tamper(c, lambda i: i.update(group_name="mallory")), "does not verify"),
        (lambda c: _tamper(c, _add_mallory), "signature does not verify"),
        (
            lambda c: _tamper(c, lambda i: i.update(expires=i["expires"] + 86400)),
            "signature does not verify",
        ),
    ],
    ids=["garbage", "truncated", "checksum", "characters", "extra", "name", "member", "expiry"],
)
def test_bad_invites_are_refused_before_anything_is_stored(
    homes: tuple[Path, Path, Path], alice_invite: str, mangle: Any, message: str
) -> None:
    bob = homes[1]
    _one_line_error(gpumesh(bob, "group", "join", mangle(alice_invite)), 2, message)
    assert _json(bob, "group", "list") == []


def test_a_pairing_code_is_not_an_invite(homes: tuple[Path, Path, Path]) -> None:
    alice, bob, _ = homes
    code = _ok(alice, "pair-code").strip()
    assert code.startswith(CODE_PREFIX)
    _one_line_error(
        gpumesh(bob, "group", "join", code), 2, "that is a pairing code, not a group invite"
    )
    assert _json(bob, "group", "list") == []


def test_an_expired_invite_is_refused(homes: tuple[Path, Path, Path]) -> None:
    bob = homes[1]
    signer = Identity.generate()
    stale = make_invite(
        signer,
        new_group_id(),
        "research",
        [InviteMember("alice-pc", signer.public_key, ["127.0.0.1:47101"], "")],
        clock=lambda: 1_000_000,
    )
    _one_line_error(gpumesh(bob, "group", "join", stale), 2, "that group invite expired")
    assert _json(bob, "group", "list") == []


def test_own_invite_and_a_same_named_other_group_are_refused(
    homes: tuple[Path, Path, Path], alice_invite: str
) -> None:
    alice, bob, _ = homes
    _one_line_error(gpumesh(alice, "group", "join", alice_invite), 2, "this node's own invite")
    _ok(bob, "group", "create", "research")
    _one_line_error(
        gpumesh(bob, "group", "join", alice_invite),
        2,
        "already has a different group named 'research'",
    )
    assert [g["member_count"] for g in _json(bob, "group", "list")] == [1]


def test_unknown_groups_taken_names_and_bad_values(
    homes: tuple[Path, Path, Path], alice_invite: str
) -> None:
    alice = homes[0]
    for args in (
        ("members", "nope"),
        ("invite", "nope"),
        ("add", "nope", "bob"),
    ):
        _one_line_error(gpumesh(alice, "group", *args), 2, "no group named 'nope'")
    _one_line_error(
        gpumesh(alice, "group", "create", "research"), 2, "a group named 'research' already exists"
    )
    _one_line_error(gpumesh(alice, "group", "create", "two words"), 2, "invalid group name")
    _one_line_error(
        gpumesh(alice, "group", "invite", "research", "--expires", "soon"), 2, "invalid duration"
    )
    _one_line_error(
        gpumesh(alice, "group", "invite", "research", "--expires", "30d"), 2, "at most 7d"
    )
    _one_line_error(gpumesh(alice, "group", "add", "research", "nobody"), 2, "no paired peer")
    assert [g["member_count"] for g in _json(alice, "group", "list")] == [1]


def test_group_commands_before_init_say_how_to_start(tmp_path: Path) -> None:
    _one_line_error(gpumesh(tmp_path / "none", "group", "list"), 2, "run `gpumesh init")


def test_group_help_has_examples_everywhere() -> None:
    for sub in ("", "create", "list", "invite", "join", "add", "members"):
        args = ["group", sub, "--help"] if sub else ["group", "--help"]
        result = gpumesh(Path("/nonexistent"), *args)
        assert result.returncode == 0, result.stderr
        assert "Examples:" in result.stdout, sub
    assert "Create, share and join groups" in _ok(Path("/nonexistent"), "--help")


def test_an_unreachable_member_is_worded_as_connect_words_it(
    homes: tuple[Path, Path, Path],
) -> None:
    """alice-pc is paired and in the group but not sharing: `group members` and
    `run --group --explain` say where they tried (with the port) and what to check,
    in the same words as `connect`."""
    alice, bob, _carol = homes
    _ok(alice, "group", "create", "research")
    _ok(bob, "group", "join", _ok(alice, "group", "invite", "research").strip())
    _pair_both(alice, bob)
    connect = gpumesh(bob, "connect", "alice-pc")
    assert connect.returncode == 4, connect.stderr
    words = connect.stderr.strip().removeprefix("error: ")
    assert "127.0.0.1:47101" in words
    assert "is `gpumesh share` running there?" in words

    members = {m["name"]: m for m in _json(bob, "group", "members", "research")}
    assert members["alice-pc"]["reachable"] is False
    assert members["alice-pc"]["reach"] == f"unreachable: {words}"
    assert f"alice-pc: unreachable: {words}" in _ok(bob, "group", "members", "research")

    explained = gpumesh(bob, "run", "--group", "research", "--explain", "--", "true")
    assert explained.returncode != 0
    assert f"alice-pc: unreachable: {words}" in explained.stderr
    assert "Traceback" not in explained.stderr
