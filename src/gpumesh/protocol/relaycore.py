"""The relay's rules, without I/O: who may register, who may talk to whom, and
what crosses.

:class:`RelayCore` is driven by two calls, both given the time:
:meth:`~RelayCore.handle` for each datagram received and :meth:`~RelayCore.tick`
for expiry; both return the datagrams to send as ``(bytes, address)``
(:meth:`~RelayCore.handle_probe_port` answers what reaches the second port). It
never opens a socket or reads a clock, so every rule is tested with a fake
clock and no network (``tests/unit/test_relay_core.py``).

Nodes reach it over UDP or over a TCP connection (:mod:`gpumesh.relay.tcp`).
A connection is an address too: ``(peer host, TCP_PORT_BASE + peer port)``, a
port no UDP source can have, so per-IP limits see the real host and the same
rules hold on both; when a connection closes, :meth:`RelayCore.disconnect`
drops what it held at once.

What it owns: the stateless challenge (no per-client state before a valid
Register, so spoofed Hellos cost nothing), registrations keyed by source
address, sessions between a requester and a serving node, and the limits and
caps on both. What it must never do: look inside a Data payload (an
encrypted QUIC datagram between the two nodes), forward one to anybody but
the other end of that session, or answer an address that has not registered
with more bytes than it sent (that would make the relay an amplifier for
spoofed sources: :meth:`RelayCore.handle` withholds any such answer, and each
message is shaped so that real ones fit).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumesh.errors import ProtocolError
from gpumesh.identity.keys import node_id_for, verify_signature
from gpumesh.protocol.addresses import Address, format_address
from gpumesh.protocol.relay import (
    DATA_HEADER,
    HELLO_MIN_SIZE,
    MAX_PACKET,
    REFUSALS,
    Accept,
    Challenge,
    Close,
    Connect,
    Connected,
    Decline,
    Hello,
    Incoming,
    KeepAlive,
    KeepAliveAck,
    ReachProbe,
    ReachTest,
    Refused,
    Register,
    Registered,
    RelayMessage,
    challenge_nonce,
    decode_data,
    decode_packet,
    encode_packet,
    is_data,
    register_payload,
    token_proof,
)

__all__ = [
    "EPOCH_SECONDS",
    "TCP_PORT_BASE",
    "RelayCore",
    "RelayRules",
    "Send",
    "address_text",
    "is_reach_probe",
    "is_tcp_address",
    "tcp_address",
]

logger = logging.getLogger(__name__)

Send = tuple[bytes, Address]

EPOCH_SECONDS = 30
"""A challenge is good for the epoch it was made in and the next one."""
REFUSAL_INTERVAL = 1.0
"""At most one not-registered / no-session refusal per source per this many seconds."""
REACH_INTERVAL = 0.2
"""At most one ReachProbe per source per this many seconds."""
_THROTTLE_MAX = 100_000
_SESSION_ID_MASK = 2**63 - 1

TCP_PORT_BASE = 65536
"""Added to a TCP peer's port to make its connection's address: above any UDP port,
so the two never collide, while the host stays the peer's real one."""


def tcp_address(host: str, port: int) -> Address:
    """The address the core knows the TCP connection from ``host``:``port`` by."""
    return host, TCP_PORT_BASE + port


def is_tcp_address(address: Address) -> bool:
    """Whether ``address`` is a TCP connection's (:func:`tcp_address`), not a UDP source."""
    return address[1] >= TCP_PORT_BASE


def address_text(address: Address) -> str:
    """``ip:port`` (``[ip]:port`` for IPv6), the way the relay reports an address; a TCP
    connection's shows its real port."""
    host, port = address[0], address[1]
    if host.startswith("::ffff:") and "." in host:
        host = host[7:]  # an IPv4 peer seen through a dual-stack socket
    if port >= TCP_PORT_BASE:
        port -= TCP_PORT_BASE
    return format_address((host, port))


def _challenge_subject(address: Address) -> str:
    """What a challenge is bound to: the address, and whether it came over TCP, so a
    nonce fetched over one cannot register the other."""
    text = address_text(address)
    return f"tcp {text}" if is_tcp_address(address) else text


def is_reach_probe(packet: bytes) -> bool:
    """Whether ``packet`` must leave from the second port (the answer to a ReachTest)."""
    return bool(packet) and packet[0] == ReachProbe.TYPE


@dataclass(frozen=True)
class RelayRules:
    """Who may register and the limits on what crosses: all the core decides with.
    ``gpumesh-relay`` reads them from its flags and file
    (:class:`~gpumesh.relay.config.RelayConfig`); a node that relays for its peers
    makes them from its settings."""

    allow: frozenset[str] = frozenset()
    """Node ids that may register."""
    tokens: tuple[str, ...] = ()
    """Shared tokens; a node proving any of them may register."""
    open: bool = False
    """Serve any node (a public relay)."""
    max_registrations: int = 10_000
    """Registered addresses in all (refusal ``too-many-registrations``)."""
    max_per_ip: int = 32
    """Registered addresses per source IP (``too-many-per-ip``); nodes behind one NAT share one."""
    max_sessions: int = 64
    """Sessions per node key, as either end (``too-many-sessions`` for the requester,
    ``peer-too-many-sessions`` for the peer it asks for)."""
    max_sessions_initiated: int = 32
    """Sessions a node key may have open that it asked for (``too-many-initiated``)."""
    max_sessions_per_pair: int = 8
    """Sessions one node key may have open to one other (``too-many-to-peer``); below
    ``max_sessions``, so that no node can take all of another's."""
    max_sessions_total: int = 0
    """Sessions open at once in all (``relay-full``); 0: no limit but the others."""
    keepalive: float = 10.0
    """Seconds between keep-alives the relay asks of nodes."""
    registration_timeout: float = 45.0
    """A registration silent this long is dropped, its sessions closed (``idle``)."""
    connect_timeout: float = 5.0
    """Seconds a serving node has to answer Incoming before the requester is refused."""
    session_bytes: int = 10 * 1000**3
    """Bytes relayed per session, both directions (``byte-cap``); 0: no cap."""
    session_seconds: float = 86_400.0
    """Lifetime of a session (``time-cap``); 0: no cap."""
    session_idle: float = 120.0
    """A session with no Data this long is closed (``idle``); 0: never."""
    session_rate: int = 0
    """Bytes per second per session (excess dropped); 0: unlimited."""
    total_rate: int = 0
    """Bytes per second for all sessions together (excess dropped); 0: unlimited."""


@dataclass(eq=False)
class _Registration:
    address: Address
    public_key: bytes
    node_id: str
    serving: bool
    since: float
    last_seen: float
    sessions: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Session:
    id: int
    secret: bytes
    request: int
    requester: Address
    requester_key: bytes
    requester_candidates: list[str]
    server: Address
    server_key: bytes
    created: float
    state: str = "pending"
    server_candidates: list[str] = field(default_factory=list)
    last_data: float = 0.0
    bytes: int = 0
    tokens: float = 0.0
    tokens_at: float = 0.0

    def other(self, address: Address) -> Address:
        return self.server if address == self.requester else self.requester

    def ends(self) -> tuple[Address, Address]:
        return self.requester, self.server


class RelayCore:
    """The relay's state machine: datagrams in, datagrams out, time injected."""

    def __init__(
        self,
        rules: RelayRules,
        *,
        secret: bytes | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
        admit: Callable[[bytes], bool] | None = None,
        may_pair: Callable[[bytes, bytes], bool] | None = None,
    ) -> None:
        """``admit``: whether a node key may register, beside ``rules``' allowlist and
        tokens (a node relaying for its peers: paired and allowed). ``may_pair``:
        whether a session may join the requester's key to the server's (both paired
        and allowed there); refused ``pair-not-allowed`` when not."""
        self._admit = admit
        self._may_pair = may_pair
        self.rules = rules
        self._random = random_bytes
        self._secret = secret if secret is not None else random_bytes(32)
        self._tokens = tuple(token for token in rules.tokens if token)
        self._registrations: dict[Address, _Registration] = {}
        self._by_key: dict[bytes, set[Address]] = {}
        self._per_ip: dict[str, int] = {}
        self._sessions: dict[int, _Session] = {}
        self._requests: dict[tuple[Address, int], int] = {}
        self._sessions_per_key: dict[bytes, int] = {}
        self._initiated: dict[bytes, int] = {}
        self._per_pair: dict[tuple[bytes, bytes], int] = {}
        self._refused_at: dict[Address, float] = {}
        self._reach_at: dict[Address, float] = {}
        self._total_tokens = float(max(rules.total_rate, 16 * MAX_PACKET))
        self._total_at = 0.0
        self.sessions_opened = 0
        self.bytes_relayed = 0
        self.refusals: dict[str, int] = {}
        self.closes: dict[str, int] = {}
        self.version = 0
        """Bumped on every change worth writing to the stats file."""
        self.probe_port = 0
        """The relay's second UDP port, told to nodes in every Challenge (0: none); the
        server sets it once that socket is bound."""

    # --- the two entry points -----------------------------------------------------------------

    def handle(self, packet: bytes, source: Address, now: float) -> list[Send]:
        """What to send in answer to ``packet`` from ``source`` at time ``now``."""
        if len(packet) > MAX_PACKET:
            logger.debug("dropped %d-byte packet from %s: too large", len(packet), source)
            return []
        known = source in self._registrations
        if is_data(packet):
            out = self._data(packet, source, now)
        else:
            try:
                message = decode_packet(packet)
            except ProtocolError as exc:
                logger.debug("dropped packet from %s: %s", source, exc)
                return []
            out = self._dispatch(message, len(packet), source, now)
        if not known:
            out = self._no_larger(out, len(packet), source)
        return out

    def handle_probe_port(self, packet: bytes, source: Address, now: float) -> list[Send]:
        """What to send from the second port in answer to ``packet`` that arrived there:
        a Challenge to a padded Hello, nothing to anything else.

        A node compares the address each of the relay's ports sees it from: a NAT that
        maps by destination shows it from two (``gpumesh netcheck``). Stateless, and no
        larger than the Hello, as on the main port."""
        if not HELLO_MIN_SIZE <= len(packet) <= MAX_PACKET or packet[0] != Hello.TYPE:
            return []
        try:
            message = decode_packet(packet)
        except ProtocolError as exc:
            logger.debug("dropped packet from %s on the probe port: %s", source, exc)
            return []
        if not isinstance(message, Hello):
            return []
        return self._no_larger([self._challenge(source, now)], len(packet), source)

    @staticmethod
    def _no_larger(out: list[Send], size: int, source: Address) -> list[Send]:
        """``out`` without any answer larger than the ``size`` bytes an unregistered
        ``source`` sent: the last line against amplification (each message is
        shaped so that a real one fits; this catches what slips through)."""
        kept = [send for send in out if len(send[0]) <= size]
        if len(kept) != len(out):
            logger.debug("withheld an answer larger than the %d bytes %s sent", size, source)
        return kept

    def tick(self, now: float) -> list[Send]:
        """Expire silent registrations, unanswered connects and capped or idle sessions.

        Cheap enough to call a few times a second; deadlines are as precise as
        the caller's tick interval.
        """
        out: list[Send] = []
        timeout = self.rules.registration_timeout
        for registration in list(self._registrations.values()):
            if now - registration.last_seen >= timeout:
                logger.info(
                    "registration of %s from %s expired (silent %.0fs)",
                    registration.node_id[:12],
                    address_text(registration.address),
                    now - registration.last_seen,
                )
                out += self._unregister(registration, "idle")
        for session in list(self._sessions.values()):
            if session.state == "pending":
                if now - session.created >= self.rules.connect_timeout:
                    out += self._end_pending(session, "unknown-peer", "the peer did not answer")
                continue
            reason = self._cap_reached(session, now)
            if reason is not None:
                out += self._close_session(session, reason, now)
        for throttle, interval in ((self._refused_at, REFUSAL_INTERVAL), (self._reach_at, 1.0)):
            for address in [a for a, at in throttle.items() if now - at >= interval]:
                del throttle[address]
        return out

    def disconnect(self, address: Address, now: float) -> list[Send]:
        """``address`` is gone for good (its TCP connection closed): drop its
        registration now rather than at ``registration_timeout``; its sessions end,
        and their other ends are told ``closed``."""
        self._refused_at.pop(address, None)
        self._reach_at.pop(address, None)
        registration = self._registrations.get(address)
        if registration is None:
            return []
        logger.info("%s disconnected from %s", registration.node_id[:12], address_text(address))
        return self._unregister(registration, "closed", now)

    def shutdown(self, now: float) -> list[Send]:
        """Close every session at both ends (the relay is stopping)."""
        out: list[Send] = []
        for session in list(self._sessions.values()):
            out += self._end_both(session, "shutting-down", now)
        return out

    def drop_key(self, key: bytes, now: float) -> list[Send]:
        """``key`` may no longer use this relay (a node relaying for its peers denied
        it): its sessions end at both ends now, its registrations go, and it is told
        ``not-allowed``."""
        out: list[Send] = []
        for address in list(self._by_key.get(key, ())):
            registration = self._registrations[address]
            for session_id in list(registration.sessions):
                session = self._sessions.get(session_id)
                if session is not None:
                    out += self._end_both(session, "not-allowed", now)
            out += self._unregister(registration, "not-allowed", now)
            out.append(self._refusal("not-allowed", address))
        return out

    def end_pairs(self, may_pair: Callable[[bytes, bytes], bool], now: float) -> list[Send]:
        """End, at both ends, every session whose two keys ``may_pair`` no longer joins."""
        out: list[Send] = []
        for session in list(self._sessions.values()):
            if not may_pair(session.requester_key, session.server_key):
                out += self._end_both(session, "pair-not-allowed", now)
        return out

    def _end_both(self, session: _Session, code: str, now: float) -> list[Send]:
        if session.state == "pending":
            return [
                *self._end_pending(session, code),
                self._close_packet(session.id, code, session.server),
            ]
        return self._close_session(session, code, now)

    # --- what an operator and the stats file see ----------------------------------------------

    @property
    def registration_count(self) -> int:
        return len(self._registrations)

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def is_registered(self, address: Address) -> bool:
        return address in self._registrations

    def registered_keys(self) -> list[bytes]:
        """The node keys registered now."""
        return list(self._by_key)

    def stats(self, now: float) -> dict[str, Any]:
        """Counters for the stats file (never a secret, never a payload)."""
        return {
            "registrations": len(self._registrations),
            "sessions": [
                {
                    "id": session.id,
                    "a": node_id_for(session.requester_key),
                    "b": node_id_for(session.server_key),
                    "bytes": session.bytes,
                    "age": round(now - session.created, 3),
                    "state": session.state,
                }
                for session in self._sessions.values()
            ],
            "sessions_opened": self.sessions_opened,
            "bytes_relayed": self.bytes_relayed,
            "refusals": dict(self.refusals),
            "closes": dict(self.closes),
        }

    # --- control packets ----------------------------------------------------------------------

    def _dispatch(
        self, message: RelayMessage, size: int, source: Address, now: float
    ) -> list[Send]:
        registration = self._registrations.get(source)
        if registration is not None:
            registration.last_seen = now
        if isinstance(message, Hello):
            if size < HELLO_MIN_SIZE:  # an unpadded Hello could amplify a spoofed source
                logger.debug("dropped short Hello (%d bytes) from %s", size, source)
                return []
            return [self._challenge(source, now)]
        if isinstance(message, Register):
            return self._register(message, source, now)
        if isinstance(message, KeepAlive):
            ack = KeepAliveAck(
                seq=message.seq, registered=registration is not None, observed=address_text(source)
            )
            packet = encode_packet(ack)
            if registration is None and len(packet) > size:
                # Unpadded, from an address that never proved it is real: a spoofed
                # source would get more than was sent. (Nodes pad theirs.)
                logger.debug("dropped unpadded KeepAlive (%d bytes) from %s", size, source)
                return []
            return [(packet, source)]
        if isinstance(message, ReachTest):
            if self._throttled(self._reach_at, REACH_INTERVAL, source, now):
                return []
            return [(encode_packet(ReachProbe(seq=message.seq)), source)]
        if isinstance(message, Connect):
            if registration is None:
                return self._not_registered(source, now, message.request, size)
            return self._connect(message, registration, now)
        if isinstance(message, Accept | Decline | Close):
            return self._answer(message, size, source, now)
        logger.debug("ignored %s from %s", type(message).__name__, source)
        return []

    def _register(self, message: Register, source: Address, now: float) -> list[Send]:
        text = address_text(source)
        subject = _challenge_subject(source)
        epoch = self._epoch(now)
        if not any(
            hmac.compare_digest(message.nonce, challenge_nonce(self._secret, subject, e))
            for e in (epoch, epoch - 1)
        ):
            return [self._refusal("bad-nonce", source)]
        payload = register_payload(message.nonce, message.public_key, message.serving)
        if not verify_signature(message.public_key, message.signature, payload):
            return [self._refusal("bad-signature", source)]
        node_id = node_id_for(message.public_key)
        if not self._allowed(node_id, message):
            logger.info("refused registration of %s from %s: not allowed", node_id, text)
            return [self._refusal("not-allowed", source)]
        out: list[Send] = []
        existing = self._registrations.get(source)
        if existing is not None and existing.public_key != message.public_key:
            # Another key behind the same address: the old node is gone.
            out += self._unregister(existing, "closed")
            existing = None
        if existing is None:
            if len(self._registrations) >= self.rules.max_registrations:
                return [self._refusal("too-many-registrations", source)]
            if self._per_ip.get(source[0], 0) >= self.rules.max_per_ip:
                return [self._refusal("too-many-per-ip", source)]
            registration = _Registration(
                address=source,
                public_key=message.public_key,
                node_id=node_id,
                serving=message.serving,
                since=now,
                last_seen=now,
            )
            self._registrations[source] = registration
            self._by_key.setdefault(message.public_key, set()).add(source)
            self._per_ip[source[0]] = self._per_ip.get(source[0], 0) + 1
            logger.info(
                "registered %s from %s%s (%s)",
                node_id,
                text,
                " over tcp" if is_tcp_address(source) else "",
                "serving" if message.serving else "dialing",
            )
        else:
            existing.serving = message.serving
            existing.since = existing.last_seen = now
            logger.debug("re-registered %s from %s", node_id, text)
        self.version += 1
        registered = Registered(
            observed=text,
            keepalive=self.rules.keepalive,
            session_bytes=self.rules.session_bytes,
            session_seconds=self.rules.session_seconds,
        )
        out.append((encode_packet(registered), source))
        return out

    def _allowed(self, node_id: str, message: Register) -> bool:
        if self.rules.open or node_id in self.rules.allow:
            return True
        if self._admit is not None and self._admit(message.public_key):
            return True
        proof = message.token_proof
        return any(
            hmac.compare_digest(proof, token_proof(token, message.nonce)) for token in self._tokens
        )

    def _connect(self, message: Connect, registration: _Registration, now: float) -> list[Send]:
        source = registration.address
        known = self._requests.get((source, message.request))
        if known is not None:  # a retry: say again what we said, open nothing new
            session = self._sessions[known]
            if session.state == "pending":
                return [self._incoming_packet(session)]
            return [self._connected_packet(session)]
        server = self._serving_address(message.peer, exclude=source)
        if server is None:
            return [self._refusal("unknown-peer", source, message.request)]
        server_key = self._registrations[server].public_key
        refusal = self._session_limit(registration.public_key, server_key)
        if refusal is not None:
            code, detail = refusal
            logger.info(
                "refused a session of %s to %s: %s (%s)",
                registration.node_id[:12],
                self._registrations[server].node_id[:12],
                code,
                detail,
            )
            return [self._refusal(code, source, message.request, detail)]
        session = _Session(
            id=self._new_session_id(),
            secret=self._random(16),
            request=message.request,
            requester=source,
            requester_key=registration.public_key,
            requester_candidates=list(message.candidates),
            server=server,
            server_key=server_key,
            created=now,
            last_data=now,
            tokens=float(self._burst()),
            tokens_at=now,
        )
        self._sessions[session.id] = session
        self._requests[(source, message.request)] = session.id
        for key in (registration.public_key, server_key):
            self._sessions_per_key[key] = self._sessions_per_key.get(key, 0) + 1
        self._initiated[registration.public_key] = (
            self._initiated.get(registration.public_key, 0) + 1
        )
        pair = (registration.public_key, server_key)
        self._per_pair[pair] = self._per_pair.get(pair, 0) + 1
        registration.sessions.add(session.id)
        self._registrations[server].sessions.add(session.id)
        self.version += 1
        logger.debug(
            "session %x: %s asks for %s",
            session.id,
            registration.node_id[:12],
            self._registrations[server].node_id[:12],
        )
        return [self._incoming_packet(session)]

    def _session_limit(self, requester: bytes, server: bytes) -> tuple[str, str] | None:
        """Why ``requester`` may not open one more session to ``server``: (code, detail).

        The per-pair and per-initiator quotas come first, and the per-pair one is
        below ``max_sessions`` (the config checks it): however many sessions one
        node opens, another node's slots are never all its.
        """
        rules = self.rules
        if self._may_pair is not None and not self._may_pair(requester, server):
            return "pair-not-allowed", ""
        checks = (
            (
                "too-many-to-peer",
                self._per_pair.get((requester, server), 0),
                rules.max_sessions_per_pair,
            ),
            (
                "too-many-initiated",
                self._initiated.get(requester, 0),
                rules.max_sessions_initiated,
            ),
            ("too-many-sessions", self._sessions_per_key.get(requester, 0), rules.max_sessions),
            ("peer-too-many-sessions", self._sessions_per_key.get(server, 0), rules.max_sessions),
            ("relay-full", len(self._sessions), rules.max_sessions_total or 2**63),
        )
        for code, count, limit in checks:
            if count >= limit:
                return code, f"{count} open; the relay's limit is {limit}"
        return None

    def _answer(
        self, message: Accept | Decline | Close, size: int, source: Address, now: float
    ) -> list[Send]:
        session = self._sessions.get(message.session)
        if session is None or source not in session.ends():
            if isinstance(message, Close):
                return []  # never answer a Close with a packet: two relays could ping-pong
            if source not in self._registrations:
                return self._not_registered(source, now, message.session, size)
            return self._refuse_throttled("no-session", source, now, message.session)
        if isinstance(message, Close):
            if session.state == "pending":
                if source == session.server:
                    return self._end_pending(session, "peer-declined")
                self._forget(session, "closed", now)
                return [self._close_packet(session.id, "closed", session.server, message.message)]
            return self._close_session(session, "closed", now, by=source, message=message.message)
        if source != session.server:
            return self._refuse_throttled("no-session", source, now, message.session)
        if isinstance(message, Decline):
            if session.state == "pending":
                return self._end_pending(session, "peer-declined")
            return []
        if session.state != "pending":
            return []  # a repeated Accept
        session.state = "active"
        session.server_candidates = list(message.candidates)
        session.last_data = session.tokens_at = now
        self.sessions_opened += 1
        self.version += 1
        logger.info(
            "session %x opened: %s -> %s (%s -> %s)",
            session.id,
            node_id_for(session.requester_key)[:12],
            node_id_for(session.server_key)[:12],
            address_text(session.requester),
            address_text(session.server),
        )
        return [self._connected_packet(session)]

    # --- data ---------------------------------------------------------------------------------

    def _data(self, packet: bytes, source: Address, now: float) -> list[Send]:
        try:  # the header only: the payload goes on as it came, never copied
            session_id, _ = decode_data(packet[:DATA_HEADER])
        except ProtocolError as exc:
            logger.debug("dropped data packet from %s: %s", source, exc)
            return []
        registration = self._registrations.get(source)
        if registration is None:
            return self._not_registered(source, now, session_id, len(packet))
        registration.last_seen = now
        session = self._sessions.get(session_id)
        if session is None or source not in session.ends():
            return self._refuse_throttled("no-session", source, now, session_id)
        if session.state != "active":
            return []  # the serving end raced its own Accept; QUIC will resend
        reason = self._cap_reached(session, now)
        size = len(packet) - DATA_HEADER
        cap = self.rules.session_bytes
        if reason is None and cap and session.bytes + size > cap:
            reason = "byte-cap"
        if reason is not None:
            return self._close_session(session, reason, now)
        if self.rules.session_rate:
            rate = self.rules.session_rate
            session.tokens = min(
                float(self._burst()), session.tokens + (now - session.tokens_at) * rate
            )
            session.tokens_at = now
            if session.tokens < size:
                return []  # over the rate: drop; QUIC's congestion control backs off
            session.tokens -= size
        if not self._take_total(size, now):
            return []
        session.bytes += size
        session.last_data = now
        self.bytes_relayed += size
        self.version += 1
        # The packet goes on byte for byte: same session id, payload untouched.
        return [(packet, session.other(source))]

    def forward_run(
        self, buffer: bytes, segment: int, source: Address, now: float
    ) -> Address | None:
        """A run of equal-size Data packets from one source, received at once (GRO).

        When every packet carries the same session header and nothing stands in
        the way (registration, session, caps, rate), the run is accounted as a
        whole and the caller forwards the buffer unchanged to the address
        returned. Otherwise None: the caller hands each packet to
        :meth:`handle`, which refuses or drops exactly as for single packets.
        """
        if segment <= DATA_HEADER or segment > MAX_PACKET or len(buffer) <= segment:
            return None
        header = buffer[:DATA_HEADER]
        if not is_data(header):
            return None
        for offset in range(segment, len(buffer), segment):
            if buffer[offset : offset + DATA_HEADER] != header:
                return None
        try:
            session_id, _ = decode_data(header)
        except ProtocolError:
            return None
        registration = self._registrations.get(source)
        session = self._sessions.get(session_id)
        if registration is None or session is None or source not in session.ends():
            return None
        if session.state != "active" or self._cap_reached(session, now) is not None:
            return None
        count = -(-len(buffer) // segment)
        size = len(buffer) - count * DATA_HEADER
        cap = self.rules.session_bytes
        if cap and session.bytes + size > cap:
            return None
        if self.rules.session_rate:
            rate = self.rules.session_rate
            tokens = min(float(self._burst()), session.tokens + (now - session.tokens_at) * rate)
            if tokens < size:
                return None
            session.tokens, session.tokens_at = tokens - size, now
        if not self._take_total(size, now):
            return None
        registration.last_seen = now
        session.bytes += size
        session.last_data = now
        self.bytes_relayed += size
        self.version += 1
        return session.other(source)

    def _burst(self) -> int:
        return max(self.rules.session_rate, 16 * MAX_PACKET)

    def _take_total(self, size: int, now: float) -> bool:
        """Whether ``size`` more bytes fit ``total_rate`` now (taken if so): one bucket
        for every session, holding up to a second's worth."""
        rate = self.rules.total_rate
        if not rate:
            return True
        burst = float(max(rate, 16 * MAX_PACKET))
        self._total_tokens = min(burst, self._total_tokens + (now - self._total_at) * rate)
        self._total_at = now
        if self._total_tokens < size:
            return False
        self._total_tokens -= size
        return True

    def _cap_reached(self, session: _Session, now: float) -> str | None:
        seconds, idle = self.rules.session_seconds, self.rules.session_idle
        if seconds and now - session.created >= seconds:
            return "time-cap"
        if idle and now - session.last_data >= idle:
            return "idle"
        return None

    # --- ending things ------------------------------------------------------------------------

    def _close_session(
        self,
        session: _Session,
        reason: str,
        now: float,
        *,
        by: Address | None = None,
        message: str = "",
    ) -> list[Send]:
        """Forget an active session; tell both ends (or only the other end of ``by``)."""
        self._forget(session, reason, now)
        text = message or REFUSALS.get(reason, reason)
        ends = [session.other(by)] if by is not None else list(session.ends())
        return [self._close_packet(session.id, reason, end, text) for end in ends]

    def _end_pending(self, session: _Session, code: str, detail: str = "") -> list[Send]:
        """Refuse the requester of a session that never opened, and forget it."""
        self._forget(session, code, None)
        return [self._refusal(code, session.requester, session.request, detail)]

    def _forget(self, session: _Session, reason: str, now: float | None) -> None:
        del self._sessions[session.id]
        self._requests.pop((session.requester, session.request), None)
        for key in (session.requester_key, session.server_key):
            _decrement(self._sessions_per_key, key)
        _decrement(self._initiated, session.requester_key)
        _decrement(self._per_pair, (session.requester_key, session.server_key))
        for end in session.ends():
            registration = self._registrations.get(end)
            if registration is not None:
                registration.sessions.discard(session.id)
        self.version += 1
        if session.state == "active":
            self.closes[reason] = self.closes.get(reason, 0) + 1
            logger.info(
                "session %x closed: %s, %d bytes relayed in %.0fs",
                session.id,
                reason,
                session.bytes,
                (now - session.created) if now is not None else 0.0,
            )
        else:
            logger.debug("session %x never opened: %s", session.id, reason)

    def _unregister(
        self, registration: _Registration, reason: str, now: float | None = None
    ) -> list[Send]:
        """Drop a registration; its sessions end, and only their other ends are told."""
        out: list[Send] = []
        address = registration.address
        ended = registration.last_seen if now is None else now
        for session_id in list(registration.sessions):
            session = self._sessions.get(session_id)
            if session is None:
                continue
            if session.state == "pending":
                if address == session.server:
                    out += self._end_pending(session, "unknown-peer", "the peer went away")
                else:
                    self._forget(session, reason, ended)
                    out.append(self._close_packet(session.id, reason, session.server))
            else:
                out += self._close_session(session, reason, ended, by=address)
        del self._registrations[address]
        keys = self._by_key.get(registration.public_key)
        if keys is not None:
            keys.discard(address)
            if not keys:
                del self._by_key[registration.public_key]
        _decrement(self._per_ip, address[0])
        self.version += 1
        return out

    # --- small helpers ------------------------------------------------------------------------

    @staticmethod
    def _epoch(now: float) -> int:
        return int(now // EPOCH_SECONDS)

    def _serving_address(self, key: bytes, *, exclude: Address) -> Address | None:
        serving = [
            registration
            for address in self._by_key.get(key, ())
            if (registration := self._registrations[address]).serving and address != exclude
        ]
        best = max(serving, key=lambda registration: registration.since, default=None)
        return best.address if best is not None else None

    def _new_session_id(self) -> int:
        while True:
            session_id = int.from_bytes(self._random(8), "big") & _SESSION_ID_MASK
            if session_id and session_id not in self._sessions:
                return session_id

    def _challenge(self, source: Address, now: float) -> Send:
        nonce = challenge_nonce(self._secret, _challenge_subject(source), self._epoch(now))
        observed = address_text(source)
        challenge = Challenge(nonce=nonce, observed=observed, probe_port=self.probe_port)
        return encode_packet(challenge), source

    def _incoming_packet(self, session: _Session) -> Send:
        incoming = Incoming(
            session=session.id,
            peer=session.requester_key,
            observed=address_text(session.requester),
            candidates=session.requester_candidates,
            secret=session.secret,
        )
        return encode_packet(incoming), session.server

    def _connected_packet(self, session: _Session) -> Send:
        connected = Connected(
            request=session.request,
            session=session.id,
            observed=address_text(session.server),
            candidates=session.server_candidates,
            secret=session.secret,
        )
        return encode_packet(connected), session.requester

    def _close_packet(self, session: int, code: str, to: Address, message: str = "") -> Send:
        text = (message or REFUSALS.get(code, code))[:256]
        return encode_packet(Close(session=session, code=code, message=text)), to

    def _refusal(self, code: str, to: Address, session: int = 0, detail: str = "") -> Send:
        self.refusals[code] = self.refusals.get(code, 0) + 1
        self.version += 1
        text = REFUSALS[code] + (f" ({detail})" if detail else "")
        return encode_packet(Refused(code=code, message=text[:256], session=session)), to

    def _not_registered(self, to: Address, now: float, session: int, size: int) -> list[Send]:
        """``not-registered``, the code alone, and only when no larger than the ``size``
        bytes received: the address has not proven it is real, so it may be spoofed."""
        refused = Refused(code="not-registered", message="", session=session)
        packet = encode_packet(refused)
        if len(packet) > size or self._throttled(self._refused_at, REFUSAL_INTERVAL, to, now):
            return []
        self.refusals[refused.code] = self.refusals.get(refused.code, 0) + 1
        self.version += 1
        return [(packet, to)]

    def _refuse_throttled(self, code: str, to: Address, now: float, session: int) -> list[Send]:
        if self._throttled(self._refused_at, REFUSAL_INTERVAL, to, now):
            return []
        return [self._refusal(code, to, session)]

    @staticmethod
    def _throttled(
        throttle: dict[Address, float], interval: float, address: Address, now: float
    ) -> bool:
        """Whether ``address`` was answered less than ``interval`` ago; if not, it is now."""
        last = throttle.get(address)
        if last is not None and now - last < interval:
            return True
        if len(throttle) >= _THROTTLE_MAX:  # a flood of spoofed sources: start over
            throttle.clear()
        throttle[address] = now
        return False


def _decrement(counts: dict[Any, int], key: Any) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
