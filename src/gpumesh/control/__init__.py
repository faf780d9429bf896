"""Control: the local HTTP API over this node's home (``gpumesh-control``).

``app.py`` holds the routes (thin: parse, call ``gpumesh.client``, return the
view structs of ``gpumesh.client.views``), ``auth.py`` who may call them,
``openapi.py`` the document that lists them, ``server.py`` the sockets and the
uvicorn server. The node process (:mod:`gpumesh.daemon`) serves it and hands the
routes what it owns (its share, its shells) in ``ControlState``; ``gpumesh-control``
is that process in the foreground (:mod:`gpumesh.daemon.main`). Nothing below
this package imports it.
"""
