"""The WAN lab's link scheduling (scripts/wanemu.py ``Direction``), without devices or a clock:
release times, the share lost at random, replay from a seed, the rate limit and the queue.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "wanemu.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wanemu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("wanemu", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


wanemu = _load()
Direction = wanemu.Direction


def packet(index: int, size: int = 1500) -> bytes:
    return index.to_bytes(4, "big") + bytes(size - 4)


def test_each_packet_is_released_exactly_its_delay_after_it_arrived_in_order() -> None:
    link = Direction(0.025, 0.0, random.Random(1))
    arrivals = [0.0, 0.001, 0.001, 0.0105, 0.030]
    for index, now in enumerate(arrivals):
        assert link.offer(packet(index), now)
    assert link.next_due() == pytest.approx(0.025)
    assert link.release(0.0249) == []
    assert link.release(0.025) == [packet(0)]
    assert link.next_due() == pytest.approx(0.026)
    assert link.release(0.0354) == [packet(1), packet(2)]
    assert link.next_due() == pytest.approx(0.0355)
    assert link.release(0.0356) == [packet(3)]
    assert link.release(0.0549) == []
    assert link.release(0.055) == [packet(4)]
    assert link.next_due() is None
    assert (link.stats.offered, link.stats.delivered, link.stats.lost) == (5, 5, 0)
    assert link.stats.bytes_delivered == 5 * 1500


def test_the_share_dropped_is_the_loss_asked_for_and_a_seed_replays_it() -> None:
    def run(seed: int) -> list[int]:
        link = Direction(0.0, 0.01, random.Random(seed))
        return [i for i in range(100_000) if not link.offer(packet(i, 64), i * 1e-5)]

    lost = run(7)
    # 1% of 100,000: the binomial's standard deviation is ~31, so 5 sigma either side.
    assert 1000 - 160 < len(lost) < 1000 + 160
    assert run(7) == lost  # same seed, same packets lost
    assert run(8) != lost
    link = Direction(0.0, 0.01, random.Random(7))
    for i in range(100_000):
        link.offer(packet(i, 64), i * 1e-5)
    released = link.release(2.0)
    assert len(released) == 100_000 - len(lost)
    assert {int.from_bytes(p[:4], "big") for p in released}.isdisjoint(lost)
    assert link.stats.lost == len(lost)


def test_no_loss_drops_nothing_and_draws_nothing() -> None:
    rng = random.Random(3)
    state = rng.getstate()
    link = Direction(0.01, 0.0, rng)
    assert all(link.offer(packet(i), 0.0) for i in range(1000))
    assert rng.getstate() == state


def test_a_rate_serialises_packets_one_after_another_before_the_delay() -> None:
    # 1500 bytes at 1.5 MB/s: one packet per millisecond on the wire.
    link = Direction(0.010, 0.0, random.Random(1), rate=1_500_000)
    for index in range(3):
        link.offer(packet(index), 0.0)
    assert link.release(0.0109) == []
    assert link.release(0.011) == [packet(0)]
    assert link.release(0.0119) == []
    assert link.release(0.0121) == [packet(1)]
    assert link.next_due() == pytest.approx(0.013)
    assert link.release(0.0131) == [packet(2)]
    # An idle wire starts the next packet when it arrives, not when the last one left.
    link.offer(packet(3), 1.0)
    assert link.next_due() == pytest.approx(1.011)


def test_a_full_queue_drops_the_tail_and_frees_space_as_packets_leave() -> None:
    link = Direction(0.050, 0.0, random.Random(1), limit=3000)
    assert link.offer(packet(0), 0.0)
    assert link.offer(packet(1), 0.0)
    assert not link.offer(packet(2), 0.0)
    assert link.stats.overflowed == 1
    assert link.release(0.05) == [packet(0), packet(1)]
    assert link.offer(packet(3), 0.06)
    assert link.queued == 1


@pytest.mark.parametrize(
    ("delay", "loss", "rate"), [(-0.001, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, -0.1, 0.0), (0, 0, -1)]
)
def test_nonsense_settings_are_refused(delay: float, loss: float, rate: float) -> None:
    with pytest.raises(ValueError):
        Direction(delay, loss, random.Random(1), rate=rate)


def test_the_command_line_turns_ms_and_percent_into_each_direction() -> None:
    args = wanemu.parse_args(["--delay", "25", "--loss", "0.5", "--loss-ba", "1", "--seed", "4"])
    a_to_b, b_to_a = wanemu.directions(args)
    assert (a_to_b.delay, a_to_b.loss) == (0.025, 0.005)
    assert (b_to_a.delay, b_to_a.loss) == (0.025, 0.01)
