"""`gpumesh pair` says whether the peer has paired us too: one short dial through
the real CLI to real `gpumesh share` processes on loopback."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import gpumesh
from tests.integration.test_cli import _free_udp_port, _init, _start_share


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
    alice, _bob = homes
    share = _start_share(alice)
    try:
        yield homes
    finally:
        _stop(share)


def _stop(share: subprocess.Popen[str]) -> None:
    if share.poll() is None:
        share.kill()
    share.wait()
    for pipe in (share.stdout, share.stderr):
        if pipe is not None:
            pipe.close()


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


def test_a_peer_not_running_is_unreachable_in_connects_words(homes: tuple[Path, Path]) -> None:
    alice, bob = homes
    out = _ok(bob, "pair", _ok(alice, "pair-code").strip())
    connect = gpumesh(bob, "connect", "alice-pc")
    assert connect.returncode == 4, connect.stderr
    words = connect.stderr.strip().removeprefix("error: ")
    assert "is `gpumesh share` running there?" in words
    assert f"alice-pc is not reachable now: {words}" in out
    assert "ready" not in out


def test_offline_skips_the_check(homes: tuple[Path, Path]) -> None:
    alice, bob = homes
    report = json.loads(_ok(bob, "pair", "--offline", "--json", _ok(alice, "pair-code").strip()))
    assert report["paired_back"] is None
    assert "must also pair with your code" in _ok(
        alice, "pair", "--offline", _ok(bob, "pair-code").strip()
    )
    help_text = _ok(bob, "pair", "--help")
    assert "--offline" in help_text
