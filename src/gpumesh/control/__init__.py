"""Control: the local HTTP API and web dashboard over this node's home.
Reserved: the ``gpumesh-control`` entry point exists so installs keep a
stable command name; the API and dashboard are not built yet."""
