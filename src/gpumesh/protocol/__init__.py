"""Wire protocol: typed messages, framing, flow control and the auth handshake.

Pure code: nothing in this package touches a socket, a clock or a file.
"""
