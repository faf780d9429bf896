"""The shape of a container: what a spec may ask for, and what of the image it
keeps.

:func:`check_spec` refuses a spec outside the lockdown (a network that is not
ours, a host folder that is not a plain directory, missing labels, ...).
Docker merges the image's labels, ENV and VOLUME lines into a container and
can only override them, never drop them: :func:`container_env`,
:func:`container_labels` and :func:`tmpfs_mounts` give the overrides (empty
labels and ``NVIDIA_*`` variables, a tmpfs at each VOLUME path), so nothing of
the image widens GPU access or lands on the host's disk. No I/O here but the
checks that a host folder exists.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

from gpumesh.errors import ConfigError
from gpumesh.runtime.base import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_KIND,
    LABEL_NODE,
    LABEL_PEER,
    MAX_MOUNTS,
    SYSTEM_PATHS,
    WORKDIR_MOUNT,
    ContainerSpec,
    mount_target_problem,
)
from gpumesh.runtime.jobnet import is_job_network

__all__ = ["LOG_CONFIG", "check_spec", "container_env", "container_labels", "tmpfs_mounts"]

# The "local" log driver stores entries as bytes (json-file turns invalid
# UTF-8 into U+FFFD), works whatever the daemon's default driver is, and is
# bounded: 5 files of 20 MB per container. Rotated files stay uncompressed: a
# reader that fell behind reads them from its cursor, and a compressed one would
# be decompressed again for each such read.
LOG_CONFIG = {"max-size": "20m", "max-file": "5", "compress": "false"}

_REQUIRED_LABELS = (LABEL_JOB, LABEL_PEER, LABEL_NODE, LABEL_ATTEMPT)
_INTERACTIVE_LABELS = (LABEL_PEER, LABEL_NODE, LABEL_KIND)

# Docker's --tmpfs defaults to noexec, which breaks whatever loads compiled
# code from /tmp or ~/.cache (Triton, torch.compile, pip builds); nosuid and
# nodev keep a tmpfs from becoming a way up.
_TMPFS_OPTIONS = "rw,exec,nosuid,nodev"
# Given with GPUs: what CUDA programs need, not graphics, video or display.
_DRIVER_CAPABILITIES = "compute,utility"
_USER_IDS = re.compile(r"(\d+):(\d+)")


def check_spec(spec: ContainerSpec, *, interactive: bool) -> None:
    """Refuse ``spec`` (ConfigError, saying what is wrong) unless it fits the
    lockdown; ``interactive``: a shell's container, which gets no host folder."""
    if spec.network not in ("bridge", "none") and not is_job_network(spec.network):
        raise ConfigError(
            f"network {spec.network!r} is not allowed: use bridge, none or a job network"
        )
    if spec.dns and not is_job_network(spec.network):
        raise ConfigError("name servers are given only to containers on a job network")
    if spec.memory <= 0:
        raise ConfigError(f"memory limit must be a positive number of bytes, not {spec.memory}")
    for what, size in (("/tmp", spec.tmp_size), ("/dev/shm", spec.shm_size)):
        if size <= 0:
            raise ConfigError(f"{what} size must be a positive number of bytes, not {size}")
    if spec.storage_size < 0:
        raise ConfigError(f"storage size must be 0 (none) or more, not {spec.storage_size}")
    if spec.user is not None and _USER_IDS.fullmatch(spec.user) is None:
        raise ConfigError(f"container user {spec.user!r} is not UID:GID (two numbers)")
    home = spec.home
    if (
        not home.startswith("/")
        or posixpath.normpath(home) != home
        or home in ("/", "/tmp", "/dev/shm", WORKDIR_MOUNT)
        or home.startswith(tuple(f"{path}/" for path in SYSTEM_PATHS))
        or ":" in home
        or "," in home
    ):
        raise ConfigError(
            f"container home {home!r} must be a plain absolute path of its own "
            "(not /, /tmp, /dev/shm, /workspace or under /proc, /sys, /dev)"
        )
    if spec.pids_limit < 0:
        raise ConfigError(f"process limit must be 0 (default) or more, not {spec.pids_limit}")
    if spec.cpus < 0:
        raise ConfigError(f"CPU limit must be 0 (none) or more, not {spec.cpus:g}")
    required = _INTERACTIVE_LABELS if interactive else _REQUIRED_LABELS
    missing = [label for label in required if label not in spec.labels]
    if missing:
        raise ConfigError(f"container {spec.name!r} lacks the labels {', '.join(missing)}")
    for key in spec.env:
        if not key or "=" in key or "\0" in key:
            raise ConfigError(f"environment variable name {key!r} is not valid")
    if interactive and (spec.workdir is not None or spec.mounts):
        raise ConfigError("an interactive container gets no host folder")
    if spec.workdir is not None:
        workdir = spec.workdir
        if not os.path.isabs(workdir) or not os.path.isdir(workdir):
            raise ConfigError(
                f"job workdir {workdir!r} is not an existing absolute directory on this machine"
            )
        if ":" in workdir or "," in workdir:
            # Docker's bind syntax splits on these.
            raise ConfigError(f"job workdir {workdir!r} must not contain ':' or ','")
    if interactive and spec.mounts:
        raise ConfigError("an interactive container gets no host folder")
    if len(spec.mounts) > MAX_MOUNTS:
        raise ConfigError(f"a job may mount at most {MAX_MOUNTS} folders")
    targets: list[str] = []
    for mount in spec.mounts:
        if not os.path.isabs(mount.source) or not os.path.isdir(mount.source):
            raise ConfigError(f"mount {mount.source!r} is not an existing absolute directory")
        problem = mount_target_problem(mount.target, targets, below_workdir=mount.below_workdir)
        if problem is not None:
            raise ConfigError(f"mount target {mount.target!r} {problem}")
        targets.append(mount.target)


def container_env(spec: ContainerSpec, image_env: list[str] | None) -> dict[str, str]:
    """The variables to set: the spec's, HOME, and over the image's ``NVIDIA_*``."""
    env = dict(spec.env)
    env.setdefault("HOME", spec.home)
    for entry in image_env or []:
        key = entry.partition("=")[0]
        # e.g. NVIDIA_DRIVER_CAPABILITIES=all (graphics, video, display) in an
        # image; empty is as if the image never set it.
        if key.startswith("NVIDIA_") and key not in env:
            env[key] = ""
    # Set last so neither the job's env nor the image's ENV can widen GPU
    # access: "void" hides every GPU from the NVIDIA runtime.
    env["NVIDIA_VISIBLE_DEVICES"] = ",".join(spec.gpu_ids) if spec.gpu_ids else "void"
    env["NVIDIA_DRIVER_CAPABILITIES"] = _DRIVER_CAPABILITIES if spec.gpu_ids else ""
    return env


def container_labels(spec: ContainerSpec, image_labels: dict[str, str] | None) -> dict[str, str]:
    """The spec's labels, and an empty value over each other label of the image
    (which readers treat as absent: see :func:`~gpumesh.runtime.states.container_state`)."""
    labels = {key: "" for key in image_labels or {}}
    labels.update(spec.labels)
    return labels


def tmpfs_mounts(spec: ContainerSpec, volumes: dict[str, Any] | None) -> dict[str, str]:
    """Docker's ``Tmpfs``: /tmp, the home, and each VOLUME path of the image.

    A tmpfs at a VOLUME path stops Docker from making an anonymous volume
    there (on the host's disk, outside every limit); what the image has under
    that path is hidden, as with ``--tmpfs``.

    Docker gives a tmpfs the mode of the image's own directory under it, not
    ours: on an image whose ``/tmp`` is ``0755 root`` (one made with ``docker
    import``) the job's user could not write its ``/tmp``. So when the job's
    uid is known, /tmp and the VOLUME paths belong to it too."""
    options = f"{_TMPFS_OPTIONS},size={spec.tmp_size}"
    match = _USER_IDS.fullmatch(spec.user or "")
    if match is not None:
        uid, gid = match.groups()
        shared = f"{options},uid={uid},gid={gid},mode=1777"
        tmpfs = {"/tmp": shared, spec.home: f"{options},uid={uid},gid={gid},mode=0700"}
    else:
        shared = f"{options},mode=1777"  # the image's user: its uid is not known here
        tmpfs = {"/tmp": shared, spec.home: shared}
    taken = {"/", "/dev/shm", *tmpfs}
    if spec.workdir is not None:
        taken.add(WORKDIR_MOUNT)  # the bind mount already stands there
    mounted = tuple(m.target for m in spec.mounts)
    for volume in volumes or {}:
        # Docker compares the cleaned path with the Tmpfs keys.
        path = posixpath.normpath("/" + volume.lstrip("/"))
        if path not in taken and not any(path == m or path.startswith(m + "/") for m in mounted):
            tmpfs[path] = shared
    return tmpfs
