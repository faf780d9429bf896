"""The node process: one resident process per home that the CLI, the dashboard
and the Python API talk to over the home's control socket.

``record`` (who holds the home) and ``client`` (a stdlib HTTP client over the
unix socket, and starting a node process when none runs) import nothing heavy:
they are the thin CLI's whole path. ``process`` is the node process itself.
"""

from __future__ import annotations

__all__ = ["setting_gone"]


def setting_gone() -> None:
    """Say once, on stderr, that ``$GPUMESH_NODE=off`` is gone (it kept commands
    in-process); the variable is taken out of this process's environment so that
    neither a second look nor a node process it starts says it again. Imports
    nothing heavy: every command calls it before anything else."""
    import os

    if "GPUMESH_NODE" not in os.environ:  # settings.ENV_NODE, without loading settings
        return
    import sys

    from gpumesh.settings import ENV_NODE

    value = os.environ.pop(ENV_NODE)
    if value.lower() in ("off", "0", "false", "no"):
        sys.stderr.write(
            f"gpumesh: {ENV_NODE}={value} is gone and changes nothing: every command goes "
            "through the node process (in Python, gpumesh.Mesh(in_process=True) runs "
            "the client layer in your own process)\n"
        )
