"""The node process: one resident process per home that the CLI, the dashboard
and the Python API talk to over the home's control socket.

``record`` (who holds the home) and ``client`` (a stdlib HTTP client over the
unix socket, and starting a node process when none runs) import nothing heavy:
they are the thin CLI's whole path. ``process`` is the node process itself.
"""

from __future__ import annotations

__all__ = ["enabled"]


def enabled() -> bool:
    """Whether commands go through the node process: ``$GPUMESH_NODE`` is not
    ``off``, and the system has unix sockets (without them, as on Windows,
    commands stay in-process for now). Imports nothing a platform may lack."""
    from gpumesh import platform
    from gpumesh.settings import ENV_NODE, env

    value = (env(ENV_NODE) or "on").lower()
    return value not in ("off", "0", "false", "no") and platform.has("unix")
