"""protocol/handshake: ClientAuth against ServerAuth, every message through encode/decode.

No sockets: a small driver passes each message over the wire format the way
the transport does, so these tests also cover that the handshake messages
survive their own size limits. Both forms: session-bound (``gpumesh/2``) and
challenge (``gpumesh/1``, a peer one version behind).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from gpumesh.errors import (
    AccessDeniedError,
    GPUMeshError,
    NotPairedError,
    ProtocolError,
)
from gpumesh.identity.keys import Identity
from gpumesh.protocol.handshake import (
    AuthForm,
    ClientAuth,
    ServerAuth,
    challenge_transcript,
    session_transcript,
)
from gpumesh.protocol.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    Message,
    Ping,
    Proof,
    Refusal,
    SessionProof,
    Welcome,
    decode_message,
    encode_message,
)


def wire(message: Message) -> Message:
    return decode_message(encode_message(message))


def allow_all(_key: bytes) -> None:
    return None


def make_server(
    identity: Identity,
    authorize: Callable[[bytes], None] = allow_all,
    nonce: bytes | None = None,
) -> ServerAuth:
    """A challenge-form provider (its dialer is one version behind)."""
    return ServerAuth.for_challenge(identity, "provider", nonce or os.urandom(32), authorize)


def make_session_server(
    identity: Identity,
    authorize: Callable[[bytes], None] = allow_all,
    binding: bytes | None = None,
) -> ServerAuth:
    return ServerAuth.for_session(identity, "provider", binding or os.urandom(32), authorize)


def run_handshake(client: ClientAuth, server: ServerAuth, binding: bytes = b"") -> int:
    """Drive both sides to the end; the client raises if refused.

    Returns the round trips the client waited for before it could send its
    first request (each a message sent and its answer awaited).
    """
    to_server: Message | None = client.start(server.form, binding)
    waits = 0
    while to_server is not None:
        if not client.may_send_requests:
            waits += 1
        to_server = client.receive(wire(server.receive(wire(to_server))))
    return waits


def expect_refusal(reply: Message, code: str) -> Refusal:
    assert isinstance(reply, Refusal)
    assert reply.code == code
    return reply


# --- success ------------------------------------------------------------------


def test_handshake_succeeds_and_proves_the_client_key(
    identity: Identity, other_identity: Identity
) -> None:
    seen: list[bytes] = []
    server = make_server(other_identity, seen.append)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    run_handshake(client, server)
    assert client.done
    assert client.server_name == "provider"
    assert server.done
    assert not server.failed
    assert server.client_key == identity.public_key
    assert server.client_name == "dialer"
    assert seen == [identity.public_key]


def test_messages_in_order(identity: Identity, other_identity: Identity) -> None:
    nonce = os.urandom(32)
    server = make_server(other_identity, nonce=nonce)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    hello = client.start(AuthForm.CHALLENGE)
    assert hello == Hello(version=PROTOCOL_VERSION, public_key=identity.public_key, name="dialer")
    challenge = server.receive(wire(hello))
    assert challenge == Challenge(nonce=nonce, version=PROTOCOL_VERSION)
    proof = client.receive(wire(challenge))
    assert isinstance(proof, Proof)
    assert not server.done
    welcome = server.receive(wire(proof))
    assert welcome == Welcome(name="provider")
    assert client.receive(wire(welcome)) is None
    assert client.done


def test_authorize_is_not_called_before_the_proof(
    identity: Identity, other_identity: Identity
) -> None:
    calls: list[bytes] = []
    server = make_server(other_identity, calls.append)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    server.receive(wire(client.start(AuthForm.CHALLENGE)))
    assert calls == []


# --- authorization refused ----------------------------------------------------


@pytest.mark.parametrize("error_class", [AccessDeniedError, NotPairedError])
def test_authorize_refusal_reaches_the_client_as_the_same_class(
    identity: Identity, other_identity: Identity, error_class: type[AccessDeniedError]
) -> None:
    def authorize(_key: bytes) -> None:
        raise error_class("provider says no: ask its owner")

    server = make_server(other_identity, authorize)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    with pytest.raises(error_class, match="provider says no") as info:
        run_handshake(client, server)
    assert type(info.value) is error_class
    assert server.failed
    assert isinstance(server.error, error_class)
    assert not client.done


def test_refusal_message_carries_code_and_text(
    identity: Identity, other_identity: Identity
) -> None:
    def authorize(_key: bytes) -> None:
        raise NotPairedError("not paired with you")

    server = make_server(other_identity, authorize)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    proof = client.receive(wire(server.receive(wire(client.start(AuthForm.CHALLENGE)))))
    assert proof is not None
    refusal = expect_refusal(wire(server.receive(wire(proof))), "not_paired")
    assert refusal.message == "not paired with you"


# --- forged proofs ------------------------------------------------------------


def _hello_and_challenge(server: ServerAuth, claimed: Identity) -> Challenge:
    challenge = wire(
        server.receive(
            wire(Hello(version=PROTOCOL_VERSION, public_key=claimed.public_key, name="x"))
        )
    )
    assert isinstance(challenge, Challenge)
    return challenge


def test_proof_signed_by_another_key_is_denied(
    identity: Identity, other_identity: Identity
) -> None:
    server_identity = Identity.generate()
    authorized: list[bytes] = []
    server = make_server(server_identity, authorized.append)
    challenge = _hello_and_challenge(server, claimed=identity)
    transcript = challenge_transcript(
        challenge.nonce, server_identity.public_key, identity.public_key
    )
    forged = Proof(signature=other_identity.sign(transcript))
    reply = expect_refusal(wire(server.receive(wire(forged))), "denied")
    assert "identity proof failed" in reply.message
    assert server.failed
    assert authorized == []


def test_proof_for_another_server_key_is_denied(
    identity: Identity, other_identity: Identity
) -> None:
    server_identity = Identity.generate()
    server = make_server(server_identity)
    challenge = _hello_and_challenge(server, claimed=identity)
    transcript = challenge_transcript(
        challenge.nonce, other_identity.public_key, identity.public_key
    )
    reply = server.receive(wire(Proof(signature=identity.sign(transcript))))
    expect_refusal(reply, "denied")
    assert not server.done


def test_proof_replayed_from_another_nonce_is_denied(
    identity: Identity, other_identity: Identity
) -> None:
    # A genuine proof from an earlier connection...
    first = make_server(other_identity, nonce=b"\x01" * 32)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    old_proof = client.receive(wire(first.receive(wire(client.start(AuthForm.CHALLENGE)))))
    assert isinstance(old_proof, Proof)
    assert first.receive(wire(old_proof)) == Welcome(name="provider")
    # ...is worthless on a new one with a fresh nonce.
    second = make_server(other_identity, nonce=b"\x02" * 32)
    _hello_and_challenge(second, claimed=identity)
    expect_refusal(second.receive(wire(old_proof)), "denied")
    assert second.failed


def test_client_pinned_to_another_server_key_is_denied(
    identity: Identity, other_identity: Identity
) -> None:
    # The client signs for the key it pinned; if the server has another key the proof fails.
    server = make_server(Identity.generate())
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    with pytest.raises(AccessDeniedError, match="identity proof failed"):
        run_handshake(client, server)


# --- out of order -------------------------------------------------------------


def test_proof_before_hello_is_a_protocol_refusal(identity: Identity) -> None:
    server = make_server(identity)
    reply = server.receive(wire(Proof(signature=b"\x00" * 64)))
    refusal = expect_refusal(reply, "protocol")
    assert "unexpected Proof" in refusal.message
    assert server.failed
    assert isinstance(server.error, ProtocolError)


@pytest.mark.parametrize(
    "message",
    [Ping(sent=1.0), Welcome(name="x"), Challenge(nonce=b"\x00" * 32, version=PROTOCOL_VERSION)],
    ids=lambda m: type(m).__name__,
)
def test_any_other_first_message_is_a_protocol_refusal(
    identity: Identity, message: Message
) -> None:
    expect_refusal(make_server(identity).receive(wire(message)), "protocol")


def test_a_request_after_the_handshake_is_not_taken_by_the_auth(
    identity: Identity, other_identity: Identity
) -> None:
    server = make_server(other_identity)
    run_handshake(ClientAuth(identity, "dialer", other_identity.public_key), server)
    expect_refusal(server.receive(wire(Ping(sent=1.0))), "protocol")


def test_a_second_hello_is_a_protocol_refusal(identity: Identity) -> None:
    server = make_server(identity)
    hello = Hello(version=PROTOCOL_VERSION, public_key=identity.public_key, name="x")
    assert isinstance(server.receive(wire(hello)), Challenge)
    expect_refusal(server.receive(wire(hello)), "protocol")


def test_nothing_is_accepted_after_a_refusal(identity: Identity) -> None:
    server = make_server(identity)
    server.receive(wire(Proof(signature=b"\x00" * 64)))
    hello = Hello(version=PROTOCOL_VERSION, public_key=identity.public_key, name="x")
    expect_refusal(server.receive(wire(hello)), "protocol")
    assert not server.done


def test_client_refuses_welcome_before_challenge(
    identity: Identity, other_identity: Identity
) -> None:
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    client.start(AuthForm.CHALLENGE)
    with pytest.raises(ProtocolError, match="unexpected Welcome"):
        client.receive(wire(Welcome(name="impostor")))
    assert not client.done
    assert client.server_name is None


def test_client_refuses_a_second_challenge(identity: Identity, other_identity: Identity) -> None:
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    client.start(AuthForm.CHALLENGE)
    challenge = Challenge(nonce=b"\x03" * 32, version=PROTOCOL_VERSION)
    client.receive(wire(challenge))
    with pytest.raises(ProtocolError, match="unexpected Challenge"):
        client.receive(wire(challenge))


# --- versions -----------------------------------------------------------------


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1])
def test_server_refuses_a_client_of_another_version(identity: Identity, version: int) -> None:
    server = make_server(identity)
    hello = Hello(version=version, public_key=identity.public_key, name="old")
    refusal = expect_refusal(wire(server.receive(wire(hello))), "protocol")
    assert f"you {version}" in refusal.message
    assert "upgrade GPUMesh" in refusal.message
    assert server.failed


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1])
def test_client_refuses_a_server_of_another_version(
    identity: Identity, other_identity: Identity, version: int
) -> None:
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    client.start(AuthForm.CHALLENGE)
    with pytest.raises(ProtocolError, match="upgrade GPUMesh") as info:
        client.receive(wire(Challenge(nonce=b"\x00" * 32, version=version)))
    assert f"version {version}" in str(info.value)
    assert not client.done


def test_client_raises_a_version_refusal_as_protocol_error(identity: Identity) -> None:
    server = make_server(identity)
    hello = Hello(version=PROTOCOL_VERSION + 1, public_key=identity.public_key, name="new")
    client = ClientAuth(identity, "new", identity.public_key)
    client.start(AuthForm.CHALLENGE)
    with pytest.raises(ProtocolError, match="upgrade"):
        client.receive(wire(server.receive(wire(hello))))


@pytest.mark.parametrize("code", ["denied", "not_paired", "protocol", "something_new"])
def test_client_rebuilds_any_refusal(identity: Identity, code: str) -> None:
    client = ClientAuth(identity, "dialer", identity.public_key)
    client.start(AuthForm.CHALLENGE)
    with pytest.raises(GPUMeshError, match="go away") as info:
        client.receive(wire(Refusal(code=code, message="go away")))
    expected = {"something_new": "error"}.get(code, code)
    assert info.value.code == expected


# --- the session-bound form -----------------------------------------------------


def test_session_proof_is_one_message_each_way_and_requests_need_not_wait(
    identity: Identity, other_identity: Identity
) -> None:
    binding = os.urandom(32)
    seen: list[bytes] = []
    server = make_session_server(other_identity, seen.append, binding)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    proof = client.start(AuthForm.SESSION, binding)
    assert isinstance(proof, SessionProof)
    assert (proof.version, proof.public_key, proof.name) == (
        PROTOCOL_VERSION,
        identity.public_key,
        "dialer",
    )
    # The first request may leave with the proof: no answer awaited first.
    assert client.may_send_requests and not client.done
    assert seen == []
    welcome = server.receive(wire(proof))
    assert welcome == Welcome(name="provider")
    assert server.done and server.client_key == identity.public_key
    assert server.client_name == "dialer"
    assert seen == [identity.public_key]
    assert client.receive(wire(welcome)) is None
    assert client.done and client.server_name == "provider"


def test_round_trips_before_the_first_request_session_zero_challenge_two(
    identity: Identity, other_identity: Identity
) -> None:
    binding = os.urandom(32)
    session = make_session_server(other_identity, binding=binding)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    assert run_handshake(client, session, binding) == 0
    assert client.done and session.done
    challenge = make_server(other_identity)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    assert run_handshake(client, challenge) == 2
    assert client.done and challenge.done


def test_session_proof_from_another_session_is_denied(
    identity: Identity, other_identity: Identity
) -> None:
    # A genuine proof, made for one TLS session and accepted there...
    first_binding, second_binding = b"\x01" * 32, b"\x02" * 32
    first = make_session_server(other_identity, binding=first_binding)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    proof = client.start(AuthForm.SESSION, first_binding)
    assert first.receive(wire(proof)) == Welcome(name="provider")
    # ...is worthless on another session with the same provider.
    authorized: list[bytes] = []
    second = make_session_server(other_identity, authorized.append, second_binding)
    refusal = expect_refusal(wire(second.receive(wire(proof))), "denied")
    assert "identity proof failed" in refusal.message
    assert second.failed and second.client_key == identity.public_key
    assert authorized == []


def test_session_proof_made_for_another_provider_is_denied(
    identity: Identity, other_identity: Identity
) -> None:
    # The binding alone would match (a relay of bytes); the provider key does not.
    binding = os.urandom(32)
    server = make_session_server(Identity.generate(), binding=binding)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    with pytest.raises(AccessDeniedError, match="identity proof failed"):
        run_handshake(client, server, binding)


def test_session_proof_signed_by_another_key_is_denied(
    identity: Identity, other_identity: Identity
) -> None:
    binding = os.urandom(32)
    server_identity = Identity.generate()
    authorized: list[bytes] = []
    server = make_session_server(server_identity, authorized.append, binding)
    transcript = session_transcript(binding, server_identity.public_key, identity.public_key)
    forged = SessionProof(
        version=PROTOCOL_VERSION,
        public_key=identity.public_key,
        name="x",
        signature=other_identity.sign(transcript),
    )
    expect_refusal(wire(server.receive(wire(forged))), "denied")
    assert authorized == []


def test_a_challenge_signature_is_no_session_proof(
    identity: Identity, other_identity: Identity
) -> None:
    # The same 32 bytes as a nonce and as a binding: the domains keep them apart.
    secret = os.urandom(32)
    server = make_session_server(other_identity, binding=secret)
    signature = identity.sign(
        challenge_transcript(secret, other_identity.public_key, identity.public_key)
    )
    proof = SessionProof(
        version=PROTOCOL_VERSION, public_key=identity.public_key, name="x", signature=signature
    )
    expect_refusal(wire(server.receive(wire(proof))), "denied")


@pytest.mark.parametrize("error_class", [AccessDeniedError, NotPairedError])
def test_session_refusal_reaches_the_client_as_the_same_class(
    identity: Identity, other_identity: Identity, error_class: type[AccessDeniedError]
) -> None:
    def authorize(_key: bytes) -> None:
        raise error_class("provider says no: ask its owner")

    binding = os.urandom(32)
    server = make_session_server(other_identity, authorize, binding)
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    with pytest.raises(error_class, match="provider says no"):
        run_handshake(client, server, binding)
    assert isinstance(server.error, error_class)
    assert not client.done


@pytest.mark.parametrize(
    "message",
    [
        Ping(sent=1.0),
        Hello(version=PROTOCOL_VERSION, public_key=b"\x00" * 32, name="x"),
        Proof(signature=b"\x00" * 64),
    ],
    ids=lambda m: type(m).__name__,
)
def test_a_session_provider_takes_only_a_session_proof(
    identity: Identity, message: Message
) -> None:
    server = make_session_server(identity)
    expect_refusal(server.receive(wire(message)), "protocol")
    assert server.failed


def test_a_challenge_provider_takes_no_session_proof(
    identity: Identity, other_identity: Identity
) -> None:
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    proof = client.start(AuthForm.SESSION, os.urandom(32))
    expect_refusal(make_server(other_identity).receive(wire(proof)), "protocol")


def test_a_session_provider_takes_one_proof_only(
    identity: Identity, other_identity: Identity
) -> None:
    binding = os.urandom(32)
    server = make_session_server(other_identity, binding=binding)
    proof = ClientAuth(identity, "dialer", other_identity.public_key).start(
        AuthForm.SESSION, binding
    )
    assert server.receive(wire(proof)) == Welcome(name="provider")
    expect_refusal(server.receive(wire(proof)), "protocol")


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1])
def test_session_provider_refuses_a_client_of_another_version(
    identity: Identity, version: int
) -> None:
    binding = os.urandom(32)
    server = make_session_server(identity, binding=binding)
    transcript = session_transcript(binding, identity.public_key, identity.public_key)
    proof = SessionProof(
        version=version,
        public_key=identity.public_key,
        name="x",
        signature=identity.sign(transcript),
    )
    refusal = expect_refusal(wire(server.receive(wire(proof))), "protocol")
    assert f"you {version}" in refusal.message and "upgrade GPUMesh" in refusal.message


def test_session_client_refuses_a_challenge(identity: Identity, other_identity: Identity) -> None:
    client = ClientAuth(identity, "dialer", other_identity.public_key)
    client.start(AuthForm.SESSION, os.urandom(32))
    with pytest.raises(ProtocolError, match="unexpected Challenge"):
        client.receive(wire(Challenge(nonce=b"\x00" * 32, version=PROTOCOL_VERSION)))
    assert not client.may_send_requests


def test_a_binding_of_the_wrong_size_is_refused(identity: Identity) -> None:
    client = ClientAuth(identity, "dialer", identity.public_key)
    with pytest.raises(ProtocolError, match="32 bytes"):
        client.start(AuthForm.SESSION, b"short")


@pytest.mark.parametrize("alpn", [None, "", "gpumesh/3", "h3"])
def test_an_unknown_alpn_names_no_form(alpn: str | None) -> None:
    with pytest.raises(ProtocolError, match="upgrade GPUMesh"):
        AuthForm.of(alpn)
    assert AuthForm.of("gpumesh/2") is AuthForm.SESSION
    assert AuthForm.of("gpumesh/1") is AuthForm.CHALLENGE


# --- FEC negotiation -------------------------------------------------------------


@pytest.mark.parametrize(
    ("client_fec", "server_fec"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_fec_is_on_only_where_both_sides_said_they_take_it(
    identity: Identity, other_identity: Identity, client_fec: bool, server_fec: bool
) -> None:
    binding = os.urandom(32)
    server = ServerAuth.for_session(other_identity, "provider", binding, allow_all, fec=server_fec)
    client = ClientAuth(identity, "dialer", other_identity.public_key, fec=client_fec)
    run_handshake(client, server, binding)
    assert server.client_fec is (client_fec and server_fec)
    assert client.server_fec is (client_fec and server_fec)


def test_fec_fields_are_invisible_to_a_peer_one_version_behind() -> None:
    import msgspec

    class OldWelcome(msgspec.Struct, tag_field="t", tag="welcome", frozen=True):
        name: str

    # An older provider's Welcome has no field: this version reads it as no FEC...
    old = msgspec.msgpack.encode(OldWelcome(name="provider"))
    welcome = decode_message(old)
    assert isinstance(welcome, Welcome) and welcome.fec_mac is False
    # ...and an older dialer decodes this version's Welcome, ignoring the field.
    new = encode_message(Welcome(name="provider", fec_mac=True))
    assert msgspec.msgpack.decode(new, type=OldWelcome).name == "provider"


def test_a_peer_of_the_untagged_fec_frames_gets_no_fec(
    identity: Identity, other_identity: Identity
) -> None:
    """A peer that predates the frames' tag says ``fec: true``: it would send and
    expect frames anyone on the path can forge, so neither side turns FEC on."""
    import msgspec

    class UntaggedWelcome(msgspec.Struct, tag_field="t", tag="welcome", frozen=True):
        name: str
        fec: bool

    class UntaggedProof(msgspec.Struct, tag_field="t", tag="session_proof", frozen=True):
        version: int
        public_key: bytes
        name: str
        signature: bytes
        fec: bool

    binding = os.urandom(32)
    # A provider of this version and a dialer of the untagged frames:
    server = ServerAuth.for_session(other_identity, "provider", binding, allow_all, fec=True)
    client = ClientAuth(identity, "dialer", other_identity.public_key, fec=True)
    proof = client.start(AuthForm.SESSION, binding)
    assert isinstance(proof, SessionProof) and proof.fec_mac
    untagged = UntaggedProof(
        version=proof.version,
        public_key=proof.public_key,
        name=proof.name,
        signature=proof.signature,
        fec=True,
    )
    welcome = server.receive(decode_message(msgspec.msgpack.encode(untagged)))
    assert server.done and not server.client_fec
    assert isinstance(welcome, Welcome) and not welcome.fec_mac
    # A dialer of this version and a provider of the untagged frames:
    client.receive(decode_message(msgspec.msgpack.encode(UntaggedWelcome("provider", fec=True))))
    assert not client.server_fec
