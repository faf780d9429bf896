"""Who a job runs as: inside its container, and on the host.

A pure decision from the provider's settings (``job_user``, ``job_root``), what
the engine does with users (:class:`~gpumesh.runtime.base.EngineIsolation`) and
the agent's own ids. The rule it keeps: root inside a job is never root on the
host unless the provider turned ``job_root`` on, and a job only gets a workdir
the agent can actually hand over to it (an agent that is not root can give
files to nobody but itself).

No I/O here: the caller passes the engine's answers and ``os.getuid()``.
"""

from __future__ import annotations

import re

from gpumesh.errors import ConfigError
from gpumesh.runtime.base import EngineIsolation

__all__ = ["DEFAULT_JOB_ID", "job_identity", "parse_job_user"]

DEFAULT_JOB_ID = 47000
"""uid and gid of jobs when the agent runs as root and Docker does not remap
users: an id no ordinary account on the host is likely to have."""

_MAX_ID = 2**32 - 2  # (uid_t)-1 means "no change" to the kernel
_USER = re.compile(r"(\d+)(?::(\d+))?")


def parse_job_user(text: str) -> tuple[int, int] | None:
    """``auto`` -> None; ``UID`` -> (UID, UID); ``UID:GID`` -> (UID, GID)."""
    text = text.strip()
    if text == "auto":
        return None
    match = _USER.fullmatch(text)
    if match is not None:
        uid = int(match.group(1))
        gid = int(match.group(2) or match.group(1))
        if uid <= _MAX_ID and gid <= _MAX_ID:
            return uid, gid
    raise ConfigError(
        f"invalid job_user {text!r}: use auto, or numbers UID or UID:GID such as 1000:1000"
    )


def job_identity(
    job_user: str,
    job_root: bool,
    isolation: EngineIsolation,
    agent_uid: int,
    agent_gid: int,
) -> tuple[str, tuple[int, int]]:
    """``(container user "UID:GID", host (uid, gid) that must own the job's files)``.

    - ``auto``, Docker without user remapping: the agent's own ids, or
      47000:47000 when the agent runs as root.
    - ``userns-remap``: root inside (``0:0``), which is ``remapped_root`` on the
      host; an explicit ``job_user`` is shifted by the same offset.
    - rootless Docker: root inside, which is the agent's own user on the host
      (the agent must run as the user who runs that Docker, never as root).
    - ``job_root`` on without remapping: root inside and on the host.

    Raises ConfigError, saying why and what to change, when the settings
    contradict each other or the agent could not give a job's workdir to the
    host user it would run as.
    """
    wanted = parse_job_user(job_user)
    if job_root and wanted is not None and wanted[0] != 0:
        raise ConfigError(
            f"job_user {job_user} and job_root on contradict each other (job_root runs jobs "
            "as root): `gpumesh config set job_user auto`, or turn job_root off"
        )
    agent = (agent_uid, agent_gid)
    if isolation.userns_remap:
        base = isolation.remapped_root
        if base is None:
            raise ConfigError(
                "Docker remaps users (userns-remap) but its data root does not say to which "
                "host uid: check `docker info` (Docker Root Dir should end in /UID.GID)"
            )
        inside = wanted or (0, 0)
        host = (base[0] + inside[0], base[1] + inside[1])
        if agent_uid != 0 and host != agent:
            raise ConfigError(
                f"Docker remaps users (userns-remap): a job's files belong to uid "
                f"{host[0]} on this machine, and the agent (uid {agent_uid}, not root) cannot "
                "give a job's workdir to that uid: run `gpumesh share` as root, or switch "
                "Docker to rootless mode"
            )
        return _text(inside), host
    if isolation.rootless:
        if agent_uid == 0:
            raise ConfigError(
                "the agent runs as root but Docker is rootless: root in a job is the user who "
                "runs that Docker, not root, and the agent cannot tell who that is: run "
                "`gpumesh share` as that user"
            )
        if wanted is not None and wanted != (0, 0):
            raise ConfigError(
                f"under rootless Docker only root in a container is you on this machine; "
                f"job_user {job_user} would be a subordinate uid the agent cannot give a "
                "workdir to: `gpumesh config set job_user auto`"
            )
        return "0:0", agent
    if job_root:
        if agent_uid != 0:
            raise ConfigError(
                f"job_root runs jobs as root, but the agent (uid {agent_uid}, not root) cannot "
                "give a job's workdir to root: `gpumesh config set job_root off`"
            )
        return "0:0", (0, 0)
    if wanted is None:
        inside = (DEFAULT_JOB_ID, DEFAULT_JOB_ID) if agent_uid == 0 else agent
        return _text(inside), inside
    if wanted[0] == 0:
        raise ConfigError(
            f"job_user {job_user} is root: to run jobs as root turn job_root on (and read "
            "what `gpumesh doctor` says about it), or `gpumesh config set job_user auto`"
        )
    if agent_uid != 0 and wanted != agent:
        raise ConfigError(
            f"job_user {job_user} is not the agent's own user ({agent_uid}:{agent_gid}), and "
            "the agent, not being root, cannot give a job's workdir to another user: "
            f"`gpumesh config set job_user auto` (jobs then run as {agent_uid}:{agent_gid}), "
            "or run `gpumesh share` as that user"
        )
    return _text(wanted), wanted


def _text(ids: tuple[int, int]) -> str:
    return f"{ids[0]}:{ids[1]}"
