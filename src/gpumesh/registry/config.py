"""The registry's settings, with their defaults and checks, and who a request counts as
(no I/O).

A request counts as its source address, or, behind a reverse proxy named with
``--forwarded-allow-ips``, as the client that proxy names. Every proxy is named:
``*`` would let each client name itself and so escape every per-address limit.
An IPv6 client counts as its /64, which one subscriber is given whole; the cap
on live listings counts per /24 (IPv4) or /64 (IPv6), what one spammer holds.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from gpumesh.errors import ConfigError

__all__ = [
    "DEFAULT_DB",
    "DEFAULT_LISTEN",
    "RegistryConfig",
    "database_url",
    "rate_source",
    "source_network",
    "trusted_proxies",
]

DEFAULT_LISTEN = "0.0.0.0:47080"
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
    publish_per_ip: int = 30
    """Records one source address (an IPv6 /64) may publish per minute (0: no limit)."""
    search_per_ip: int = 240
    """Searches and lookups one source address may make per minute (0: no limit)."""
    page_max: int = 100
    """Most listings in one page of search results."""
    listings_per_net: int = 3
    """Live listings published from one /24 (IPv4) or /64 (IPv6); 0: no cap (tests
    that publish many from loopback)."""
    page_per_net: int = 2
    """Most listings of one such network on one page of search results; 0: no cap."""
    max_body: int = 16384
    """Bytes of a request body; a record is at most 4096 before base64."""
    purge_every: float = 60.0
    """Seconds between deletions of what expired long enough ago."""

    def check(self) -> RegistryConfig:
        if self.ttl <= 0:
            raise ConfigError("--ttl must be more than zero seconds")
        limits = ("publish_per_key", "publish_per_ip", "search_per_ip")
        for name in (*limits, "listings_per_net", "page_per_net"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be 0 (no limit) or more")
        if self.page_max < 1:
            raise ConfigError("--page-max must be at least 1")
        return self


def database_url(text: str) -> str:
    """The SQLAlchemy URL for ``--db``: a path or sqlite:/// URL, or postgresql:// (asyncpg)."""
    if text.startswith(("postgresql://", "postgres://")):
        return "postgresql+asyncpg://" + text.split("://", 1)[1]
    if text.startswith(("postgresql+asyncpg://", "sqlite:///")):
        return text
    if "://" in text:
        raise ConfigError(
            f"unsupported --db {text.split('://', 1)[0]}://…: use a SQLite file path "
            "or a postgresql://user:password@host/database URL"
        )
    return "sqlite:///" + text


def trusted_proxies(text: str) -> str:
    """``--forwarded-allow-ips``: comma-separated addresses or networks of the reverse
    proxies whose X-Forwarded-For is believed; ``*`` is refused."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name == "*":
            raise ConfigError(
                "--forwarded-allow-ips '*' would let every client choose the address its "
                "rate limits count: name your proxies' addresses (e.g. 127.0.0.1)"
            )
        try:
            ipaddress.ip_network(name, strict=False)
        except ValueError:
            raise ConfigError(
                f"--forwarded-allow-ips {name!r} is not an IP address or network: name your "
                "proxies' addresses (e.g. 127.0.0.1,10.0.0.0/8)"
            ) from None
    return ",".join(names)


def source_network(host: str) -> str:
    """The network a listing's publisher counts as: its /24 (IPv4) or /64 (IPv6);
    a source that is not an IP address counts as itself."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    prefix = 24 if address.version == 4 else 64
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))


def rate_source(host: str) -> str:
    """Whom a per-address rate limit counts: the IPv4 address, or the IPv6 /64 (one
    subscriber's whole prefix, which it may spread its requests over)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return source_network(host)
    return str(address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else address)
