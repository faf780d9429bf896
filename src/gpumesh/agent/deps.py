"""What the provider's services depend on: small interfaces, never the whole agent.

The agent (:mod:`gpumesh.agent.server`) owns the endpoint, the access check and
dispatch; it builds each service from the few things that service uses and
registers the service's handlers, one per message type, in a :class:`Handlers`.
A handler gets a :class:`RequestContext` (who asks, on which link and stream)
and its own message class. Nothing here gives back the agent, so no service
imports the server, and none reaches into another: where one service needs
another, it is handed the narrow protocol below that the other satisfies.

This module holds only types; it does no I/O.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

from gpumesh.errors import AccessDeniedError
from gpumesh.protocol.messages import Message

if TYPE_CHECKING:
    import threading

    from gpumesh.agent.datachannel import TarOffer
    from gpumesh.agent.sandboxfs import Listing, Usage
    from gpumesh.files.pack import PackPlan
    from gpumesh.files.sandbox import Tree
    from gpumesh.files.transfer import Hasher
    from gpumesh.store.jobs import JobRecord
    from gpumesh.store.peers import Peer
    from gpumesh.transport.quic import QuicLink
    from gpumesh.transport.stream import Stream

__all__ = [
    "Handler",
    "Handlers",
    "OwnedJobs",
    "Provider",
    "RequestContext",
    "SandboxFiles",
    "Sandboxes",
    "Settings",
    "TarChannels",
]

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class RequestContext:
    """One request of an allowed peer, as every handler gets it."""

    peer: Peer
    """Who asks (checked against the allowlist as the request arrived)."""
    link: QuicLink
    """The connection it came on."""
    stream: Stream
    """The request's stream: its message came first; the answer goes here."""


Handler: TypeAlias = Callable[[RequestContext, M], Awaitable[None]]
"""Serves one request whose first message is an ``M``."""


class Handlers:
    """Which handler serves each request message type (one each)."""

    def __init__(self) -> None:
        self._handlers: dict[type, Handler[Any]] = {}
        """Each handler is typed on its key's message class (``add`` sees to it)."""

    def add(self, kind: type[M], handler: Handler[M]) -> None:
        """Serve ``kind`` with ``handler``; a type is served by one handler only."""
        if kind in self._handlers:
            raise ValueError(f"{kind.__name__} already has a handler")
        self._handlers[kind] = handler

    def __setitem__(self, kind: type[M], handler: Handler[M]) -> None:
        """Replace the handler of ``kind`` (tests stand in older nodes this way)."""
        self._handlers[kind] = handler

    def __getitem__(self, kind: type[M]) -> Handler[M]:
        handler: Handler[M] = self._handlers[kind]
        return handler

    def get(self, kind: type) -> Handler[Any] | None:
        """The handler of a message of type ``kind``, None when this node serves none."""
        return self._handlers.get(kind)

    def __contains__(self, kind: object) -> bool:
        return kind in self._handlers


@dataclass(frozen=True)
class Provider:
    """Who this node is to its peers, as services name it in replies and refusals."""

    name: str
    node_id: str
    host: str
    """The share address's host (data channels listen there)."""


class Settings(Protocol):
    """This home's configuration (:class:`gpumesh.store.config.Config`), read only."""

    def get(self, name: str) -> Any: ...


class Sandboxes(Protocol):
    """The peers' sandboxes, as the job and app services use them (the file service)."""

    owner: tuple[int, int] | None
    """The host uid:gid that owns what peers store (their jobs' user); None: not known yet."""

    def sandbox(self, peer: Peer) -> Path: ...

    def tree(self, peer: Peer) -> Tree: ...

    def parts(self, remote: str) -> tuple[str, ...]: ...

    def partials(self, peer: Peer, *, create: bool = True) -> Path: ...

    def link_refused(self, remote: str) -> AccessDeniedError: ...

    async def usage(
        self,
        peer: Peer,
        exclude: str = "",
        listing: Listing | None = None,
        stop: threading.Event | None = None,
    ) -> Usage: ...

    def resolve_sandbox_dir(
        self, peer: Peer, remote: str, missing: str = "sync it first"
    ) -> tuple[str, ...]: ...


class TarChannels(Protocol):
    """Data channels for a request's tar (the file service's channels)."""

    def offer(
        self, ctx: RequestContext, wanted: bool, answer: Message, hash_name: str = ""
    ) -> TarOffer | None: ...

    async def receive_tar(
        self,
        ctx: RequestContext,
        offer: TarOffer,
        size: int,
        dest: Path,
        limit: int,
        hasher: Hasher,
        owner: tuple[int, int] | None = None,
    ) -> bool: ...

    async def send_tar(
        self, ctx: RequestContext, offer: TarOffer, plan: PackPlan, size: int, hasher: Hasher
    ) -> bool: ...


class SandboxFiles(Sandboxes, Protocol):
    """What the job and app services get of the file service: the sandboxes, and
    the data channels for their tars."""

    @property
    def channels(self) -> TarChannels: ...


class OwnedJobs(Protocol):
    """The hosted jobs a peer may ask about (the job service)."""

    def owned(self, peer: Peer, job_id: str) -> JobRecord: ...
