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
    ``off``, and the system can lock a home the way the node process does (an
    ``flock``, or ``msvcrt.locking`` on Windows: :func:`gpumesh.daemon.record.can_lock`).
    Without unix sockets the CLI reaches it on loopback TCP with the home's
    token. Imports nothing a platform may lack."""
    from importlib.util import find_spec

    from gpumesh.settings import ENV_NODE, env

    value = (env(ENV_NODE) or "on").lower()
    if value in ("off", "0", "false", "no"):
        return False
    return find_spec("fcntl") is not None or find_spec("msvcrt") is not None  # as can_lock
