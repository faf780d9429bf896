"""``gpumesh-registry``: the public registry of signed GPU listings and address records.

A top of its own, like ``relay/``: it uses the protocol floor (the signed
records of :mod:`gpumesh.protocol.listing`) and nothing of the node. Modules:
``config`` (settings), ``store`` (SQLAlchemy Core: SQLite or PostgreSQL on
one code path), ``app`` (the Starlette routes), ``main`` (the console script).
All state lives in the database, so several registry processes can serve one
PostgreSQL.
"""
