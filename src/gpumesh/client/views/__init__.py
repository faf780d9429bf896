"""View structs: what the CLI prints with ``--json`` and what the control API returns.

One struct per shape, built from the client layer's typed results; the CLI
serialises them with :func:`to_json` and never builds a dictionary by hand, so
the machine-readable output of a command and of the API cannot drift apart.
Modules here are grouped by area (jobs, files, peers, groups, node).
"""
