"""Files: what both ends of a transfer do with bytes on disk and on a socket.

Packing a local folder into an exact-size tar and unpacking it safely on a
provider (``pack.py``), the sandbox a hostile job may change under us
(``sandbox.py``), hashing and chunked reads and writes (``hashing.py``,
``transfer.py``) and app manifests (``manifest.py``). Used by both the client
and the agent, so it sits below both; it knows nothing of peers or sessions.
The data channel that carries these bytes over TCP+TLS is
:mod:`gpumesh.transport.channel`.
"""
