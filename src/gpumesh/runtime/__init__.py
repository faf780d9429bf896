"""Runtime: where jobs run. A small interface (``base``) and its Docker
implementation (``docker``), through the Docker Engine API, never the CLI.

Below the agent; knows nothing about peers, the wire or the store.
"""

from gpumesh.runtime.base import (
    ContainerSpec,
    ContainerState,
    JobRuntime,
    LogCursor,
    LogLine,
)

__all__ = ["ContainerSpec", "ContainerState", "JobRuntime", "LogCursor", "LogLine"]
