"""A copy's progress as an async iterator (real agent, real QUIC)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpumesh.client.copies import CopyProgress, CopyStarted, watch_copy
from gpumesh.errors import NotFoundError
from tests.integration.conftest import arun, pair_both, sharing


def test_a_copys_progress_comes_as_events_and_its_result_after(make_node, tmp_path: Path) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    data = os.urandom(3 << 20)
    (tmp_path / "data.bin").write_bytes(data)

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            copying = watch_copy(bob, str(tmp_path / "data.bin"), "alice:/data.bin")
            events = [event async for event in copying]
            assert isinstance(events[0], CopyStarted) and events[0].total == len(data)
            progress = [e for e in events if isinstance(e, CopyProgress)]
            assert progress and progress[-1].done == progress[-1].total == len(data)
            assert [e.done for e in progress] == sorted(e.done for e in progress)
            assert copying.result is not None and copying.result.size == len(data)
            back = tmp_path / "back.bin"
            assert [e async for e in watch_copy(bob, "alice:/data.bin", str(back))]
            assert back.read_bytes() == data
            with pytest.raises(NotFoundError):
                async for _ in watch_copy(bob, "alice:/missing.bin", str(tmp_path / "m")):
                    pass

    arun(scenario())
