"""Shared fixtures for the unit tests: identities and a throwaway Store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumesh.identity.keys import Identity
from gpumesh.store.db import Store


@pytest.fixture
def identity() -> Identity:
    return Identity.generate()


@pytest.fixture
def other_identity() -> Identity:
    return Identity.generate()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path / "gpumesh.db")
    try:
        yield opened
    finally:
        opened.close()
