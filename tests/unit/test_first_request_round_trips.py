"""Round trips from dial to the first request's reply, counted without sockets or clocks.

Two real qh3 connections (our client and server configurations) pass their
datagrams to each other in flights; on top, the identity proof of
:mod:`gpumesh.protocol.handshake` and one Ping request in our framing, with the
provider's rules: it serves no request before the proof checks, and holds the
ones that came early. A round trip is one flight each way. With the proof bound
to the TLS session the reply comes back in the QUIC handshake's round trip plus
one; in the challenge form (a peer one version behind) plus three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from qh3 import QuicConnection
from qh3.quic import events as qe

from gpumesh.identity.keys import Identity
from gpumesh.protocol.admission import parse_initial
from gpumesh.protocol.framing import FrameDecoder, FrameKind, encode_frame
from gpumesh.protocol.handshake import AUTH_STREAM, AuthForm, ClientAuth, ServerAuth
from gpumesh.protocol.messages import (
    ALPN,
    ALPN_CHALLENGE,
    ALPNS,
    Message,
    Ping,
    Pong,
    Welcome,
    decode_message,
    encode_message,
)
from gpumesh.transport.quicsetup import (
    client_configuration,
    server_configuration,
    session_binding,
)

CLIENT_ADDRESS = ("192.0.2.1", 50000)
SERVER_ADDRESS = ("192.0.2.2", 47000)
NOW = 0.0
MOST_ROUND_TRIPS = 10


def send(quic: QuicConnection, stream_id: int, message: Message, end: bool = False) -> None:
    quic.send_stream_data(stream_id, encode_frame(FrameKind.MESSAGE, encode_message(message)), end)


@dataclass
class Side:
    quic: QuicConnection
    decoders: dict[int, FrameDecoder] = field(default_factory=dict)
    binding: bytes = b""
    alpn: str | None = None

    def messages(self) -> list[tuple[int, Message]]:
        """(stream id, message) of what arrived, in order; notes the handshake's end."""
        found: list[tuple[int, Message]] = []
        while (event := self.quic.next_event()) is not None:
            if isinstance(event, qe.HandshakeCompleted):
                self.alpn = event.alpn_protocol
                self.binding = session_binding(self.quic)
            elif isinstance(event, qe.StreamDataReceived):
                decoder = self.decoders.setdefault(event.stream_id, FrameDecoder())
                for frame in decoder.feed(event.data):
                    assert frame.kind is FrameKind.MESSAGE
                    found.append((event.stream_id, decode_message(frame.body)))
        return found


@dataclass
class Outcome:
    round_trips: int
    reply: Message
    client: Side
    server: Side
    welcomed: bool


def first_request(client_alpns: tuple[str, ...], server_alpns: tuple[str, ...]) -> Outcome:
    """Dial, prove, send one Ping as early as the client may; count round trips to the Pong."""
    provider, dialer = Identity.generate(), Identity.generate()
    client = Side(QuicConnection(configuration=client_configuration(client_alpns)))
    client.quic.connect(SERVER_ADDRESS, NOW)
    server: Side | None = None
    client_auth = ClientAuth(dialer, "dialer", provider.public_key)
    server_auth: ServerAuth | None = None
    held: list[tuple[int, Message]] = []
    started, request_sent, reply, welcomed = False, False, None, False

    def serve(stream_id: int, message: Message) -> None:
        assert server is not None and isinstance(message, Ping)
        send(server.quic, stream_id, Pong(sent=message.sent, time=1.0), end=True)

    for round_trip in range(1, MOST_ROUND_TRIPS + 1):
        outgoing = client.quic.datagrams_to_send(NOW)
        if server is None:
            header = parse_initial(outgoing[0][0])
            assert header is not None
            config = server_configuration(provider, server_alpns)
            server = Side(
                QuicConnection(configuration=config, original_destination_connection_id=header.dcid)
            )
        for datagram, _ in outgoing:
            server.quic.receive_datagram(datagram, CLIENT_ADDRESS, NOW)
        for stream_id, message in server.messages():
            if server_auth is None:
                form = AuthForm.of(server.alpn)
                if form is AuthForm.SESSION:
                    server_auth = ServerAuth.for_session(
                        provider, "provider", server.binding, lambda _key: None
                    )
                else:
                    server_auth = ServerAuth.for_challenge(
                        provider, "provider", b"\x07" * 32, lambda _key: None
                    )
            if stream_id != AUTH_STREAM:
                held.append((stream_id, message))
                continue
            answer = server_auth.receive(message)
            send(server.quic, AUTH_STREAM, answer, end=server_auth.done)
        if server_auth is not None and server_auth.done:
            for stream_id, message in held:
                serve(stream_id, message)
            held.clear()
        for datagram, _ in server.quic.datagrams_to_send(NOW):
            client.quic.receive_datagram(datagram, SERVER_ADDRESS, NOW)
        arrived = client.messages()
        if client.alpn is not None and not started:
            first = client_auth.start(AuthForm.of(client.alpn), client.binding)
            send(client.quic, client.quic.get_next_available_stream_id(), first)
            started = True
        for stream_id, message in arrived:
            if stream_id == AUTH_STREAM:
                welcomed |= isinstance(message, Welcome)
                if (answer := client_auth.receive(message)) is not None:
                    send(client.quic, AUTH_STREAM, answer)
            else:
                reply = message
        if reply is not None:
            return Outcome(round_trip, reply, client, server, welcomed)
        if client_auth.may_send_requests and not request_sent:
            send(client.quic, client.quic.get_next_available_stream_id(), Ping(sent=1.0), end=True)
            request_sent = True
    raise AssertionError(f"no reply within {MOST_ROUND_TRIPS} round trips")


def test_session_bound_proof_costs_one_round_trip_beyond_the_quic_handshake() -> None:
    outcome = first_request(ALPNS, ALPNS)
    assert outcome.client.alpn == outcome.server.alpn == ALPN
    assert isinstance(outcome.reply, Pong)
    assert outcome.welcomed
    assert outcome.round_trips == 2  # the QUIC handshake, then proof + request


@pytest.mark.parametrize(
    ("client_alpns", "server_alpns"),
    [((ALPN_CHALLENGE,), ALPNS), (ALPNS, (ALPN_CHALLENGE,))],
    ids=["dialer-one-version-behind", "provider-one-version-behind"],
)
def test_a_peer_one_version_behind_gets_the_challenge_form(
    client_alpns: tuple[str, ...], server_alpns: tuple[str, ...]
) -> None:
    outcome = first_request(client_alpns, server_alpns)
    assert outcome.client.alpn == outcome.server.alpn == ALPN_CHALLENGE
    assert isinstance(outcome.reply, Pong)
    assert outcome.round_trips == 4  # the QUIC handshake, Hello, Proof, then the request


def test_both_ends_derive_the_same_binding_and_every_session_its_own() -> None:
    first, second = first_request(ALPNS, ALPNS), first_request(ALPNS, ALPNS)
    assert len(first.client.binding) == 32
    assert first.client.binding == first.server.binding
    assert second.client.binding == second.server.binding
    assert first.client.binding != second.client.binding
