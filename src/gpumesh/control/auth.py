"""Who may call the control API over TCP, decided without I/O but the token file.

The unix socket ``control.sock`` is the owner's alone (0600 in the 0700 home)
and needs nothing more. TCP always needs one of:

- ``Authorization: Bearer TOKEN``: ``$GPUMESH_API_TOKEN``, or the home's own
  random token (``api.token``, 0600, made on first use);
- a session cookie, which a browser gets by exchanging a one-time login code
  (from a URL's fragment) once; it is ``HttpOnly; SameSite=Strict``, and a
  state-changing request made with it must carry :data:`CSRF_HEADER`.

Cookies ignore ports: a browser sends a cookie of ``127.0.0.1:8080`` to every
server on ``127.0.0.1``, another local user's included. So a loopback dashboard
lives at the home's own secret name, :func:`dashboard_host`
(``<random>.localhost``, which browsers resolve to loopback themselves), and a
session cookie counts only on a request whose ``Host`` is that name: replayed at
any other name the cookie grants nothing, and a browser sends it to another
user's server only when sent to that server at the name, which takes knowing
it. Login URLs carry the name; nothing without a credential reveals it, and
pages send no ``Referer``.

Whatever the credential, ``Host`` must name loopback, the dashboard's name or a
configured name (a DNS-rebinding page cannot), and a state-changing request whose
``Origin`` is another site's is refused. Codes and sessions live in memory: a
restart ends them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from gpumesh import platform
from gpumesh.settings import ENV_API_TOKEN, env
from gpumesh.store.modes import read_private

__all__ = [
    "CODE_TTL",
    "COOKIE",
    "CSRF_HEADER",
    "SESSION_TTL",
    "TOKEN_FILE",
    "Sessions",
    "api_token",
    "bearer",
    "dashboard_host",
    "host_allowed",
    "host_name",
    "is_loopback",
    "origin_allowed",
]

TOKEN_FILE = "api.token"
"""The home's own API token, made on first use when ``$GPUMESH_API_TOKEN`` is unset."""
COOKIE = "gpumesh_session"
CSRF_HEADER = "x-gpumesh-csrf"
"""A header a page of ours sets and a form or image of another site cannot."""
CODE_TTL = 300.0
"""Seconds a one-time login code stays valid."""
SESSION_TTL = 12 * 3600.0
"""Seconds a browser session lasts."""
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
_DASHBOARD_LABEL = b"gpumesh dashboard host name"


def api_token(home: Path) -> str:
    """``$GPUMESH_API_TOKEN``, else the home's ``api.token``, made 0600 if missing."""
    explicit = env(ENV_API_TOKEN)
    if explicit:
        return explicit
    path = home / TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _nofollow(), 0o600)
    except FileExistsError:
        token = read_private(path).decode().strip()
        if token:
            return token
        # An empty file (a crash between create and write): write it now.
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | _nofollow())
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token


def dashboard_host(token: str) -> str:
    """The home's own secret name for its loopback dashboard, ``<32 hex>.localhost``.

    Derived from the API token (an HMAC, so the name says nothing of the token):
    it stays the same for a home across restarts, so bookmarks keep working, and
    it changes with the token. Browsers resolve every ``*.localhost`` to loopback
    without asking DNS."""
    label = hmac.new(token.encode(), _DASHBOARD_LABEL, hashlib.sha256).hexdigest()[:32]
    return f"{label}.localhost"


def _nofollow() -> int:
    """``O_NOFOLLOW`` where the system has it (not on Windows, where the client
    reads the token to reach the node process over TCP)."""

    return os.O_NOFOLLOW if platform.has("nofollow") else 0


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header, or None."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


def token_matches(given: str | None, token: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def host_name(host_header: str) -> str:
    """The name of a ``Host`` header without its port, lower case, IPv6 unbracketed."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


def is_loopback(name: str) -> bool:
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(host_header: str | None, names: frozenset[str]) -> bool:
    """Whether a ``Host`` names this server: loopback, or one of ``names``."""
    if not host_header:
        return False
    name = host_name(host_header)
    return is_loopback(name) or name in names


def origin_allowed(origin: str | None, host_header: str | None) -> bool:
    """Whether a request's ``Origin`` is this server's own (or absent: not a browser's
    cross-site request). ``null`` (a sandboxed or file page) is refused."""
    if origin is None:
        return True
    if not host_header:
        return False
    host = host_header.strip().lower()
    return origin.strip().lower() in (f"http://{host}", f"https://{host}")


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class Sessions:
    """One-time login codes and the browser sessions they open, kept hashed in
    memory; ``clock`` is injected so expiry is tested without sleeping."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._codes: dict[str, float] = {}
        self._sessions: dict[str, float] = {}

    def new_code(self) -> str:
        """A login code, good for one exchange within :data:`CODE_TTL` seconds."""
        self._prune()
        code = secrets.token_urlsafe(24)
        self._codes[_digest(code)] = self._clock() + CODE_TTL
        return code

    def exchange(self, code: str) -> str | None:
        """A new session for a valid code (spent now), or None."""
        self._prune()
        if self._codes.pop(_digest(code), None) is None:
            return None
        session = secrets.token_urlsafe(32)
        self._sessions[_digest(session)] = self._clock() + SESSION_TTL
        return session

    def valid(self, session: str | None) -> bool:
        if not session:
            return False
        expires = self._sessions.get(_digest(session))
        return expires is not None and expires > self._clock()

    def end(self, session: str | None) -> None:
        if session:
            self._sessions.pop(_digest(session), None)

    def _prune(self) -> None:
        now = self._clock()
        for table in (self._codes, self._sessions):
            for key in [k for k, expires in table.items() if expires <= now]:
                del table[key]
