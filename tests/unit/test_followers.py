"""Wake-up sockets for followers of hosted jobs: real unix datagram sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpumesh.store.followers import FOLDER, FollowerSocket, FollowerWakeups


def test_the_agent_wakes_every_follower_and_forgets_dead_ones(tmp_path: Path) -> None:
    wakeups = FollowerWakeups(tmp_path)
    assert wakeups.wake() == 0  # no folder, no followers: nothing to do, no error

    async def scenario() -> None:
        with FollowerSocket(tmp_path) as first, FollowerSocket(tmp_path) as second:
            assert (tmp_path / FOLDER).stat().st_mode & 0o777 == 0o700
            dead = FollowerSocket(tmp_path)
            dead._sock.close()  # its follower died without removing its file
            assert wakeups.wake() == 2
            assert await first.wait(3600) and await second.wait(3600)
            assert not (tmp_path / FOLDER / dead.name).exists()
            # A burst of wake-ups is one.
            for _ in range(5):
                wakeups.wake()
            assert await first.wait(3600)
            assert not await first.wait(0)
        assert not list((tmp_path / FOLDER).iterdir())

    asyncio.run(scenario())
    wakeups.close()


def test_a_home_path_too_long_for_a_socket_still_works(tmp_path: Path) -> None:
    home = tmp_path / ("h" * 60) / ("o" * 60)
    home.mkdir(parents=True)

    async def scenario() -> None:
        with FollowerSocket(home) as follower:
            wakeups = FollowerWakeups(home)
            assert wakeups.wake() == 1
            assert await follower.wait(3600)
            wakeups.close()

    asyncio.run(scenario())
