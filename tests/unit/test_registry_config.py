"""Who a registry request counts as, and which proxies may say so (no I/O)."""

from __future__ import annotations

import pytest

from gpumesh.errors import ConfigError
from gpumesh.registry.config import RegistryConfig, rate_source, source_network, trusted_proxies


def test_a_publisher_counts_as_its_24_or_its_64() -> None:
    assert source_network("203.0.113.77") == "203.0.113.0/24"
    assert source_network("::ffff:203.0.113.77") == "203.0.113.0/24"
    assert source_network("2001:db8:1:2:aaaa::1") == "2001:db8:1:2::/64"
    assert source_network("2001:db8:1:3::1") != source_network("2001:db8:1:2::1")
    assert source_network("unknown") == "unknown"


def test_rate_limits_count_an_ipv4_address_or_a_whole_ipv6_64() -> None:
    assert rate_source("203.0.113.77") == "203.0.113.77"
    assert rate_source("::ffff:203.0.113.77") == "203.0.113.77"
    # One subscriber holds the whole /64: each of its addresses is the same budget.
    assert rate_source("2001:db8:1:2::1") == rate_source("2001:db8:1:2:ffff::9")


@pytest.mark.parametrize("value", ["*", " * ", "127.0.0.1,*", "10.0.0.1, *"])
def test_any_proxy_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"--forwarded-allow-ips '\*' would let every client"):
        trusted_proxies(value)


def test_named_proxies_are_addresses_or_networks() -> None:
    assert trusted_proxies("") == ""
    assert trusted_proxies("127.0.0.1, 10.0.0.0/8,::1") == "127.0.0.1,10.0.0.0/8,::1"
    with pytest.raises(ConfigError, match=r"'proxy\.example' is not an IP address or network"):
        trusted_proxies("proxy.example")


def test_the_defaults_cap_each_network() -> None:
    config = RegistryConfig()
    assert (config.publish_per_ip, config.listings_per_net, config.page_per_net) == (30, 3, 2)
    with pytest.raises(ConfigError, match="--listings-per-net must be 0"):
        RegistryConfig(listings_per_net=-1).check()
