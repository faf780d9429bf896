"""Runtime: where jobs run. A small interface (``base``) and its Docker
implementation (``docker``), through the Docker Engine API, never the CLI.

Below the agent; knows nothing about peers, the wire or the store.
"""

from gpumesh.runtime.base import (
    ContainerSpec,
    ContainerState,
    EngineIsolation,
    JobRuntime,
    LogCursor,
    LogLine,
)
from gpumesh.runtime.users import job_identity

__all__ = [
    "ContainerSpec",
    "ContainerState",
    "EngineIsolation",
    "JobRuntime",
    "LogCursor",
    "LogLine",
    "job_identity",
]
