"""The README's exit-code table, case by case, through the real CLI on local homes.

Each row a user can meet without Docker or a second machine is caused here for
real and its code checked with its one line: bad input (2), refused (3),
unreachable (4), already in use (7), a failure of another kind (1) and success
where what was asked for is already so (0). Docker's rows (6, 124-127) and
Ctrl-C (130) are checked where jobs and follows are tested
(test_cli.py, test_runtime.py, test_cli_run.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.errors import ExitCode
from gpumesh.gpu.inventory import detect_inventory
from tests.integration.conftest import gpumesh
from tests.integration.node import cli
from tests.integration.test_cli import _free_udp_port, _init, _one_line_error, running_share

pytestmark = pytest.mark.usefixtures("gpumesh_processes")


@pytest.fixture
def alice_and_bob(tmp_path: Path) -> tuple[Path, Path]:
    """alice (not sharing) and bob, who has paired her; she has not paired him."""
    alice, bob = tmp_path / "a", tmp_path / "b"
    _init(alice, "alice-pc", _free_udp_port())
    _init(bob, "bob-laptop")
    assert gpumesh(bob, "pair", gpumesh(alice, "pair-code").stdout.strip()).returncode == 0
    return alice, bob


@pytest.fixture
def alice_shares(alice_and_bob: tuple[Path, Path]) -> Iterator[tuple[Path, Path]]:
    with running_share(alice_and_bob[0]):
        yield alice_and_bob


def test_bad_input_is_2(tmp_path: Path) -> None:
    _one_line_error(
        gpumesh(tmp_path / "x", "init", "--name", "my PC!"), ExitCode.USAGE, "invalid node name"
    )
    _init(tmp_path / "a", "alice-pc")
    _one_line_error(
        gpumesh(tmp_path / "a", "connect", "nobody"), ExitCode.USAGE, "no paired peer named"
    )


def test_gpu_gives_the_same_code_with_and_without_json(tmp_path: Path) -> None:
    _init(tmp_path / "a", "alice-pc")
    text = gpumesh(tmp_path / "a", "gpu")
    as_json = gpumesh(tmp_path / "a", "gpu", "--json")
    assert text.returncode == as_json.returncode, (text, as_json)
    if detect_inventory().gpus():  # a machine with a GPU (or simulated ones)
        assert text.returncode == 0
        return
    _one_line_error(text, ExitCode.FAILED, "no NVIDIA GPU found")
    assert '"gpus": []' in as_json.stdout  # the JSON is printed all the same


@pytest.mark.parametrize("through_node", [True, False], ids=["node-process", "in-process"])
def test_share_stop_with_nothing_running_is_0(tmp_path: Path, through_node: bool) -> None:
    _init(tmp_path / "a", "alice-pc")
    run = cli if through_node else gpumesh
    stopped: subprocess.CompletedProcess[str] = run(tmp_path / "a", "share", "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert "nothing to stop" in stopped.stdout and not stopped.stderr


def test_a_peer_not_sharing_is_unreachable_4(alice_and_bob: tuple[Path, Path]) -> None:
    _, bob = alice_and_bob
    _one_line_error(
        gpumesh(bob, "connect", "alice-pc", "--timeout", "5"),
        ExitCode.UNREACHABLE,
        "nothing is listening on 127.0.0.1:",
    )


def test_refused_is_3_and_a_second_share_is_7(alice_shares: tuple[Path, Path]) -> None:
    alice, bob = alice_shares
    _one_line_error(
        gpumesh(bob, "connect", "alice-pc", "--timeout", "30"),
        ExitCode.DENIED,
        "alice-pc has not paired with you",
    )
    _one_line_error(
        gpumesh(alice, "share", "--port", str(_free_udp_port())),
        ExitCode.IN_USE,
        "this home already shares with",
    )
