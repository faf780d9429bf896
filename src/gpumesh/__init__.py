"""GPUMesh: share idle NVIDIA GPUs among people who trust each other.

The public Python API, in ``__all__``: :class:`Mesh`, one object for a home
with sync methods for scripts and ``a``-prefixed async twins, returning the
view structs ``--json`` prints, and its :class:`Job` handles (see
docs/python-api.md); under it, :class:`Node` (one node's home, pairing
and the allowlist, sessions with peers) and the client layer's operations as
functions taking a ``Node``: jobs (:func:`run_job`, :func:`watch_run` for a run
from submission to its end as events, :func:`logs` and
:func:`follow_job` for their events, :func:`cancel`), copies (:func:`copy`,
:func:`watch_copy`), apps (:func:`sync_app`, :func:`run_app`,
:func:`pull_job`), shells (:func:`exec_shell`) and groups; their typed results;
job states and roles; and the error tree of :mod:`gpumesh.errors`. The CLI
calls the same functions. Imports are lazy so ``gpumesh --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumesh.version import __version__

__all__ = [
    "FINAL_STATES",
    "AccessDeniedError",
    "AppRun",
    "ConnectResult",
    "CopyCallbacks",
    "CopyResult",
    "ExecSession",
    "GPUMeshError",
    "Job",
    "JobCallbacks",
    "JobEvent",
    "JobFollow",
    "JobResult",
    "JobRole",
    "JobSpec",
    "JobState",
    "Mesh",
    "Node",
    "NotFoundError",
    "Peer",
    "SyncResult",
    "UnreachableError",
    "__version__",
    "build_spec",
    "cancel",
    "copy",
    "create_group",
    "exec_shell",
    "find_job",
    "follow_job",
    "groups",
    "join_group",
    "logs",
    "members",
    "pull_job",
    "run_app",
    "run_job",
    "sync_app",
    "watch_copy",
    "watch_run",
]

if TYPE_CHECKING:
    from typing import Any

    from gpumesh.client.apps import AppRun, SyncResult, pull_job, run_app, sync_app
    from gpumesh.client.copies import watch_copy
    from gpumesh.client.exec import ExecSession, exec_shell
    from gpumesh.client.files import CopyCallbacks, CopyResult, copy
    from gpumesh.client.groups import create_group, groups, join_group, members
    from gpumesh.client.jobs import (
        JobCallbacks,
        JobEvent,
        JobFollow,
        JobResult,
        cancel,
        find_job,
        follow_job,
        logs,
        run_job,
    )
    from gpumesh.client.jobspec import JobSpec, build_spec
    from gpumesh.client.mesh import Job
    from gpumesh.client.node import ConnectResult, Node
    from gpumesh.client.runs import watch_run
    from gpumesh.daemon.mesh import Mesh
    from gpumesh.errors import AccessDeniedError, GPUMeshError, NotFoundError, UnreachableError
    from gpumesh.protocol.states import FINAL_STATES, JobRole, JobState
    from gpumesh.store.peers import Peer

_LAZY = {
    "Mesh": "gpumesh.daemon.mesh",
    "Job": "gpumesh.client.mesh",
    "Node": "gpumesh.client.node",
    "ConnectResult": "gpumesh.client.node",
    "Peer": "gpumesh.store.peers",
    "GPUMeshError": "gpumesh.errors",
    "AccessDeniedError": "gpumesh.errors",
    "NotFoundError": "gpumesh.errors",
    "UnreachableError": "gpumesh.errors",
    "FINAL_STATES": "gpumesh.protocol.states",
    "JobRole": "gpumesh.protocol.states",
    "JobState": "gpumesh.protocol.states",
    "JobCallbacks": "gpumesh.client.jobs",
    "JobEvent": "gpumesh.client.jobs",
    "JobFollow": "gpumesh.client.jobs",
    "JobResult": "gpumesh.client.jobs",
    "cancel": "gpumesh.client.jobs",
    "find_job": "gpumesh.client.jobs",
    "follow_job": "gpumesh.client.jobs",
    "logs": "gpumesh.client.jobs",
    "run_job": "gpumesh.client.jobs",
    "JobSpec": "gpumesh.client.jobspec",
    "build_spec": "gpumesh.client.jobspec",
    "CopyCallbacks": "gpumesh.client.files",
    "CopyResult": "gpumesh.client.files",
    "copy": "gpumesh.client.files",
    "watch_copy": "gpumesh.client.copies",
    "watch_run": "gpumesh.client.runs",
    "AppRun": "gpumesh.client.apps",
    "SyncResult": "gpumesh.client.apps",
    "pull_job": "gpumesh.client.apps",
    "run_app": "gpumesh.client.apps",
    "sync_app": "gpumesh.client.apps",
    "ExecSession": "gpumesh.client.exec",
    "exec_shell": "gpumesh.client.exec",
    "create_group": "gpumesh.client.groups",
    "groups": "gpumesh.client.groups",
    "join_group": "gpumesh.client.groups",
    "members": "gpumesh.client.groups",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpumesh' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
