"""What the CUDA worker may do: who it runs as, its privileges, the memory it may map.

The agent decides (:func:`worker_ids`, the session's memory) and passes the
answer on the worker's command line, with a clean environment; the worker
applies it to itself (:func:`confine`) once its device is open and before it
reads the first call, so nothing a peer sends runs with more:

* no new privileges (``PR_SET_NO_NEW_PRIVS``): nothing it executes gains any
  through set-user-id bits or file capabilities;
* when the agent runs as root, ``job_user``'s uid and gid with no
  supplementary groups (never root, never the docker group);
* on the host-memory fallback, an address-space ceiling (``RLIMIT_AS``) of
  what it has mapped at that point plus the session's memory plus
  :data:`HEADROOM`: a session cannot take more of the machine than it was
  promised, whatever its calls. The driver backend gets none: the CUDA driver
  reserves address space far beyond what it uses, and the device, not host
  memory, holds a session's allocations there. What a driver worker holds in
  host memory is bounded by how it works instead: every size is checked
  against the session's allocations first, uploads arrive in chunks of 1 MiB
  written to the device one by one, and a device-to-host copy is read out a
  piece at a time as it is sent (``DriverBackend.read``), at most 32 MiB of it
  waiting for the pipe.

Linux only, like sharing. Everything here but :func:`confine` and
:func:`mapped_now` is pure.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

from gpumesh.runtime.users import DEFAULT_JOB_ID, parse_job_user

__all__ = [
    "HEADROOM",
    "Confinement",
    "address_space_ceiling",
    "confine",
    "mapped_now",
    "worker_ids",
]

HEADROOM = 64 * 1024 * 1024
"""Address space the fallback worker may map beyond its session's memory: the
read buffer, call bodies (at most 8 MiB), a kernel's chunk, the allocator's slack."""
_PR_SET_NO_NEW_PRIVS = 38


@dataclass(frozen=True)
class Confinement:
    """What :func:`confine` applies to the worker."""

    ids: tuple[int, int] | None
    """uid and gid to run as; None: stay the agent's user."""
    address_space: int
    """RLIMIT_AS in bytes; 0: none."""


def worker_ids(job_user: str, agent_uid: int) -> tuple[int, int] | None:
    """Who a CUDA worker runs as: ``job_user``'s ids when the agent is root (its
    ``auto``, and root itself, mean 47000:47000: a worker never runs as root),
    None (the agent's own user) when it is not, since then it cannot switch."""
    if agent_uid != 0:
        return None
    wanted = parse_job_user(job_user)
    if wanted is None or wanted[0] == 0:
        return DEFAULT_JOB_ID, DEFAULT_JOB_ID
    return wanted


def address_space_ceiling(mapped: int, memory: int) -> int:
    """RLIMIT_AS for a fallback worker that has ``mapped`` bytes mapped and holds
    ``memory`` bytes of device memory in host memory."""
    return mapped + memory + HEADROOM


def mapped_now() -> int:
    """Bytes of address space this process has mapped (``VmSize``); 0 when unknown."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@functools.cache
def _prctl() -> ctypes._FuncPointer:
    return ctypes.CDLL(None, use_errno=True).prctl


def confine(confinement: Confinement) -> None:
    """Apply ``confinement`` to this process (OSError when the kernel refuses any part:
    the worker then ends rather than run unconfined)."""
    # Imported here, not at the top: the agent imports this module on systems
    # without it; and before the switch of user, who may not be able to read
    # this Python's files.
    import resource

    if _prctl()(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(errno)}")
    if confinement.ids is not None:
        uid, gid = confinement.ids
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid, uid, uid) or os.getgroups():
            raise OSError(f"could not become uid {uid} without supplementary groups")
    if confinement.address_space:
        limit = confinement.address_space
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
