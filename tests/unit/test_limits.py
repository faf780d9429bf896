"""store/limits: defaults worked out from given machine sizes; agent/limits: the admission rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.agent.limits import Admission, Claim, Kind, check_admission
from gpumesh.errors import LimitError
from gpumesh.store.config import Config
from gpumesh.store.limits import (
    MachineSize,
    ShareLimits,
    default_job_cpus,
    default_job_memory,
    default_share_memory,
    machine_size,
)

MB = 1000**2
GB = 1000**3


@pytest.mark.parametrize(
    ("cpus", "expected"), [(1, 1.0), (2, 1.0), (4, 3.0), (16, 15.0), (64, 63.0)]
)
def test_jobs_get_every_core_but_one_and_at_least_one(cpus: int, expected: float) -> None:
    assert default_job_cpus(MachineSize(cpus=cpus, memory=8 * GB)) == expected


@pytest.mark.parametrize(
    ("memory", "shared"),
    [
        (128 * GB, 96 * GB),  # a quarter stays the owner's
        (24 * GB, 18 * GB),
        (8 * GB, 6 * GB),  # 2GB stays the owner's
        (4 * GB, 2 * GB),
        (2 * GB, 500 * MB),  # a small machine still shares a quarter
        (0, 0),  # memory unknown: no cap
    ],
)
def test_the_owner_keeps_the_larger_of_2gb_and_a_quarter(memory: int, shared: int) -> None:
    assert default_share_memory(MachineSize(cpus=4, memory=memory)) == shared


@pytest.mark.parametrize(
    ("shared", "job"),
    [
        (96 * GB, 12 * GB),
        (18 * GB, 2250 * MB),
        (6 * GB, 750 * MB),
        (2 * GB, 256 * MB),  # never below 256MB...
        (100 * MB, 100 * MB),  # ...unless less than that is shared at all
        (0, 4 * GB),  # memory unknown
    ],
)
def test_a_job_gets_an_eighth_of_what_is_shared(shared: int, job: int) -> None:
    assert default_job_memory(shared) == job


def test_this_machine_is_measured() -> None:
    machine = machine_size()
    assert machine.cpus >= 1
    assert machine.memory > 256 * MB  # Linux: os.sysconf


def _config(tmp_path: Path, **values: str) -> Config:
    config = Config.load(tmp_path / "config.toml")
    for key, value in values.items():
        config.set(key, value)
    return config


def test_defaults_of_a_24gb_two_core_host(tmp_path: Path) -> None:
    limits = ShareLimits.from_config(_config(tmp_path), MachineSize(cpus=2, memory=24 * GB))
    assert limits == ShareLimits(
        job_cpus=1.0,
        job_memory=2250 * MB,
        share_memory=18 * GB,
        max_jobs_per_peer=4,
        max_shells_per_peer=2,
        max_links_per_peer=8,
        max_requests_per_link=16,
        link_buffer=32 * MB,
    )
    assert limits.describe() == (
        "containers 2.2GB memory and 1 CPU each, 18GB memory in all; per peer 4 jobs, "
        "2 shells and 8 connections; per connection 16 requests and 32MB held"
    )


def test_set_values_win_and_zero_or_none_switch_a_limit_off(tmp_path: Path) -> None:
    machine = MachineSize(cpus=8, memory=64 * GB)
    config = _config(
        tmp_path,
        job_cpus="0",
        job_memory="4GB",
        share_memory="none",
        max_jobs_per_peer="0",
        max_shells_per_peer="0",
        max_links_per_peer="0",
        max_requests_per_link="0",
        link_buffer="none",
    )
    limits = ShareLimits.from_config(config, machine)
    assert limits == ShareLimits(0.0, 4 * GB, 0, 0, 0, 0, 0, 0)
    assert limits.describe() == (
        "containers 4GB memory and no CPU limit each, no limit memory in all; per peer "
        "no limit jobs, no limit shells and no limit connections; per connection no limit "
        "requests and no limit held"
    )
    # job_memory auto without a share_memory cap: an eighth of what the machine would share.
    config.set("job_memory", "auto")
    assert ShareLimits.from_config(config, machine).job_memory == 6 * GB
    config.set("share_memory", "16GB")
    assert ShareLimits.from_config(config, machine).job_memory == 2 * GB


LIMITS = ShareLimits(
    job_cpus=1.0,
    job_memory=2250 * MB,
    share_memory=18 * GB,
    max_jobs_per_peer=4,
    max_shells_per_peer=2,
    max_links_per_peer=8,
    max_requests_per_link=16,
    link_buffer=32 * MB,
)


def _admit(kind: Kind, peer: str, claims: list[Claim], limits: ShareLimits = LIMITS) -> None:
    check_admission(kind, peer, claims, limits, "alice")
    claims.append(Claim(peer, kind, limits.job_memory))


def test_one_peer_at_its_limits_leaves_room_for_another() -> None:
    # The reported case: a 24GB, 2-core host took 12 jobs and 6 shells of 16GB.
    claims: list[Claim] = []
    for _ in range(4):
        _admit(Kind.JOB, "bob", claims)
    with pytest.raises(
        LimitError,
        match=r"^alice refused the job: you have 4 unfinished jobs there, and its "
        r"max_jobs_per_peer is 4; wait for one to end, or cancel one$",
    ):
        _admit(Kind.JOB, "bob", claims)
    for _ in range(2):
        _admit(Kind.SHELL, "bob", claims)
    with pytest.raises(
        LimitError,
        match=r"^alice refused the shell: you have 2 shells open there, and its "
        r"max_shells_per_peer is 2; close one first$",
    ):
        _admit(Kind.SHELL, "bob", claims)
    # bob holds 6/8 of what is shared: carol still runs two containers.
    _admit(Kind.JOB, "carol", claims)
    _admit(Kind.SHELL, "carol", claims)
    with pytest.raises(
        LimitError,
        match=r"^alice refused the job: 18GB of memory is promised to its running jobs, "
        r"shells and CUDA sessions, and this job's 2.2GB \(job_memory\) would go over its "
        r"share_memory of 18GB; try again when one of them ends$",
    ):
        _admit(Kind.JOB, "carol", claims)
    assert len(claims) == 8


def test_without_limits_everything_is_admitted() -> None:
    unlimited = ShareLimits(0.0, 16 * GB, 0, 0, 0, 0, 0, 0)
    claims: list[Claim] = []
    for _ in range(50):
        _admit(Kind.JOB, "bob", claims, unlimited)
        _admit(Kind.SHELL, "bob", claims, unlimited)


def test_a_shell_is_held_while_its_block_runs() -> None:
    jobs = [Claim("bob", Kind.JOB, LIMITS.job_memory)]
    admission = Admission(lambda: LIMITS, lambda limits: list(jobs), "alice")
    with admission.shell("bob"), admission.shell("bob"):
        assert [claim.kind for claim in admission.claims()] == [Kind.JOB, Kind.SHELL, Kind.SHELL]
        with pytest.raises(LimitError, match="max_shells_per_peer is 2"), admission.shell("bob"):
            pass
        with admission.shell("carol"):
            assert len(admission.claims()) == 4
    with pytest.raises(RuntimeError), admission.shell("bob"):
        raise RuntimeError("the session failed")
    assert admission.claims() == jobs  # released either way
    jobs.extend(Claim("bob", Kind.JOB, LIMITS.job_memory) for _ in range(3))
    with pytest.raises(LimitError, match="you have 4 unfinished jobs"):
        admission.admit_job("bob")
    admission.admit_job("carol")
