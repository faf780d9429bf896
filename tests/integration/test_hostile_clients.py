"""Clients that do not follow the protocol, against a real agent on loopback.

Each test speaks raw QUIC to the agent (our transport, without the client
layer) to skip or fake the identity proof or to send oversize frames, and
checks the typed refusal and that nothing was served.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator

import pytest

from gpumesh.errors import (
    AccessDeniedError,
    FrameTooLargeError,
    GPUMeshError,
    NotPairedError,
    ProtocolError,
)
from gpumesh.identity.keys import Identity
from gpumesh.protocol.framing import FrameKind, encode_frame
from gpumesh.protocol.handshake import auth_transcript
from gpumesh.protocol.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    Ping,
    Pong,
    Proof,
    Welcome,
    encode_message,
)
from gpumesh.transport import session as session_module
from gpumesh.transport.quic import QuicEndpoint, QuicLink
from tests.integration.conftest import arun, pair_both, sharing


@contextlib.asynccontextmanager
async def raw_link(agent_address: tuple[str, int], server_key: bytes) -> AsyncIterator[QuicLink]:
    """A QUIC link to the agent with no identity proof done: the test speaks for itself."""
    link = await QuicEndpoint.dial(agent_address, expected_key=server_key, timeout=3)
    try:
        yield link
    finally:
        link.close()


def test_request_without_identity_proof_is_refused(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            async with raw_link(agent.address, alice.home.identity.public_key) as link:
                stream = link.open_stream()
                stream.send_message(Ping(sent=1.0), end=True)
                with pytest.raises(ProtocolError, match="identity proof before any request"):
                    await stream.read_message()
                error = await asyncio.wait_for(link.wait_closed(), 2)
                assert isinstance(error, ProtocolError)

    arun(scenario())


def test_second_stream_before_proof_gets_nothing(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            async with raw_link(agent.address, alice.home.identity.public_key) as link:
                auth_stream = link.open_stream()
                auth_stream.send_message(
                    Hello(
                        version=PROTOCOL_VERSION,
                        public_key=bob.home.identity.public_key,
                        name="bob",
                    )
                )
                await auth_stream.expect(Challenge)
                sneaky = link.open_stream()
                sneaky.send_message(Ping(sent=1.0), end=True)
                with pytest.raises(GPUMeshError):
                    await asyncio.wait_for(sneaky.read_message(), 2)

    arun(scenario())


def test_claiming_an_allowed_key_without_its_private_key_is_refused(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    mallory = Identity.generate()

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            async with raw_link(agent.address, alice.home.identity.public_key) as link:
                stream = link.open_stream()
                # Mallory claims bob's key but can only sign with her own.
                stream.send_message(
                    Hello(
                        version=PROTOCOL_VERSION,
                        public_key=bob.home.identity.public_key,
                        name="bob",
                    )
                )
                challenge = await stream.expect(Challenge)
                transcript = auth_transcript(
                    challenge.nonce, alice.home.identity.public_key, bob.home.identity.public_key
                )
                stream.send_message(Proof(signature=mallory.sign(transcript)))
                with pytest.raises(AccessDeniedError, match="identity proof failed"):
                    await stream.read_message()

    arun(scenario())


def test_proof_replayed_on_a_new_connection_is_refused(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            server_key = alice.home.identity.public_key
            bob_id = bob.home.identity
            hello = Hello(version=PROTOCOL_VERSION, public_key=bob_id.public_key, name="bob")
            # A genuine exchange, recorded by an eavesdropper...
            async with raw_link(agent.address, server_key) as first:
                stream = first.open_stream()
                stream.send_message(hello)
                challenge = await stream.expect(Challenge)
                proof = Proof(
                    signature=bob_id.sign(
                        auth_transcript(challenge.nonce, server_key, bob_id.public_key)
                    )
                )
                stream.send_message(proof, end=True)
                await stream.expect(Welcome)
            # ...replayed later: the provider picked a fresh nonce, so it fails.
            async with raw_link(agent.address, server_key) as second:
                stream = second.open_stream()
                stream.send_message(hello)
                await stream.expect(Challenge)
                stream.send_message(proof, end=True)
                with pytest.raises(AccessDeniedError, match="identity proof failed"):
                    await stream.read_message()

    arun(scenario())


def test_unknown_key_with_valid_proof_is_refused_as_not_paired(make_node) -> None:
    alice = make_node("alice")
    stranger = Identity.generate()

    async def scenario() -> None:
        async with sharing(alice) as agent:
            server_key = alice.home.identity.public_key
            async with raw_link(agent.address, server_key) as link:
                stream = link.open_stream()
                stream.send_message(
                    Hello(version=PROTOCOL_VERSION, public_key=stranger.public_key, name="stranger")
                )
                challenge = await stream.expect(Challenge)
                transcript = auth_transcript(challenge.nonce, server_key, stranger.public_key)
                stream.send_message(Proof(signature=stranger.sign(transcript)), end=True)
                with pytest.raises(NotPairedError):
                    await stream.read_message()
                error = await asyncio.wait_for(link.wait_closed(), 2)
                assert isinstance(error, NotPairedError)

    arun(scenario())


def test_silent_connection_is_dropped_after_the_auth_timeout(make_node, monkeypatch) -> None:
    monkeypatch.setattr(session_module, "AUTH_TIMEOUT", 0.5)
    alice = make_node("alice")

    async def scenario() -> None:
        async with (
            sharing(alice) as agent,
            raw_link(agent.address, alice.home.identity.public_key) as link,
        ):
            error = await asyncio.wait_for(link.wait_closed(), 3)
            assert isinstance(error, AccessDeniedError)
            assert "not completed in time" in error.message

    arun(scenario())


def test_oversize_frame_is_refused_with_its_code(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            async with bob.session("alice") as session:
                stream = session.open_stream()
                # Announce a 10 MB message; the provider must refuse before reading it.
                session.link.send(stream.stream_id, struct.pack("!BI", FrameKind.MESSAGE, 10**7))
                with pytest.raises(FrameTooLargeError, match="over the 65536-byte limit"):
                    await asyncio.wait_for(stream.read_message(), 3)
                # The link stays usable for well-formed requests.
                assert isinstance(await session.request(Ping(sent=1.0)), Pong)

    arun(scenario())


def test_garbage_message_is_refused_as_protocol_error(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            async with bob.session("alice") as session:
                stream = session.open_stream()
                session.link.send(
                    stream.stream_id, encode_frame(FrameKind.MESSAGE, b"\xc1\xc1\xc1"), True
                )
                with pytest.raises(ProtocolError, match="undecodable"):
                    await asyncio.wait_for(stream.read_message(), 3)
                # A valid message that is not a request is refused too.
                stream = session.open_stream()
                session.link.send(
                    stream.stream_id,
                    encode_frame(FrameKind.MESSAGE, encode_message(Welcome(name="x"))),
                    True,
                )
                with pytest.raises(ProtocolError, match="not a request this node serves"):
                    await asyncio.wait_for(stream.read_message(), 3)

    arun(scenario())
