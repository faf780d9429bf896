"""When a node process decides to exit, decided on an injected clock (no sleeping)."""

from __future__ import annotations

from pathlib import Path

from gpumesh.daemon.process import NodeProcess


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_background_node_exits_after_its_idle_period_without_a_request(tmp_path: Path) -> None:
    clock = Clock()
    process = NodeProcess(tmp_path, detached=True, api=[], tcp=False, idle=600.0, clock=clock)
    clock.now += 599.9
    assert process.should_exit() is None
    clock.now += 0.1
    assert process.should_exit() == "idle for 600 s"


def test_an_open_request_keeps_it_and_its_end_restarts_the_period(tmp_path: Path) -> None:
    clock = Clock()
    process = NodeProcess(tmp_path, detached=True, api=[], tcp=False, idle=10.0, clock=clock)
    process.active = 1  # an event stream being followed
    clock.now += 3600
    assert process.should_exit() is None
    process.active = 0
    process.last_active = clock.now  # as the request wrapper records its end
    clock.now += 9
    assert process.should_exit() is None
    clock.now += 1
    assert process.should_exit() is not None


def test_a_foreground_node_never_idles_out_but_goes_with_its_home(tmp_path: Path) -> None:
    clock = Clock()
    home = tmp_path / "home"
    home.mkdir()
    process = NodeProcess(home, detached=False, api=[], tcp=True, idle=None, clock=clock)
    clock.now += 10**6
    assert process.should_exit() is None
    home.rmdir()
    assert process.should_exit() == f"its home {home} is gone"
