"""The network holder's program (gpumesh.runtime.holders.pause_program): a
static ELF executable that waits for signals forever. On an x86-64 machine the
x86-64 program is run for real; the arm64 one is checked as an ELF file only
(no arm64 machine runs these tests)."""

from __future__ import annotations

import platform
import signal
import struct
import subprocess
from pathlib import Path

import pytest

from gpumesh.runtime.holders import pause_program

MACHINES = {"amd64": 0x3E, "arm64": 0xB7}


@pytest.mark.parametrize("arch", sorted(MACHINES))
def test_the_program_is_one_loadable_executable_segment_with_its_entry_inside(arch: str) -> None:
    program = pause_program(arch)
    assert program is not None
    assert program[:4] == b"\x7fELF"
    assert program[4:6] == bytes([2, 1])  # 64-bit, little-endian
    kind, machine, _, entry, phoff = struct.unpack_from("<HHIQQ", program, 16)
    assert (kind, machine, phoff) == (2, MACHINES[arch], 64)
    (count,) = struct.unpack_from("<H", program, 56)
    assert count == 1
    ptype, flags, offset, vaddr, _, filesz, memsz, _ = struct.unpack_from("<IIQQQQQQ", program, 64)
    assert (ptype, flags, offset) == (1, 5, 0)  # loaded, read and execute, never writable
    assert filesz == memsz == len(program)
    assert vaddr < entry < vaddr + len(program)
    assert entry - vaddr == 120  # the code right after both headers


def test_an_unknown_architecture_gets_no_program() -> None:
    assert pause_program("s390x") is None


@pytest.mark.skipif(platform.machine() != "x86_64", reason="runs the x86-64 program")
def test_the_x86_64_program_waits_until_a_signal_ends_it(tmp_path: Path) -> None:
    program = pause_program("amd64")
    assert program is not None
    path = tmp_path / "pause"
    path.write_bytes(program)
    path.chmod(0o555)
    proc = subprocess.Popen([str(path)])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)  # still waiting: it neither exits nor crashes
        proc.send_signal(signal.SIGCHLD)  # ignored by default: it goes on waiting
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
        proc.terminate()
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_a_spare_whose_start_failed_once_is_made_on_a_second_try(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine's runtime fails a start now and then ("cannot start a stopped
    process"): the maker tries that spare again, and gives up (saying so) only when
    a spare fails twice in a row. The engine here is a stand-in: only the maker's
    loop is under test (tests/integration/test_holders.py makes real ones)."""
    from gpumesh.errors import AgentError
    from gpumesh.runtime.holders import Holders, Placement

    outcomes = iter(["fail", "holder-1", "fail", "holder-2"])

    def start(_self: Holders, _placement: Placement) -> str:
        outcome = next(outcomes)
        if outcome == "fail":
            raise AgentError("Docker could not start a network holder: cannot start a stopped")
        return outcome

    monkeypatch.setattr(Holders, "_start", start)
    holders = Holders(engine=lambda _what: pytest.fail("no engine here"), arch=lambda: "amd64")
    placement = Placement("net", (), True, "node")
    assert holders.replenish(placement, wait=30)
    assert holders.spares() == ["holder-1", "holder-2"]

    failing = iter(["holder-3", "fail", "fail"])
    monkeypatch.setattr(Holders, "_start", lambda _s, _p: _fail_or(next(failing)))
    with caplog.at_level("WARNING"):
        again = Holders(engine=lambda _what: pytest.fail("no engine here"), arch=lambda: "amd64")
        assert again.replenish(placement, wait=30)
    assert again.spares() == ["holder-3"]
    assert "no network holder made for net" in caplog.text


def _fail_or(outcome: str) -> str:
    from gpumesh.errors import AgentError

    if outcome == "fail":
        raise AgentError("cannot start a stopped process")
    return outcome
