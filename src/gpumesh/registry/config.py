"""The registry's settings, with their defaults and checks (no I/O)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gpumesh.errors import ConfigError

__all__ = ["DEFAULT_DB", "DEFAULT_LISTEN", "RegistryConfig", "database_url"]

DEFAULT_LISTEN = "0.0.0.0:8080"
DEFAULT_DB = "gpumesh-registry.db"


@dataclass(frozen=True)
class RegistryConfig:
    """What one registry process does; every process serving one database should agree."""

    db: str = DEFAULT_DB
    """A SQLite file path, ``sqlite:///path``, or ``postgresql://user:pass@host/db``."""
    ttl: float = 900.0
    """Seconds a listing or address record stays without a refresh."""
    publish_per_key: int = 10
    """Records one key may publish per minute (0: no limit)."""
    publish_per_ip: int = 120
    """Records one source address may publish per minute (0: no limit)."""
    search_per_ip: int = 240
    """Searches and lookups one source address may make per minute (0: no limit)."""
    page_max: int = 100
    """Most listings in one page of search results."""
    max_body: int = 16384
    """Bytes of a request body; a record is at most 4096 before base64."""
    purge_every: float = 60.0
    """Seconds between deletions of what expired long enough ago."""

    def check(self) -> RegistryConfig:
        if self.ttl <= 0:
            raise ConfigError("--ttl must be more than zero seconds")
        for name in ("publish_per_key", "publish_per_ip", "search_per_ip"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be 0 (no limit) or more")
        if self.page_max < 1:
            raise ConfigError("--page-max must be at least 1")
        return self

    def replace(self, **changes: object) -> RegistryConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def database_url(text: str) -> str:
    """The SQLAlchemy URL for ``--db``: a path or sqlite:/// URL, or postgresql:// (asyncpg)."""
    if text.startswith(("postgresql://", "postgres://")):
        return "postgresql+asyncpg://" + text.split("://", 1)[1]
    if text.startswith("postgresql+asyncpg://"):
        return text
    if text.startswith("sqlite:///"):
        return text
    if "://" in text:
        raise ConfigError(
            f"unsupported --db {text.split('://', 1)[0]}://…: use a SQLite file path "
            "or a postgresql://user:password@host/database URL"
        )
    return "sqlite:///" + text
