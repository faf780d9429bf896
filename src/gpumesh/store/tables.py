"""What the store's table groups share: its one connection and one transaction function.

:class:`~gpumesh.store.db.Store` opens the connection and owns the transaction;
its parts (:mod:`~gpumesh.store.peers`, :mod:`~gpumesh.store.jobs`,
:mod:`~gpumesh.store.images`, :mod:`~gpumesh.store.groups`,
:mod:`~gpumesh.store.shares`) declare here what they use of it.
"""

from __future__ import annotations

import sqlite3
import threading
from contextlib import AbstractContextManager
from typing import Protocol

__all__ = ["Tables"]


class Tables(Protocol):
    """What a table group works through: the connection, its lock, and the
    store's transaction, query and execute (see :class:`~gpumesh.store.db.Store`)."""

    _db: sqlite3.Connection
    _lock: threading.Lock

    def _transaction(self) -> AbstractContextManager[None]: ...

    def _query(self, sql: str, args: tuple[object, ...] = ()) -> list[sqlite3.Row]: ...

    def _execute(self, sql: str, args: tuple[object, ...] = ()) -> int: ...
