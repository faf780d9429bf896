"""Authenticated sessions: a QUIC link whose dialer has proven its key.

Dialer side: :func:`open_session` dials (several addresses, staggered, first
answer wins), pins the provider's key, and sends the identity proof. On a
``gpumesh/2`` link the proof is bound to the TLS session, so the session is
returned at once and the first request leaves with the proof: the provider's
Welcome (or refusal) comes back with its reply, one round trip after the QUIC
handshake. With a provider one version behind (``gpumesh/1``) it waits for the
challenge and the Welcome first. Provider side: :func:`accept_session` runs the
proof on stream 0, holds the requests that came with it unread until the proof
checks, and decides access through a callback. Every other stream is one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpumesh.errors import (
    AccessDeniedError,
    ConnectionLostError,
    GPUMeshError,
    KeyMismatchError,
    ProtocolError,
    RelayError,
    TransportError,
    UnreachableError,
)
from gpumesh.identity.keys import Identity
from gpumesh.protocol.addresses import Address, format_address, parse_address
from gpumesh.protocol.flow import DEFAULT_WINDOW
from gpumesh.protocol.handshake import AUTH_STREAM, AuthForm, ClientAuth, ServerAuth
from gpumesh.protocol.messages import MAX_MESSAGE_FRAME, Hello, Message, Proof, SessionProof
from gpumesh.protocol.relay import DEFAULT_RELAY_PORT
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.quic import QuicLink
from gpumesh.transport.reach import unreachable
from gpumesh.transport.relayclient import RelayClient, dial_relayed, dialling_client
from gpumesh.transport.relaytcp import RelayTcp
from gpumesh.transport.stream import Stream

if TYPE_CHECKING:
    from gpumesh.transport.outgoing import OutgoingSocket
    from gpumesh.transport.relayclient import RelayedPath

__all__ = [
    "AUTH_TIMEOUT",
    "EARLY_BUFFER",
    "EARLY_REQUESTS",
    "Accepted",
    "DialRecord",
    "RelayHint",
    "Session",
    "accept_session",
    "open_session",
    "parse_address",
    "resolve_relay",
    "went_through_relay",
]

logger = logging.getLogger(__name__)

CLOSE_WAIT = 2.0
"""Seconds a request the connection closed under waits to learn why it closed."""
AUTH_TIMEOUT = 5.0
"""Seconds a new connection has to prove its identity before it is dropped."""
EARLY_REQUESTS = 8
"""Requests a dialer may send with its proof; streams past them are reset unread."""
EARLY_BUFFER = DEFAULT_WINDOW + 16 * MAX_MESSAGE_FRAME
"""Most bytes a link may hold for its reader before its proof checks: one request's
bulk window and a few messages (the first request a node sends may be an upload
that does not wait for an answer). A stream that takes the link over it is
refused, so what a stranger makes the provider hold stays under it, for at most
:data:`AUTH_TIMEOUT`; what qh3 reassembles is bounded by QUIC's windows, as for
any connection."""
_DIAL_STAGGER = 0.25
RELAY_DELAY = 0.5
"""Seconds direct dials get before the relay is tried too (at once if they all fail)."""
PUNCHED_FIRST = RELAY_DELAY
"""Seconds a re-dial gives the last punched address alone before the usual dial joins."""


@dataclass
class DialRecord:
    """What one dial started and when, relative to its start: which attempts raced
    (``punched``, ``direct``, ``relay``) and when each finished. Kept on the session it
    gave (:attr:`Session.dial_record`) for logs and tests."""

    started: float = field(default_factory=time.monotonic)
    events: list[tuple[str, float]] = field(default_factory=list)
    """(event, seconds since the dial started): ``<attempt> started``,
    ``<attempt> failed``, ``<attempt> won``."""

    def note(self, event: str) -> None:
        self.events.append((event, time.monotonic() - self.started))

    def at(self, event: str) -> float | None:
        """When ``event`` happened first (seconds into the dial); None if it did not."""
        return next((when for name, when in self.events if name == event), None)

    def __str__(self) -> str:
        return ", ".join(f"{name} {when:.3f} s" for name, when in self.events)


@dataclass(frozen=True)
class RelayHint:
    """Which relay to go through, and the shared token a private relay may ask for."""

    address: str
    """``host:port`` as the user wrote it (the port defaults to 4799)."""
    token: str = ""
    tcp: RelayTcp | None = None
    """Its TCP listener, raced against UDP (None: UDP only)."""
    peer: str = ""
    """The name of the paired peer that relays for its peers, when the relay is one (its
    share socket is ``address``); empty: a ``gpumesh-relay``."""

    def __str__(self) -> str:
        return f"peer {self.peer}" if self.peer else f"the relay {self.address}"


def went_through_relay(path: str) -> bool:
    """Whether a session's :attr:`Session.path` (as a store keeps it) says its peer's
    direct addresses did not answer: it was relayed, or hole punching reached the peer
    (through the relay, or at the address an earlier punch found)."""
    return path.startswith(("relayed", "direct (hole-punched)"))


async def _resolve_host(address: Address, where: str) -> Address:
    """``address`` with its host name (a hint may name one) looked up, IPv4 first,
    as sockets and QUIC take only IP literals; an IP literal as it is. A name that
    does not resolve is :class:`UnreachableError` at ``where``, as a silent host is."""
    host, port = address
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return address
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as exc:
        raise unreachable(where, reason=f"cannot resolve {host}: {_why(exc)}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    if not infos:
        raise unreachable(where, reason=f"{host} has no address")
    found = infos[0][4]
    return (str(found[0]), int(found[1]))


def _why(exc: OSError | UnicodeError) -> str:
    return str(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)


async def resolve_relay(text: str) -> Address:
    """``host[:port]`` of a relay to one IPv4 address (UDP)."""

    try:
        host, port = parse_address(text, DEFAULT_RELAY_PORT)
    except ValueError as exc:
        raise UnreachableError(f"invalid relay address {text!r}: {exc}") from None
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as exc:
        raise UnreachableError(f"cannot resolve the relay {text}: {_why(exc)}") from None
    found = infos[0][4]
    return (str(found[0]), int(found[1]))


class Session:
    """The dialer's view of an authenticated link: one request per stream.

    Requests may start as soon as it exists; on a session-bound link the
    provider's Welcome is still on its way then (:meth:`established` waits for
    it), and a refusal closes the link with its error, which every open request
    then raises.
    """

    def __init__(
        self,
        link: QuicLink,
        auth: ClientAuth,
        auth_stream: Stream,
        where: str,
        *,
        relayed: RelayedPath | None = None,
    ) -> None:
        self.link = link
        self.relayed = relayed
        """The relayed session under the link (punched or not), or None for a direct one."""
        self.peer_name = where
        """The provider's node name once it welcomed us; where we dialled until then."""
        self.dial_record: DialRecord | None = None
        """What the dial that opened this session tried, and when."""
        self.punched_before: Address | None = None
        """Set on a direct session dialled to the address hole punching found for an
        earlier session with the peer (its NAT's mapping, still open): that address."""
        self.lan = False
        """Set on a direct session to the address the peer announced on this LAN
        (:mod:`gpumesh.transport.lan`): its path is ``lan``."""
        self._auth = auth
        self._auth_stream = auth_stream
        self._established: asyncio.Future[None] | None = None

    @property
    def address(self) -> Address:
        """Where packets go now (the peer, its punched address, or the relay)."""
        return self.link.remote_address()

    @property
    def through_relay(self) -> bool:
        """True when the session was set up through a relay (punched or not)."""
        return self.relayed is not None

    def dialable_address(self) -> Address | None:
        """An address worth dialling directly next time, if this session found one.

        A plain direct session's address; for a relayed one, a punched address
        only when it is one the peer listens on itself (its LAN address, say),
        not its NAT's mapping, which only answered because we punched it.
        """
        path = self.relayed
        if path is None:
            return self.link.address if self.punched_before is None else None
        return path.direct if path.direct in path.peer_listens else None

    @property
    def punched_address(self) -> Address | None:
        """The hole-punched address this session's packets go to now, if any: worth
        dialling directly first when the session must be dialled again, from the same
        socket, while the NATs still keep the mapping open."""
        if self.relayed is None:
            return self.punched_before
        return self.relayed.direct

    @property
    def punched_after(self) -> float | None:
        """Seconds hole punching took to find the direct path; None without one."""
        return None if self.relayed is None else self.relayed.puncher.direct_after

    @property
    def path(self) -> str:
        """``lan``, ``direct``, ``direct (hole-punched) ADDR`` or ``relayed via RELAY``."""
        if self.lan and self.relayed is None:
            return "lan"
        if self.punched_before is not None:
            return f"direct (hole-punched) {format_address(self.punched_before)}"
        return self.link.describe_path()

    @property
    def peer_relays(self) -> bool:
        """The provider's Welcome said it relays for its peers (``relay_for_peers``)."""
        return self._auth.server_relays

    async def wait_for_punching(self, timeout: float) -> None:
        """Give hole punching up to ``timeout`` seconds to find a direct path."""
        path = self.relayed
        if path is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(path.settled.wait(), timeout)

    def open_stream(self) -> Stream:
        return self.link.open_stream()

    @property
    def welcomed(self) -> bool:
        """Whether the provider's Welcome has been read (see :meth:`established`)."""
        return self._auth.done

    async def established(self) -> None:
        """Wait until the provider welcomed us: both keys proven, access granted.

        Raises the provider's refusal (the link is closed then), or
        :class:`UnreachableError` when no answer comes within :data:`AUTH_TIMEOUT`.
        """
        await asyncio.shield(self.read_welcome())

    def read_welcome(self) -> asyncio.Future[None]:
        """Start reading the provider's answer to the proof (once): what
        :meth:`established` waits for. Started at once after a session-bound proof,
        so the Welcome's news (FEC) is heard even when no request waits for it."""
        if self._established is None:
            self._established = asyncio.ensure_future(self._finish_authentication())
            # Retrieved here too: a caller may be cancelled while it goes on.
            self._established.add_done_callback(
                lambda done: None if done.cancelled() else done.exception()
            )
        return self._established

    async def _finish_authentication(self) -> None:
        auth, stream = self._auth, self._auth_stream
        try:
            async with asyncio.timeout(AUTH_TIMEOUT):
                while not auth.done:
                    reply = auth.receive(await stream.read_message())
                    if reply is not None:
                        stream.send_message(reply, end=True)
        except TimeoutError:
            error = UnreachableError(
                f"{self.peer_name} accepted the connection but did not finish authentication"
            )
            self.link.close(error)
            raise error from None
        except GPUMeshError as exc:
            # With its error, so every request open on the link raises the same.
            self.link.close(exc)
            raise
        finally:
            self.link.forget_stream(stream.stream_id)
        self.peer_name = auth.server_name or self.peer_name
        if auth.server_fec:
            self.link.peer_takes_fec()

    async def request(self, message: Message, timeout: float = 30.0) -> Message:
        """Send one message on a new stream and return the single reply (which a
        session-bound provider sends right behind its Welcome)."""
        stream = self.open_stream()
        stream.send_message(message, end=True)
        try:
            async with asyncio.timeout(timeout):
                await self.established()
                reply = await stream.read_message()
        except TimeoutError:
            raise ConnectionLostError(
                f"{self.peer_name} did not answer within {timeout:.0f}s"
            ) from None
        finally:
            self.link.forget_stream(stream.stream_id)
        return reply

    async def refusal(self, within: float = CLOSE_WAIT) -> GPUMeshError | None:
        """Why the peer closed this session, when it closed it with a reason of its
        own (a refusal: denied, over a limit), waiting out QUIC's draining period
        (at most ``within`` seconds); None when it stays open or just went away.
        A request the close crossed on the wire reads as a lost connection: this
        says what a request sent a moment earlier would have been told."""
        try:
            reason = await asyncio.wait_for(self.link.wait_closed(), within)
        except TimeoutError:
            return None
        return None if isinstance(reason, TransportError) else reason

    def close(self) -> None:
        self.link.close()


def _path_failure(error: BaseException) -> str:
    """What failed on one path, without the advice its own message ends with."""
    return error.why if isinstance(error, TransportError) else str(error)


def _rank(error: GPUMeshError) -> int:
    # Which failure to report when every address failed: the most telling one.
    if isinstance(error, (AccessDeniedError, KeyMismatchError, ProtocolError)):
        return 0
    if isinstance(error, UnreachableError) and error.refused:
        return 2
    return 1


def _settled(task: asyncio.Task[Session]) -> Session | None:
    """A finished dial's session, or None when another address or path may still work.

    Raises what no other path or address could change: a refusal, a protocol
    error, or a bug. A wrong key is not among them: it says who answered at that
    address (another node, e.g. this machine's own on a loopback address from
    the peer's pairing code), not who the peer is, so other addresses and the
    relay are still tried; it is reported when none answers as the peer.
    """
    exc = task.exception()
    if exc is None:
        return task.result()
    if isinstance(exc, KeyMismatchError):
        return None
    if not isinstance(exc, GPUMeshError) or _rank(exc) == 0:
        raise exc
    return None


def _drop_losers(tasks: Iterable[asyncio.Task[Session] | None], winner: Session | None) -> None:
    """Cancel the attempts still running and close the sessions of those that
    finished but did not win."""
    for task in tasks:
        if task is None:
            continue
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None and task.result() is not winner:
            task.result().close()


async def open_session(
    identity: Identity,
    name: str,
    addresses: Sequence[Address],
    server_key: bytes,
    *,
    timeout: float = 5.0,
    peer_label: str = "the peer",
    relays: Sequence[RelayHint] = (),
    via: OutgoingSocket | None = None,
    punched: Address | None = None,
    relay_first: bool = False,
) -> Session:
    """Dial ``addresses`` (staggered, first success wins) and authenticate.

    With ``relays``, they are tried too, all at once: after :data:`RELAY_DELAY`, or at
    once when every direct dial has failed or with ``relay_first`` (the last session
    with this peer went through a relay: its direct addresses did not answer then, so
    waiting for them first would only add the delay); whichever finishes first wins, so
    of the relays (a ``gpumesh-relay``, peers that relay for their peers) the one with
    the shortest round trip. A refusal (denied, not paired) or a key mismatch ends the
    attempt at once: other paths reach the same node and would only repeat it. ``via``:
    a long-running process's shared socket and relay registrations (else each dial opens
    its own). ``punched``: the address punching found for the last session with this
    peer from ``via``'s socket, dialled first and alone for :data:`PUNCHED_FIRST`
    seconds: the NATs on both sides still let that flow through for a while after its
    session ended, so the peer is a round trip away without the relay. Then the usual
    dial runs beside it; its failure (a stale mapping, another host there now) only
    means the usual dial decides. The session's :attr:`Session.dial_record` says what
    was tried and when.
    """
    dial = _Dial(identity, name, server_key, timeout, peer_label, via, DialRecord())
    session = await dial.open(addresses, tuple(relays), punched, relay_first)
    session.dial_record = dial.record
    return session


@dataclass
class _Dial:
    """What every attempt of one :func:`open_session` dials with."""

    identity: Identity
    name: str
    server_key: bytes
    timeout: float
    peer_label: str
    via: OutgoingSocket | None
    record: DialRecord

    async def one(self, address: Address) -> Session:
        where = f"{address[0]}:{address[1]}"
        address = await _resolve_host(address, where)
        if self.via is not None and self.via.takes(address):
            link = await self.via.dial(address, where, self.server_key, self.timeout)
        else:
            link = await QuicEndpoint.dial(
                address, expected_key=self.server_key, timeout=self.timeout
            )
        return await self.authenticate(link, where)

    async def relayed(self, relay: RelayHint) -> Session:
        relay_address = await resolve_relay(relay.address)

        def make_client(endpoint: QuicEndpoint) -> RelayClient:
            return dialling_client(
                endpoint,
                relay_address,
                relay.address,
                self.identity,
                relay.token,
                relay.tcp,
                peer=relay.peer,
            )

        if self.via is not None:
            link, path = await self.via.dial_relayed(
                relay_address,
                relay.address,
                relay.token,
                self.server_key,
                self.timeout,
                relay.tcp,
                peer=relay.peer,
            )
        else:
            link, path = await dial_relayed(make_client, self.server_key, timeout=self.timeout)
        where = str(relay)
        # Returned at once, punching or not: the first request starts on the relay and
        # the link moves to a punched path underneath QUIC whenever punching finds one
        # (the peer's probes arriving is no promise that ours get through).
        return await self.authenticate(link, where, relayed=path)

    async def authenticate(
        self, link: QuicLink, where: str, *, relayed: RelayedPath | None = None
    ) -> Session:
        """Send the identity proof; wait for the Welcome only where requests must."""
        auth = ClientAuth(self.identity, self.name, self.server_key, fec=link.policy.fec_offered)
        try:
            form = AuthForm.of(link.alpn)
            stream = link.open_stream()
            assert stream.stream_id == AUTH_STREAM
            stream.send_message(auth.start(form, link.binding), end=form is AuthForm.SESSION)
        except GPUMeshError as exc:
            link.close(exc if isinstance(exc, ProtocolError) else None)
            raise
        session = Session(link, auth, stream, where, relayed=relayed)
        session.read_welcome()
        if not auth.may_send_requests:
            try:
                await session.established()
            except asyncio.CancelledError:
                link.close()  # another address or path won the race
                raise
        return session

    async def open(
        self,
        addresses: Sequence[Address],
        relays: tuple[RelayHint, ...],
        punched: Address | None,
        relay_first: bool,
    ) -> Session:
        if punched is None:
            return await self.with_relay(addresses, relays, relay_first)
        record = self.record
        record.note("punched started")
        first = asyncio.create_task(self.one(punched))
        rest: asyncio.Task[Session] | None = None
        winner: Session | None = None
        try:
            await asyncio.wait({first}, timeout=PUNCHED_FIRST)
            while True:
                if first.done() and not first.cancelled():
                    error = first.exception()
                    if error is None:
                        winner = first.result()
                        winner.punched_before = punched
                        record.note("punched won")
                        return winner
                    if not isinstance(error, GPUMeshError):
                        raise error  # a bug, not a stale address
                if rest is None:
                    if self.via is not None and relays and not first.done():
                        # The relay may punch to this very address from this very port:
                        # stop the attempt, as with_relay stops a direct one.
                        first.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await first
                        record.note("punched stopped")
                    rest = asyncio.create_task(self.with_relay(addresses, relays, relay_first))
                if rest.done() and (first.done() or rest.exception() is None):
                    winner = rest.result()  # or its error, once the punched address failed too
                    return winner
                waiting = {task for task in (first, rest) if not task.done()}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            _drop_losers((first, rest), winner)

    async def with_relay(
        self, addresses: Sequence[Address], relays: tuple[RelayHint, ...], relay_first: bool
    ) -> Session:
        record, via = self.record, self.via

        def start_direct() -> asyncio.Task[Session]:
            record.note("direct started")
            return asyncio.create_task(self.direct(addresses))

        def start_relayed() -> list[asyncio.Task[Session]]:
            record.note("relay started")
            return [asyncio.create_task(self.relayed(relay)) for relay in relays]

        if not relays:
            alone = await start_direct()
            record.note("direct won")
            return alone
        direct: asyncio.Task[Session] | None = None
        relayed: list[asyncio.Task[Session]] = []
        winner: Session | None = None
        try:
            if relay_first and addresses:
                # A relay is the path expected to win: its first step runs before the
                # direct attempt's (tasks start in order), so the direct attempt's own
                # set-up (a TLS flight) is not in the relay's way. From a shared socket
                # there is no direct attempt at all: it would stop as the relay starts
                # (see below).
                relayed = start_relayed()
                if via is None:
                    direct = start_direct()
            else:
                direct = start_direct()
                await asyncio.wait({direct}, timeout=RELAY_DELAY if addresses else 0)
                if direct.done():
                    if (winner := _settled(direct)) is not None:
                        record.note("direct won")
                        return winner
                    record.note("direct failed")
                if via is not None and not direct.done():
                    # From a shared socket the relayed session leaves from the same port
                    # as the direct attempt. Once punching opens the peer's NAT or
                    # firewall for that port, the direct attempt's retransmitted Initials
                    # get through and the peer takes them for a re-dial that replaces the
                    # relayed session, which then ends under us. Punching finds the
                    # direct path anyway.
                    direct.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await direct
                    record.note("direct stopped")
                relayed = start_relayed()
            pending = {task for task in (direct, *relayed) if task is not None and not task.done()}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for finished in done:
                    what = "direct" if finished is direct else "relay"
                    if (winner := _settled(finished)) is not None:
                        record.note(f"{what} won")
                        return winner
                    record.note(f"{what} failed")
            raise self._no_path(addresses, relays, direct, relayed)
        finally:
            _drop_losers((direct, *relayed), winner)

    def _no_path(
        self,
        addresses: Sequence[Address],
        relays: tuple[RelayHint, ...],
        direct: asyncio.Task[Session] | None,
        relayed: list[asyncio.Task[Session]],
    ) -> BaseException:
        """Why neither the addresses nor any relay reached the peer, in one line."""
        errors = [task.exception() for task in relayed]
        assert all(error is not None for error in errors)
        mismatch = next((e for e in errors if isinstance(e, KeyMismatchError)), None)
        tried_direct = direct is not None and not direct.cancelled()
        if mismatch is not None:
            return mismatch
        only = errors[0] if len(errors) == 1 else None
        if only is not None and (
            not addresses or (isinstance(only, RelayError) and not tried_direct)
        ):
            return only  # the relay's answer is the whole story
        # One line naming each path and why it failed (a relay's refusal alone would
        # hide that nothing answered directly either).
        through = " nor ".join(
            f"through {relay} ({_path_failure(error)})"
            for relay, error in zip(relays, errors, strict=True)
            if error is not None
        )
        if not addresses:
            return UnreachableError(f"cannot reach {self.peer_label} {through}")
        direct_error = direct.exception() if direct is not None and tried_direct else None
        direct_why = (
            _path_failure(direct_error) if direct_error else "no answer before the relay was tried"
        )
        advice = ""
        if isinstance(direct_error, UnreachableError):
            advice = f": is `gpumesh share` running on {self.peer_label}?"
        return UnreachableError(
            f"cannot reach {self.peer_label} directly ({direct_why}) nor {through}{advice}"
        )

    async def direct(self, addresses: Sequence[Address]) -> Session:
        peer_label = self.peer_label
        if not addresses:
            raise UnreachableError(
                f"no known address for {peer_label}: pair again with a fresh code"
            )
        tasks: list[asyncio.Task[Session]] = []
        errors: list[GPUMeshError] = []
        pending: set[asyncio.Task[Session]] = set()
        winner: Session | None = None
        try:
            for index, address in enumerate(addresses):
                task = asyncio.create_task(self.one(address))
                tasks.append(task)
                pending.add(task)
                is_last = index == len(addresses) - 1
                while pending:
                    done, pending = await asyncio.wait(
                        pending,
                        timeout=None if is_last else _DIAL_STAGGER,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    for finished in done:
                        if (winner := _settled(finished)) is not None:
                            return winner
                        exc = finished.exception()
                        assert isinstance(exc, GPUMeshError)
                        errors.append(exc)
                    if not done or not is_last:
                        break
        finally:
            _drop_losers(tasks, winner)
        errors.sort(key=_rank)
        best = errors[0] if errors else UnreachableError(f"cannot reach {peer_label}")
        if len(addresses) > 1 and isinstance(best, UnreachableError):
            tried = ", ".join(f"{h}:{p}" for h, p in addresses)
            raise UnreachableError(
                f"cannot reach {peer_label} at {tried}: {best.message}",
                refused=best.refused,
                why=f"at {tried}: {best.why}",
            )
        raise best


@dataclass
class Accepted:
    """A link whose dialer proved its key (and passed ``authorize``)."""

    auth: ServerAuth
    """The finished proof: ``client_key`` is proven."""
    early: list[Stream] = field(default_factory=list)
    """Requests the dialer sent with its proof, unread, in the order they came:
    the caller serves them once it has set ``link.on_stream`` for the rest."""


async def accept_session(
    link: QuicLink,
    identity: Identity,
    name: str,
    authorize: Callable[[bytes], None],
    *,
    relays: bool = False,
) -> Accepted:
    """Run the identity proof on ``link``'s stream 0, in the form its ALPN names.

    Requests that arrive before the proof checks are held unread (at most
    :data:`EARLY_REQUESTS` of them, :data:`EARLY_BUFFER` bytes in all) and handed
    back. On any failure the dialer gets a typed refusal, the link is closed
    (with what it held), and the error is raised.
    """
    first: asyncio.Future[Stream] = asyncio.get_running_loop().create_future()
    early: list[Stream] = []
    form: AuthForm | None = None  # known once the TLS handshake is done

    def on_stream(stream: Stream) -> None:
        # Called as the stream's first frame arrives, which may be in the same
        # packets as the end of the handshake (before the code below runs).
        if stream.stream_id == AUTH_STREAM:
            first.set_result(stream)
        elif form is not AuthForm.CHALLENGE and len(early) < EARLY_REQUESTS:
            early.append(stream)  # read only once the proof checks
        else:  # a challenge-form dialer sends no request before its Welcome
            stream.abort()

    link.on_stream = on_stream
    link.buffer_limit = EARLY_BUFFER
    try:
        async with asyncio.timeout(AUTH_TIMEOUT):
            await asyncio.shield(link.connected)
            form = AuthForm.of(link.alpn)
            if form is AuthForm.SESSION:
                auth = ServerAuth.for_session(
                    identity,
                    name,
                    link.binding,
                    authorize,
                    fec=link.policy.fec_offered,
                    relays=relays,
                )
                expected: tuple[type[Message], ...] = (SessionProof,)
            else:
                auth = ServerAuth.for_challenge(identity, name, os.urandom(32), authorize)
                expected = (Hello, Proof)
                for stream in early:
                    stream.abort()
                early.clear()
            stream = await first
            while not auth.done:
                try:
                    message = await stream.read_message()
                except GPUMeshError as exc:
                    stream.refuse(exc)
                    raise
                if not isinstance(message, expected):
                    raise ProtocolError("expected the identity proof before any request")
                reply = auth.receive(message)
                stream.send_message(reply, end=auth.done or auth.failed)
                if auth.failed:
                    assert auth.error is not None
                    raise auth.error
        link.forget_stream(stream.stream_id)
        if auth.client_fec:
            link.peer_takes_fec()
    except TimeoutError:
        error = AccessDeniedError("identity proof not completed in time")
        link.close(error)
        raise error from None
    except GPUMeshError as exc:
        # Give the refusal a moment to leave before the close overtakes it.
        link.transmit_now()
        await asyncio.sleep(0.05)
        link.close(exc)
        raise
    finally:
        with contextlib.suppress(Exception):
            link.on_stream = None
    return Accepted(auth, early)
