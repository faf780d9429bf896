"""What one route of the control API is: the table's row type, shared by the
routes (``app.py``) and the document that lists them (``openapi.py``)."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from gpumesh.control.call import Call

__all__ = ["Access", "Endpoint", "Handler", "Query"]


class Access(enum.Enum):
    """Which credentials a route takes over TCP (the unix socket may call all)."""

    PUBLIC = "public"
    """No credential: the page, the login exchange, the OpenAPI document."""
    ANY = "any"
    """A bearer token or a browser session."""
    NO_COOKIE = "no_cookie"
    """A bearer token only: the route names local paths, never a browser's to choose."""


Handler = Callable[["Call"], Awaitable[object]]


@dataclass(frozen=True)
class Query:
    """A query parameter, for the OpenAPI document."""

    name: str
    kind: str
    """``boolean``, ``integer`` or ``string``."""
    doc: str


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    handler: Handler
    summary: str
    response: Any
    """The type of the JSON returned (for the document), or None for no body."""
    access: Access = Access.ANY
    body: type[msgspec.Struct] | None = None
    query: tuple[Query, ...] = ()
    status: int = 200
    media_type: str = "application/json"
