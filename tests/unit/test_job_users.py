"""runtime/users: who a job runs as inside its container and on the host; the
config keys that choose it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from gpumesh.errors import ConfigError
from gpumesh.runtime.base import EngineIsolation
from gpumesh.runtime.users import DEFAULT_JOB_ID, job_identity, parse_job_user
from gpumesh.store.config import KEYS, Config

PLAIN = EngineIsolation(userns_remap=False, rootless=False, remapped_root=None, storage_size=False)
REMAP = EngineIsolation(
    userns_remap=True, rootless=False, remapped_root=(100000, 100000), storage_size=False
)
ROOTLESS = EngineIsolation(
    userns_remap=False, rootless=True, remapped_root=None, storage_size=False
)
REMAP_UNKNOWN = EngineIsolation(
    userns_remap=True, rootless=False, remapped_root=None, storage_size=False
)
AGENT = (1000, 1000)


# --- parse_job_user -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("auto", None),
        (" auto ", None),
        ("1000", (1000, 1000)),
        ("1000:2000", (1000, 2000)),
        ("0", (0, 0)),
        ("0:0", (0, 0)),
        ("4294967294:4294967294", (4294967294, 4294967294)),
    ],
)
def test_parse_job_user(text: str, ids: tuple[int, int] | None) -> None:
    assert parse_job_user(text) == ids


@pytest.mark.parametrize(
    "text",
    ["", "root", "Auto", "1000:", ":1000", "-1", "1000:-1", "1.5", "1000:1000:1000",
     "4294967295", "1000:4294967295", "nobody:nogroup", "1000 1000"],
)  # fmt: skip
def test_parse_job_user_refuses(text: str) -> None:
    with pytest.raises(ConfigError, match=r"use auto, or numbers UID or UID:GID"):
        parse_job_user(text)


# --- job_identity: each rule ----------------------------------------------------------------


def test_auto_with_a_root_agent_runs_jobs_as_47000() -> None:
    assert DEFAULT_JOB_ID == 47000
    assert job_identity("auto", False, PLAIN, 0, 0) == ("47000:47000", (47000, 47000))


def test_auto_with_an_ordinary_agent_runs_jobs_as_the_agent() -> None:
    assert job_identity("auto", False, PLAIN, 1000, 1001) == ("1000:1001", (1000, 1001))


def test_userns_remap_runs_root_inside_as_the_remapped_root() -> None:
    assert job_identity("auto", False, REMAP, 0, 0) == ("0:0", (100000, 100000))
    assert job_identity("auto", True, REMAP, 0, 0) == ("0:0", (100000, 100000))
    # An explicit user is shifted by the same offset.
    assert job_identity("1000:1001", False, REMAP, 0, 0) == ("1000:1001", (101000, 101001))


def test_userns_remap_needs_a_root_agent_to_hand_over_the_workdir() -> None:
    with pytest.raises(ConfigError, match=r"uid 100000 .*agent \(uid 1000, not root\)") as caught:
        job_identity("auto", False, REMAP, *AGENT)
    assert "run `gpumesh share` as root, or switch Docker to rootless mode" in caught.value.message


def test_userns_remap_whose_mapping_cannot_be_told() -> None:
    with pytest.raises(ConfigError, match=r"docker info"):
        job_identity("auto", False, REMAP_UNKNOWN, 0, 0)


def test_rootless_runs_root_inside_as_the_agent() -> None:
    assert job_identity("auto", False, ROOTLESS, *AGENT) == ("0:0", AGENT)
    assert job_identity("auto", True, ROOTLESS, *AGENT) == ("0:0", AGENT)
    assert job_identity("0:0", False, ROOTLESS, *AGENT) == ("0:0", AGENT)


def test_rootless_with_a_root_agent_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"run `gpumesh share` as that user"):
        job_identity("auto", False, ROOTLESS, 0, 0)


def test_rootless_refuses_another_user() -> None:
    with pytest.raises(ConfigError, match=r"subordinate uid .*job_user auto"):
        job_identity("1000", False, ROOTLESS, *AGENT)


def test_job_root_without_remapping_is_root_on_the_host() -> None:
    assert job_identity("auto", True, PLAIN, 0, 0) == ("0:0", (0, 0))
    assert job_identity("0", True, PLAIN, 0, 0) == ("0:0", (0, 0))


def test_job_root_needs_a_root_agent() -> None:
    with pytest.raises(ConfigError, match=r"cannot give a job's workdir to root.*job_root off"):
        job_identity("auto", True, PLAIN, *AGENT)


def test_job_root_and_a_non_root_job_user_contradict() -> None:
    for isolation in (PLAIN, REMAP, ROOTLESS):
        with pytest.raises(ConfigError, match=r"contradict"):
            job_identity("1000", True, isolation, 0, 0)


def test_explicit_user_with_a_root_agent() -> None:
    assert job_identity("2000", False, PLAIN, 0, 0) == ("2000:2000", (2000, 2000))
    assert job_identity("2000:3000", False, PLAIN, 0, 0) == ("2000:3000", (2000, 3000))


def test_explicit_user_that_is_the_agent() -> None:
    assert job_identity("1000:1000", False, PLAIN, *AGENT) == ("1000:1000", AGENT)


@pytest.mark.parametrize("job_user", ["2000", "1000:2000", "2000:1000"])
def test_explicit_other_user_with_an_ordinary_agent_is_refused(job_user: str) -> None:
    with pytest.raises(ConfigError) as caught:
        job_identity(job_user, False, PLAIN, *AGENT)
    message = caught.value.message
    assert "cannot give a job's workdir to another user" in message  # why
    assert "`gpumesh config set job_user auto`" in message  # what to do
    assert "1000:1000" in message


def test_explicit_root_without_job_root_is_refused() -> None:
    for job_user in ("0", "0:0", "0:1000"):
        with pytest.raises(ConfigError, match=r"is root: to run jobs as root turn job_root on"):
            job_identity(job_user, False, PLAIN, 0, 0)


# --- job_identity: every combination keeps the rule -----------------------------------------

USERS = ["auto", "0", "0:0", "1000", "1000:1000", "2000:3000", "47000"]
ISOLATIONS = [PLAIN, REMAP, ROOTLESS]
AGENTS = [(0, 0), (1000, 1000), (47000, 47000)]


@pytest.mark.parametrize(
    ("job_user", "job_root", "isolation", "agent"),
    list(itertools.product(USERS, [False, True], ISOLATIONS, AGENTS)),
)
def test_every_combination_keeps_the_rules(
    job_user: str,
    job_root: bool,
    isolation: EngineIsolation,
    agent: tuple[int, int],
) -> None:
    try:
        inside, host = job_identity(job_user, job_root, isolation, *agent)
    except ConfigError as exc:
        assert exc.message and "\n" not in exc.message
        assert "`gpumesh" in exc.message or "docker info" in exc.message  # says what to do
        return
    uid, gid = (int(part) for part in inside.split(":"))
    # An agent that is not root can only give a workdir to itself.
    assert agent[0] == 0 or host == agent
    # Root on the host only when the provider asked for it.
    assert host[0] != 0 or job_root
    # Root inside only when asked for, or where the engine remaps it.
    assert uid != 0 or job_root or isolation.userns_remap or isolation.rootless
    if isolation.userns_remap:
        assert isolation.remapped_root is not None
        assert host == (isolation.remapped_root[0] + uid, isolation.remapped_root[1] + gid)
    elif isolation.rootless:
        assert (inside, host) == ("0:0", agent)
    else:
        assert host == (uid, gid)


# --- config keys ------------------------------------------------------------------------------


def test_job_keys_defaults(tmp_path: Path) -> None:
    config = Config.load(tmp_path / "config.toml")
    assert config.get("job_user") == "auto"
    assert config.get("job_root") == "off"
    assert config.get("job_tmp") == "1GB"
    assert config.get("job_shm") == "2GB"
    for name in ("job_user", "job_root", "job_tmp", "job_shm"):
        assert KEYS[name].help


def test_job_keys_are_validated(tmp_path: Path) -> None:
    config = Config.load(tmp_path / "config.toml")
    assert config.set("job_user", "1000:1000") == "1000:1000"
    assert config.set("job_user", " 47000 ") == "47000"
    assert config.set("job_user", "auto") == "auto"
    with pytest.raises(ConfigError, match="job_user"):
        config.set("job_user", "nobody")
    assert config.set("job_root", "on") == "on"
    with pytest.raises(ConfigError, match="on, off"):
        config.set("job_root", "yes")
    assert config.set("job_tmp", "4GiB") == "4GiB"
    assert config.set("job_shm", "512MB") == "512MB"
    for name in ("job_tmp", "job_shm"):
        with pytest.raises(ConfigError):
            config.set(name, "0")
        with pytest.raises(ConfigError):
            config.set(name, "lots")
