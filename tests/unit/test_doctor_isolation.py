"""client/doctor: the job isolation, job storage and agent user checks, without Docker."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from gpumesh.client.doctor import (
    FAIL,
    OK,
    WARN,
    _agent_user,
    _describe_agent_user,
    _describe_isolation,
    _describe_storage,
    _process_ids,
    _status_ids,
)
from gpumesh.runtime.base import EngineIsolation
from gpumesh.store.home import AgentInfo, Home

PLAIN = EngineIsolation(userns_remap=False, rootless=False, remapped_root=None, storage_size=False)
REMAP = EngineIsolation(
    userns_remap=True, rootless=False, remapped_root=(100000, 100000), storage_size=False
)
ROOTLESS = EngineIsolation(
    userns_remap=False, rootless=True, remapped_root=None, storage_size=False
)
GB = 1000**3


def test_isolation_plain_docker() -> None:
    check = _describe_isolation(PLAIN, "auto", False, 0, 0)
    assert (check.name, check.status) == ("job isolation", OK)
    assert check.detail.startswith("jobs run as uid 47000 inside containers, not root")
    assert "\n" not in check.detail
    assert _describe_isolation(PLAIN, "auto", False, 1000, 1000).detail.startswith(
        "jobs run as uid 1000 inside"
    )


def test_isolation_remapped_and_rootless() -> None:
    check = _describe_isolation(REMAP, "auto", False, 0, 0)
    assert check.status == OK
    assert "userns-remap" in check.detail and "uid 100000" in check.detail
    assert check.detail.endswith("jobs run as root inside")
    check = _describe_isolation(ROOTLESS, "auto", False, 1000, 1000)
    assert check.status == OK
    assert "rootless Docker" in check.detail and "uid 1000" in check.detail


def test_isolation_job_root_warns_loudly() -> None:
    check = _describe_isolation(PLAIN, "auto", True, 0, 0)
    assert check.status == WARN
    assert "ROOT" in check.detail and "share this machine's kernel" in check.detail
    assert "writable root filesystem" in check.detail
    assert check.fix.startswith("gpumesh config set job_root off")
    remapped = _describe_isolation(REMAP, "auto", True, 0, 0)
    assert remapped.status == WARN and "uid 100000" in remapped.detail


def test_isolation_settings_that_cannot_work_fail() -> None:
    check = _describe_isolation(PLAIN, "2000", False, 1000, 1000)
    assert check.status == FAIL
    assert "job_user auto" in check.detail


def test_storage_read_only() -> None:
    check = _describe_storage(False, None, GB, 2 * GB, 16 * GB)
    assert (check.name, check.status) == ("job storage", OK)
    assert check.detail.startswith("read-only root filesystem; /tmp and HOME 1GB tmpfs each")
    assert "/dev/shm 2GB" in check.detail and "job_memory 16GB" in check.detail
    # /dev/shm is clamped to the memory limit, and says so.
    assert "/dev/shm 1GB" in _describe_storage(False, None, GB, 4 * GB, GB).detail


def test_storage_writable_root() -> None:
    limited = _describe_storage(True, True, GB, 2 * GB, 16 * GB)
    assert limited.status == OK and "can size-limit" in limited.detail
    unlimited = _describe_storage(True, False, GB, 2 * GB, 16 * GB)
    assert unlimited.status == WARN and "cannot size-limit" in unlimited.detail
    assert "xfs" in unlimited.fix and "job_root off" in unlimited.fix
    unknown = _describe_storage(True, None, GB, 2 * GB, 16 * GB)
    assert unknown.status == WARN and "not known" in unknown.detail


def test_agent_user() -> None:
    fix = "run `gpumesh share` as a user in the docker group, or use rootless Docker"
    running_root = _describe_agent_user(1000, 4242, 0)
    assert running_root.status == WARN
    assert "`gpumesh share` (pid 4242) runs as root" in running_root.detail
    assert running_root.fix == fix
    assert _describe_agent_user(0, 4242, 1000).status == OK  # the agent counts, not doctor
    assert "uid 1000" in _describe_agent_user(0, 4242, 1000).detail
    doctor_root = _describe_agent_user(0, None, None)
    assert doctor_root.status == WARN and doctor_root.fix == fix
    assert _describe_agent_user(1000, None, None).status == OK


def test_status_ids() -> None:
    text = "Name:\tgpumesh\nUid:\t1000\t1001\t1001\t1001\nGid:\t100\t101\t101\t101\nGroups:\t27\n"
    assert _status_ids(text) == (1001, 101)  # effective ids
    assert _status_ids("Name:\tx\nUid:\t0\t0\t0\t0\n") is None
    assert _status_ids("") is None
    assert _process_ids(os.getpid()) == (os.geteuid(), os.getegid())
    assert _process_ids(2**22 + 1) is None  # above pid_max's ceiling: never a process


def test_agent_user_reads_a_running_agent(tmp_path: Path) -> None:
    home = Home(tmp_path)
    home.key_path.write_text("")  # an initialized home is all this check asks for
    info = AgentInfo(pid=os.getpid(), host="127.0.0.1", port=1, started=0.0)
    running = SimpleNamespace(info=lambda: info)
    home.attach_agent(running)  # type: ignore[arg-type]
    try:
        check = _agent_user(home)
    finally:
        home.detach_agent(running)  # type: ignore[arg-type]
    assert check.detail.startswith(f"`gpumesh share` (pid {os.getpid()}) runs as ")
    assert check.status == (WARN if os.geteuid() == 0 else OK)
