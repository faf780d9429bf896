"""The node process: one resident process per home that the CLI, the dashboard
and the Python API talk to over the home's control socket.

``record`` (who holds the home) and ``client`` (a stdlib HTTP client over the
unix socket, and starting a node process when none runs) import nothing heavy:
they are the thin CLI's whole path. ``process`` is the node process itself.
"""
