"""The request a handler reads: who called (:class:`Credential`), what the
routes share (:class:`ControlState`) and the authorised request (:class:`Call`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from gpumesh.control import auth
from gpumesh.control.dashboard import history
from gpumesh.control.guesses import TokenGuesses
from gpumesh.errors import AccessDeniedError, BadRequestError, GPUMeshError

if TYPE_CHECKING:
    from gpumesh.client.node import Node
    from gpumesh.daemon.process import NodeProcess
    from gpumesh.daemon.shells import Shells

__all__ = ["Call", "ControlState", "Credential", "Refusal", "cookie_host"]


class Credential(enum.Enum):
    UNIX = "unix"
    BEARER = "bearer"
    COOKIE = "cookie"
    NONE = "none"


@dataclass
class ControlState:
    """What the routes share: the node, the token, the browser sessions."""

    node: Node
    token: str
    sessions: auth.Sessions = field(default_factory=auth.Sessions)
    host_names: frozenset[str] = frozenset()
    """Names besides loopback that ``Host`` may carry (a non-loopback bind's)."""
    public_url: str = ""
    """``http://host:port`` of the TCP listener, for login URLs."""
    gpu_history: history.GpuHistory = field(default_factory=history.GpuHistory.from_env)
    """The last hour of GPU readings, sampled from the first request on."""
    process: NodeProcess | None = None
    """The node process serving this API (its status, its stop)."""
    shells: Shells | None = None
    """``gpumesh exec`` sessions run here (the node process's)."""
    guesses: TokenGuesses = field(default_factory=TokenGuesses.from_env)
    """Wrong bearer tokens per address: 429 after a few in a row."""

    @property
    def dashboard_host(self) -> str:
        """The home's secret ``<random>.localhost`` name its browser sessions live at."""
        return auth.dashboard_host(self.token)

    @property
    def cookie_hosts(self) -> frozenset[str]:
        """The ``Host`` names a session cookie counts on: the dashboard's secret name,
        and a non-loopback bind's configured names (a remote browser's)."""
        return self.host_names | {self.dashboard_host}

    def login_url(self, code: str) -> str:
        """The one-time sign-in URL for ``code``: at the dashboard's secret name when
        the listener is on loopback (where the session cookie will count), else at
        the listener's own address."""
        scheme, _, address = self.public_url.partition("://")
        name, _, port = address.rpartition(":")
        if auth.is_loopback(auth.host_name(address)):
            address = f"{self.dashboard_host}:{port}" if name else self.dashboard_host
        return f"{scheme}://{address}/#code={code}"


class Refusal(Exception):
    """A request refused before it reached the client layer: an HTTP status and an
    error of the tree (its code and message are the body)."""

    def __init__(self, status: int, error: GPUMeshError) -> None:
        super().__init__(error.message)
        self.status = status
        self.error = error


@dataclass
class Call:
    """One request, authorised: what a handler reads."""

    request: Request
    state: ControlState
    credential: Credential
    body: Any = None

    @property
    def node(self) -> Node:
        return self.state.node

    @property
    def signed_in(self) -> bool:
        """Whether the caller holds a credential (a page shows data only then)."""
        return self.credential is not Credential.NONE

    def param(self, name: str) -> str:
        return str(self.request.path_params[name])

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.request.query_params.get(name)
        if value is None:
            return default
        if value.lower() in ("1", "true", "yes", ""):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
        raise BadRequestError(f"query parameter {name}={value!r}: use true or false")

    def number(self, name: str, default: int, *, least: int = 0, most: int = 10_000) -> int:
        value = self.request.query_params.get(name)
        if value is None:
            return default
        try:
            number = int(value)
        except ValueError:
            raise BadRequestError(f"query parameter {name}={value!r} is not a number") from None
        if not least <= number <= most:
            raise BadRequestError(f"query parameter {name} must be {least} to {most}")
        return number

    def refuse_cookie(self, what: str) -> None:
        if self.credential is Credential.COOKIE:
            raise Refusal(
                403,
                AccessDeniedError(
                    f"{what} names a path on this machine: only the unix socket or a bearer "
                    "token may, never a browser session"
                ),
            )


def cookie_host(request: Request, state: ControlState) -> bool:
    """Whether ``request`` names a host a session cookie counts on."""
    return auth.host_name(request.headers.get("host", "")) in state.cookie_hosts
