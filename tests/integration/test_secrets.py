"""Secrets at rest: the agent's home modes."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from gpumesh.client.node import Node
from tests.integration.conftest import arun, sharing


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_sharing_narrows_the_home_again(make_node: Callable[[str], Node]) -> None:
    alice = make_node("alice")
    home = alice.home
    home.path.chmod(0o755)
    home.config_path.chmod(0o644)
    home.db_path.chmod(0o644)

    async def scenario() -> None:
        async with sharing(alice):
            assert _mode(home.path) == 0o700
            assert _mode(home.config_path) == 0o600
            assert _mode(home.db_path) == 0o600
            assert _mode(home.agent_path) == 0o600

    arun(scenario())
