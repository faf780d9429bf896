"""`gpumesh pair` says whether the peer has paired us too: one short dial through
the real CLI to real `gpumesh share` processes on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _free_udp_port, _init, running_share

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


def _ok(home: Path, *args: str) -> str:
    result = gpumesh(home, *args)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stdout


@pytest.fixture
def homes(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    alice, bob = tmp_path / "a", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop", _free_udp_port())
    yield alice, bob


@pytest.fixture
def alice_sharing(homes: tuple[Path, Path]) -> Iterator[tuple[Path, Path]]:
    with running_share(homes[0]):
        yield homes


def test_a_peer_that_paired_us_first_is_ready(alice_sharing: tuple[Path, Path]) -> None:
    alice, bob = alice_sharing
    _ok(alice, "pair", "--offline", _ok(bob, "pair-code").strip())
    out = _ok(bob, "pair", _ok(alice, "pair-code").strip())
    assert "alice-pc has paired you too: ready." in out
    assert "must also pair" not in out
    assert "not paired you" not in out
    # And it is: connecting works right away.
    assert json.loads(_ok(bob, "connect", "alice-pc", "--json"))["reachable"] is True


def test_a_peer_that_has_not_paired_us_yet_is_named_with_what_to_send(
    alice_sharing: tuple[Path, Path],
) -> None:
    alice, bob = alice_sharing
    report = json.loads(_ok(bob, "pair", "--json", _ok(alice, "pair-code").strip()))
    assert report["name"] == "alice-pc"
    assert report["paired_back"] == "not_paired"
    assert report["paired_back_reason"] is None
    # Once alice pairs back, the very next check says ready: the refused dial
    # left nothing behind that holds bob off.
    _ok(alice, "pair", "--offline", _ok(bob, "pair-code").strip())
    assert json.loads(_ok(bob, "connect", "alice-pc", "--json"))["reachable"] is True


def test_not_paired_yet_in_words(alice_sharing: tuple[Path, Path]) -> None:
    alice, bob = alice_sharing
    out = _ok(bob, "pair", _ok(alice, "pair-code").strip())
    assert "alice-pc has not paired you yet: send them your code" in out
    assert "`gpumesh pair-code`" in out
    assert "ready" not in out


def test_a_peer_that_does_not_answer_is_not_blamed(homes: tuple[Path, Path]) -> None:
    """In the README's own flow the provider pairs a node that only consumes: it never
    answers, and nothing is wrong. The pair said it "is not reachable now … is
    `gpumesh share` running there?", as if it had to share."""
    alice, bob = homes
    out = _ok(bob, "pair", _ok(alice, "pair-code").strip())
    assert (
        "alice-pc did not answer, so whether it paired you too is not known yet: that is "
        "expected if alice-pc only uses GPUs and does not share its own "
        "(`gpumesh connect alice-pc` checks once it shares)."
    ) in out
    assert "share` running there" not in out and "ready" not in out
    report = json.loads(_ok(bob, "pair", "--rekey", "--json", _ok(alice, "pair-code").strip()))
    assert report["paired_back"] == "unreachable"  # the reason stays in --json
    assert report["paired_back_reason"]


def test_a_relay_refusal_is_not_the_peer_refusing(homes: tuple[Path, Path], tmp_path: Path) -> None:
    """With a relay hint the pair said `alice-pc refuses you: relay … not-allowed`,
    though the relay refused, not alice-pc."""
    from tests.integration.test_relay_node import _start_relay
    from tests.integration.test_relay_node import _stop as _stop_relay

    alice, bob = homes
    alice_id = json.loads(_ok(alice, "status", "--json", "--offline"))["node_id"]
    proc, relay = _start_relay(tmp_path, "--allow", alice_id)  # bob is not allowed there
    try:
        _ok(alice, "config", "set", "relay", relay)
        out = _ok(bob, "pair", _ok(alice, "pair-code").strip())
    finally:
        _stop_relay(proc)
    assert "refuses you" not in out
    assert "alice-pc did not answer" in out


def test_offline_skips_the_check(homes: tuple[Path, Path]) -> None:
    alice, bob = homes
    report = json.loads(_ok(bob, "pair", "--offline", "--json", _ok(alice, "pair-code").strip()))
    assert report["paired_back"] is None
    assert "must also pair with your code" in _ok(
        alice, "pair", "--offline", _ok(bob, "pair-code").strip()
    )
    help_text = _ok(bob, "pair", "--help")
    assert "--offline" in help_text
