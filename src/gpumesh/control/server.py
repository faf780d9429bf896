"""The control API's sockets and its uvicorn server, in the caller's event loop.

One :class:`uvicorn.Server` serves every listening socket at once (the home's
unix socket and, when asked, TCP). Its own signal capture is switched off: the
process that hosts it (``gpumesh-control`` now, the node process later) owns
SIGINT and SIGTERM and says when to stop through an :class:`asyncio.Event`.
Every connection passes the process's one :class:`~gpumesh.httpguard.Guard`
(caps, the request deadline, each route's body limit), the unix socket's too.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from gpumesh.errors import ConfigError, InUseError
from gpumesh.httpguard import KIB, Guard, Limits, http_protocol
from gpumesh.store.sockets import socket_name

if TYPE_CHECKING:
    from starlette.types import ASGIApp

__all__ = [
    "BODY_LIMITS",
    "SOCKET_NAME",
    "limits",
    "parse_listen",
    "serve",
    "tcp_listener",
    "tls_context",
    "unix_listener",
]

SOCKET_NAME = "control.sock"
"""The owner's socket in the home (0600 in the 0700 home)."""
GRACE = 3.0
"""Seconds open requests (an event stream) get to end once the server stops."""
BODY_LIMITS = {"POST /api/v1/auth/session": 4 * KIB}
"""Routes whose body is smaller than the default 1 MiB: the login exchange takes
a code from anybody who reaches the port, before any credential."""


def limits() -> Limits:
    """The control API's limits, ``$GPUMESH_HTTP_*`` over the defaults."""
    return Limits.from_env(bodies=BODY_LIMITS)


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server's TLS context from PEM files; a file that cannot be used is named."""
    for option, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not path.is_file():
            raise ConfigError(f"cannot read {option} {path}: no such file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
        raise ConfigError(
            f"cannot use --tls-cert {cert} with --tls-key {key}: {reason}; give a PEM "
            "certificate and its private key"
        ) from None
    return context


def parse_listen(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) of a TCP bind."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {text!r}: use HOST:PORT, such as 127.0.0.1:8080")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        raise ConfigError(f"listen address {text!r} names no host: use 127.0.0.1:{port}")
    return host, int(port)


def unix_listener(home: Path) -> socket.socket:
    """The home's ``control.sock``, bound and made 0600; a stale one (nothing answers
    on it) is replaced, a live one is :class:`InUseError`."""
    path = home / SOCKET_NAME
    with socket_name(path.parent, path.name) as name:
        if path.is_socket():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(name)
            except OSError:
                path.unlink(missing_ok=True)  # left by a process that is gone
            else:
                raise InUseError(
                    f"a control API already serves {home} ({path} answers): stop it first"
                )
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # The home is 0700, so nobody else can reach the socket before the chmod.
            sock.bind(name)
            os.chmod(path, 0o600)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise InUseError(f"cannot listen on {path}: {exc.strerror}") from None
    return sock


def tcp_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve {host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise InUseError(
                f"TCP {host}:{port} is taken: choose another with --listen or GPUMESH_API_ADDR"
            ) from None
        raise ConfigError(f"cannot listen on TCP {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The hosting process owns SIGINT/SIGTERM (the agent's handling must stay).
        yield


async def serve(
    app: ASGIApp,
    sockets: list[socket.socket],
    stop: asyncio.Event,
    guard: Guard,
    tls: ssl.SSLContext | None = None,
) -> None:
    """Serve ``app`` on ``sockets`` behind ``guard`` (over TLS with ``tls``) until
    ``stop`` is set, then let open requests end (at most :data:`GRACE` seconds) and
    return. The sockets are the caller's to close."""
    config = uvicorn.Config(
        app,
        http=http_protocol(guard),
        ssl_context_factory=None if tls is None else (lambda _config, _default: tls),
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=int(GRACE),
        server_header=False,
    )
    server = _Server(config)
    task = asyncio.ensure_future(server.serve(sockets=sockets))
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        server.should_exit = True
        await task
