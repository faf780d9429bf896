"""store/config: typed keys validated on write, file round trip, environment overrides."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpumesh.errors import ConfigError
from gpumesh.runtime.jobnet import MODES
from gpumesh.store.config import DEFAULT_IMAGE, DEFAULT_PORT, KEYS, MASK, Config, value_text
from gpumesh.units import parse_size

ENV_VARS = ("GPUMESH_RELAY", "GPUMESH_IMAGE", "GPUMESH_REGION")


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return Config.load(tmp_path / "config.toml")


def test_missing_file_gives_defaults(config: Config) -> None:
    assert [config.get(key) for key in ("job_cpus", "job_memory", "share_memory")] == [
        "auto",
        "auto",
        "auto",
    ]
    assert config.listen_port == DEFAULT_PORT
    assert config.listen_host == "0.0.0.0"
    assert config.get("image") == DEFAULT_IMAGE
    assert config.relay == ""
    assert config.connect_timeout == 5.0
    assert config.source("listen_port") == "default"


def test_set_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "config.toml"
    config = Config.load(path)
    assert config.set("listen_port", "47001") == 47001
    config.set("node_name", "gpu-box")
    config.set("relay", "relay.example.org:4799")
    config.set("connect_timeout", "2.5")
    config.set("job_network", "none")
    config.save()
    loaded = Config.load(path)
    assert loaded.listen_port == 47001
    assert loaded.node_name == "gpu-box"
    assert loaded.relay == "relay.example.org:4799"
    assert loaded.connect_timeout == 2.5
    assert loaded.get("job_network") == "none"
    assert loaded.source("listen_port") == "file"
    assert loaded.source("listen_host") == "default"
    assert not path.with_suffix(".tmp").exists()


def test_a_yes_no_setting_is_a_boolean_in_the_file_and_in_json(tmp_path: Path) -> None:
    """`config show --json` gave announce_addresses as the string "false"."""
    path = tmp_path / "config.toml"
    config = Config.load(path)
    assert config.get("announce_addresses") is False
    assert config.set("announce_addresses", "true") is True
    config.save()
    assert "announce_addresses = true\n" in path.read_text()
    assert Config.load(path).get("announce_addresses") is True
    assert value_text(True) == "true" and value_text(False) == "false"
    # A file an earlier version wrote says "true" or "false" as text.
    path.write_text('announce_addresses = "false"\n')
    assert Config.load(path).get("announce_addresses") is False
    with pytest.raises(ConfigError, match="use true or false"):
        config.set("announce_addresses", "maybe")


def test_unset_returns_to_the_default(config: Config) -> None:
    config.set("listen_port", "1234")
    config.unset("listen_port")
    assert config.listen_port == DEFAULT_PORT
    assert config.source("listen_port") == "default"


@pytest.mark.parametrize("operation", ["get", "set", "unset", "source"])
def test_unknown_key_lists_the_valid_keys(config: Config, operation: str) -> None:
    args = ("colour", "blue") if operation == "set" else ("colour",)
    with pytest.raises(ConfigError, match="unknown config key 'colour'") as info:
        getattr(config, operation)(*args)
    for name in KEYS:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("listen_port", "0"),
        ("listen_port", "70000"),
        ("listen_port", "65536"),
        ("listen_port", "abc"),
        ("listen_port", ""),
        ("listen_host", "localhost"),
        ("listen_host", "300.1.1.1"),
        ("listen_host", ""),
        ("relay", "relay.example.org:"),
        ("relay", "[2001:db8::1]x"),
        ("relay", "relay example.org"),
        ("relay", ":4799"),
        ("relay", "relay.example.org:0"),
        ("relay", "relay.example.org:http"),
        ("job_network", "host"),
        ("job_network", "Bridge"),
        ("max_vram", "lots"),
        ("job_memory", "0"),
        ("job_memory", "16 gigs"),
        ("upload_limit", "-5GB"),
        ("connect_timeout", "0"),
        ("connect_timeout", "soon"),
        ("job_pids_limit", "-1"),
        ("job_pids_limit", "1.5"),
        ("job_cpus", "-0.5"),
        ("job_cpus", "lots"),
        ("job_memory", "automatic"),
        ("share_memory", "lots"),
        ("max_jobs_per_peer", "-1"),
        ("max_shells_per_peer", "two"),
        ("max_requests_per_link", "1.5"),
        ("link_buffer", "1MB"),
        ("rendezvous_url", "ftp://x"),
        ("node_name", "bad name"),
        ("region", "r" * 256),
        ("relay_for_peers", "maybe"),
        ("relay_for_peers_sessions", "0"),
        ("relay_for_peers_sessions", "many"),
        ("relay_for_peers_rate", "fast"),
        ("relay_for_peers_rate", "0MB/s"),
    ],
)
def test_bad_values_are_refused(config: Config, key: str, value: str) -> None:
    with pytest.raises(ConfigError):
        config.set(key, value)
    assert config.source(key) == "default"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("listen_port", "70000", "1 to 65535"),
        ("listen_host", "localhost", "IP address"),
        ("relay", "relay.example.org:", "host or host:port"),
        ("job_network", "host", "internet, lan, bridge, none"),
        ("max_vram", "lots", "16GiB"),
        ("job_cpus", "lots", "positive number; or auto"),
        ("link_buffer", "8MiB", "at least 16MiB"),
    ],
)
def test_refusals_say_what_would_be_valid(
    config: Config, key: str, value: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config.set(key, value)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("listen_port", "1", 1),
        ("listen_port", "65535", 65535),
        ("listen_host", "::", "::"),
        ("listen_host", "127.0.0.1", "127.0.0.1"),
        ("relay", "[2001:db8::1]:4799", "[2001:db8::1]:4799"),
        ("relay", "relay.example.org", "relay.example.org"),  # the port defaults to 4799
        ("relay", "127.0.0.1", "127.0.0.1"),
        ("relay", "", ""),
        ("rendezvous_url", "https://registry.example.org", "https://registry.example.org"),
        ("job_cpus", "0", 0.0),
        ("job_cpus", "1.5", 1.5),
        ("job_cpus", "Auto", "auto"),
        ("job_memory", "auto", "auto"),
        ("share_memory", "auto", "auto"),
        ("share_memory", "12GB", "12GB"),
        ("share_memory", "none", "none"),
        ("share_memory", "0", "none"),
        ("max_jobs_per_peer", "0", 0),
        ("max_shells_per_peer", "3", 3),
        ("max_requests_per_link", "32", 32),
        ("link_buffer", "16MiB", "16MiB"),
        ("link_buffer", "unlimited", "none"),
        ("job_pids_limit", "0", 0),
        ("job_memory", " 8GiB ", "8GiB"),
        ("max_vram", "24GB", "24GB"),
        ("max_vram", "none", ""),
        ("max_vram", "unlimited", ""),
        ("max_vram", "0", ""),
    ],
)
def test_good_values_are_parsed(config: Config, key: str, value: str, expected: object) -> None:
    assert config.set(key, value) == expected
    assert config.get(key) == expected


@pytest.mark.parametrize("value", ["16GiB", "1234MB"])
def test_max_vram_keeps_the_size_that_was_set(config: Config, value: str) -> None:
    assert parse_size(str(config.set("max_vram", value))) == parse_size(value)


def test_invalid_value_in_the_file_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("listen_port = 0\n")
    with pytest.raises(ConfigError) as info:
        Config.load(path)
    assert str(path) in str(info.value)
    assert "listen_port" in str(info.value)


def test_broken_toml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("listen_port = = =\n")
    with pytest.raises(ConfigError, match="fix or delete the file"):
        Config.load(path)


def test_unknown_keys_in_the_file_are_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('listen_port = 1234\nfrom_the_future = "x"\n[section]\na = 1\n')
    assert Config.load(path).listen_port == 1234


@pytest.mark.parametrize(
    ("env", "key", "value"),
    [
        ("GPUMESH_RELAY", "relay", "env-relay.example.org:4799"),
        ("GPUMESH_IMAGE", "image", "ghcr.io/me/cuda:latest"),
        ("GPUMESH_REGION", "region", "eu-west"),
    ],
)
def test_environment_overrides_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str, key: str, value: str
) -> None:
    config = Config.load(tmp_path / "config.toml")
    config.set(key, "file.example.org:1" if key == "relay" else "from-file")
    config.save()
    monkeypatch.setenv(env, value)
    loaded = Config.load(tmp_path / "config.toml")
    assert loaded.get(key) == value
    assert loaded.source(key) == f"env {env}"


def test_empty_environment_variable_does_not_override(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    config.set("relay", "file.example.org:1")
    monkeypatch.setenv("GPUMESH_RELAY", "  ")
    assert config.relay == "file.example.org:1"
    assert config.source("relay") == "file"


def test_invalid_environment_value_is_refused(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUMESH_RELAY", "relay.example.org:http")
    with pytest.raises(ConfigError, match="1 to 65535"):
        config.get("relay")


def test_keys_without_env_ignore_similar_variables(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUMESH_LISTEN_PORT", "1")
    assert config.listen_port == DEFAULT_PORT


def test_relay_token_is_secret_and_listings_mask_it(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUMESH_RELAY_TOKEN", raising=False)
    assert [name for name, key in KEYS.items() if key.secret] == ["relay_token"]
    assert config.shown("relay_token") == ""
    config.set("relay_token", "s3cret-token")
    assert config.shown("relay_token") == MASK
    assert config.get("relay_token") == "s3cret-token"  # asked for by name: revealed
    monkeypatch.setenv("GPUMESH_RELAY_TOKEN", "from-env")
    assert config.shown("relay_token") == MASK
    assert config.shown("listen_port") == config.get("listen_port")


@pytest.mark.usefixtures("open_umask")
def test_saved_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    config = Config.load(path)
    config.set("relay_token", "s3cret-token")
    config.save()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    path.chmod(0o644)
    config.save()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_the_job_network_choices_are_the_runtimes_modes(config: Config) -> None:
    """The config names job_network's values itself (it must not load the runtime)."""
    for mode in MODES:
        config.set("job_network", mode)
        assert config.get("job_network") == mode
    with pytest.raises(ConfigError, match=", ".join(MODES)):
        config.set("job_network", "host")
