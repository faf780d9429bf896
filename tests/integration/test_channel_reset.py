"""A data channel connection reset before its TLS starts leaves no socket open.

Python's TLS socket takes a connection's descriptor over before it looks at
the connection; when the peer has reset it by then (a consumer that gave up
its dial), ``wrap_socket`` raises with that new socket neither closed nor
returned, and the garbage collector finds it later, in whatever runs then.
Real sockets on loopback: the reset is a real RST (``SO_LINGER`` 0).
"""

from __future__ import annotations

import gc
import socket
import ssl
import struct
import threading
import time
import warnings

import pytest

from gpumesh.identity.keys import Identity
from gpumesh.transport.channel import Listener, dial, server_context, wrap_tls


def _reset_connection(address: tuple[str, int]) -> None:
    """Connect to ``address`` and reset the connection at once."""
    client = socket.create_connection(address)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()


def _unclosed_tls_sockets(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "SSLSocket" in str(w.message)]


def test_a_connection_reset_before_tls_is_refused_and_closed() -> None:
    context = server_context(Identity.generate())
    with socket.create_server(("127.0.0.1", 0)) as server:
        _reset_connection(server.getsockname())
        time.sleep(0.2)  # the RST arrives
        conn, _address = server.accept()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            with pytest.raises(OSError):
                wrap_tls(context, conn, server_side=True)
            conn.close()
            gc.collect()
    assert _unclosed_tls_sockets(caught) == []


def test_a_listener_takes_the_right_connection_after_a_reset_one() -> None:
    """The reset connection comes from the peer's own address: it is dropped, and the
    dial that follows gets its channel."""
    identity = Identity.generate()
    ticket = bytes(range(32))
    listener = Listener("127.0.0.1", server_context(identity), ticket, peer="127.0.0.1")
    accepted: list[object] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        _reset_connection(("127.0.0.1", listener.port))
        time.sleep(0.2)
        taker = threading.Thread(target=lambda: accepted.append(listener.accept(10.0, 30.0)))
        taker.start()
        channel = dial("127.0.0.1", listener.port, identity.public_key, ticket, 10.0)
        taker.join(60)
        channel.sock.sendall(b"ping")
        (theirs,) = accepted
        assert isinstance(theirs.sock, ssl.SSLSocket)  # type: ignore[attr-defined]
        assert theirs.sock.recv(4) == b"ping"  # type: ignore[attr-defined]
        channel.close()
        theirs.close()  # type: ignore[attr-defined]
        gc.collect()
    assert _unclosed_tls_sockets(caught) == []
