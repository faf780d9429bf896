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
    from gpumesh.settings import ENV_NODE, env

    value = (env(ENV_NODE) or "on").lower()
    return value not in ("off", "0", "false", "no") and _has_unix()


def _has_unix() -> bool:
    """``platform.has("unix")``; answered here when it is a plain yes (a POSIX
    system, no simulated platform), since importing :mod:`gpumesh.platform`
    (logging, threading, its probes) costs a thin command milliseconds."""
    import socket
    import sys

    from gpumesh.settings import ENV_TEST_PLATFORM, ENV_TEST_WITHOUT, env

    simulated = env(ENV_TEST_PLATFORM) or env(ENV_TEST_WITHOUT)
    if not simulated and sys.platform != "win32" and hasattr(socket, "AF_UNIX"):
        return True
    from gpumesh import platform

    return platform.has("unix")
