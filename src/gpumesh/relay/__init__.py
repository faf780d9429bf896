"""Relay: the small public server that forwards encrypted QUIC packets between
nodes behind NAT. Reserved: the ``gpumesh-relay`` entry point exists so
installs keep a stable command name; the server itself is not built yet."""
