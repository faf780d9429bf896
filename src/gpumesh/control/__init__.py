"""Control: the local HTTP API over this node's home (``gpumesh-control``).

``app.py`` holds the routes (thin: parse, call ``gpumesh.client``, return the
view structs of ``gpumesh.client.views``), ``auth.py`` who may call them,
``openapi.py`` the document that lists them, ``server.py`` the sockets and the
uvicorn server, ``main.py`` the command. Nothing below this package imports it.
"""
