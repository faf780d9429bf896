"""Clients that do not follow the protocol, against a real agent on loopback.

Each test speaks raw QUIC to the agent (our transport, without the client
layer) to skip or fake the identity proof or to send oversize frames, and
checks the typed refusal and that nothing was served. The proof comes in two
forms (see :mod:`gpumesh.protocol.handshake`): bound to the TLS session (what
nodes speak now) and answering a challenge (a dialer one version behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator

import pytest

from gpumesh.errors import (
    AccessDeniedError,
    ConnectionLostError,
    FrameTooLargeError,
    GPUMeshError,
    LimitError,
    NotPairedError,
    ProtocolError,
)
from gpumesh.identity.keys import Identity
from gpumesh.protocol.framing import FrameKind, encode_frame
from gpumesh.protocol.handshake import challenge_transcript, session_transcript
from gpumesh.protocol.messages import (
    ALPN,
    ALPN_CHALLENGE,
    ALPNS,
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    Ping,
    Pong,
    Proof,
    SessionProof,
    Welcome,
    encode_message,
)
from gpumesh.transport import session as session_module
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.quic import QuicLink
from gpumesh.transport.session import open_session
from gpumesh.transport.stream import Stream
from tests.integration.conftest import arun, pair_both, sharing, until_async

CHALLENGE = (ALPN_CHALLENGE,)
"""What a dialer one version behind offers."""


@contextlib.asynccontextmanager
async def raw_link(
    agent_address: tuple[str, int], server_key: bytes, alpns: tuple[str, ...] = ALPNS
) -> AsyncIterator[QuicLink]:
    """A QUIC link to the agent with no identity proof done: the test speaks for itself."""
    link = await QuicEndpoint.dial(agent_address, expected_key=server_key, timeout=3, alpns=alpns)
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
            async with raw_link(agent.address, alice.home.identity.public_key, CHALLENGE) as link:
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
            async with raw_link(agent.address, alice.home.identity.public_key, CHALLENGE) as link:
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
                transcript = challenge_transcript(
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
            async with raw_link(agent.address, server_key, CHALLENGE) as first:
                stream = first.open_stream()
                stream.send_message(hello)
                challenge = await stream.expect(Challenge)
                proof = Proof(
                    signature=bob_id.sign(
                        challenge_transcript(challenge.nonce, server_key, bob_id.public_key)
                    )
                )
                stream.send_message(proof, end=True)
                await stream.expect(Welcome)
            # ...replayed later: the provider picked a fresh nonce, so it fails.
            async with raw_link(agent.address, server_key, CHALLENGE) as second:
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
            async with raw_link(agent.address, server_key, CHALLENGE) as link:
                stream = link.open_stream()
                stream.send_message(
                    Hello(version=PROTOCOL_VERSION, public_key=stranger.public_key, name="stranger")
                )
                challenge = await stream.expect(Challenge)
                transcript = challenge_transcript(challenge.nonce, server_key, stranger.public_key)
                stream.send_message(Proof(signature=stranger.sign(transcript)), end=True)
                with pytest.raises(NotPairedError):
                    await stream.read_message()
                error = await asyncio.wait_for(link.wait_closed(), 2)
                assert isinstance(error, NotPairedError)

    arun(scenario())


def session_proof(identity: Identity, link: QuicLink, server_key: bytes) -> SessionProof:
    """A genuine proof of ``identity``'s key, bound to ``link``'s TLS session."""
    transcript = session_transcript(link.binding, server_key, identity.public_key)
    return SessionProof(
        version=PROTOCOL_VERSION,
        public_key=identity.public_key,
        name="bob",
        signature=identity.sign(transcript),
    )


def test_session_proof_replayed_on_another_connection_is_refused(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            server_key = alice.home.identity.public_key
            # A genuine proof, captured from one session, where it works...
            async with raw_link(agent.address, server_key) as first:
                assert first.alpn == ALPN
                proof = session_proof(bob.home.identity, first, server_key)
                stream = first.open_stream()
                stream.send_message(proof, end=True)
                request = first.open_stream()
                request.send_message(Ping(sent=1.0), end=True)
                assert await stream.expect(Welcome) == Welcome(name="alice")
                assert isinstance(await request.read_message(), Pong)
            # ...presented on another session, with a request right behind it.
            async with raw_link(agent.address, server_key) as second:
                assert second.binding != first.binding
                stream = second.open_stream()
                stream.send_message(proof, end=True)
                request = second.open_stream()
                request.send_message(Ping(sent=2.0), end=True)
                with pytest.raises(AccessDeniedError, match="identity proof failed"):
                    await stream.read_message()
                with pytest.raises(AccessDeniedError):  # never served: the link closed
                    await asyncio.wait_for(request.read_message(), 3)
            # Closed links leave the agent once QUIC lets them go: wait (a bound on a
            # hang, not a verdict on speed), then nothing may be left of either.
            await until_async(lambda: not agent._links, "the agent to drop the links", within=30)
            assert not agent._links

    arun(scenario())


def test_session_proof_relayed_by_a_man_in_the_middle_is_refused(make_node) -> None:
    # Bob dials mallory (a node he paired with); she presents his proof to alice.
    alice, bob = make_node("alice"), make_node("bob")
    mallory = Identity.generate()

    async def scenario() -> None:
        captured: asyncio.Future[SessionProof] = asyncio.get_running_loop().create_future()

        async def capture(link: QuicLink) -> None:
            await link.connected
            link.on_stream = lambda stream: asyncio.ensure_future(read_proof(stream))

        async def read_proof(stream: Stream) -> None:
            message = await stream.read_message()
            if isinstance(message, SessionProof) and not captured.done():
                captured.set_result(message)

        tasks: set[asyncio.Task[None]] = set()
        trap = QuicEndpoint.listen(
            mallory,
            "127.0.0.1",
            0,
            on_link=lambda link: tasks.add(asyncio.ensure_future(capture(link))),
        )
        try:
            async with sharing(alice) as agent:
                pair_both(alice, bob)
                session = await open_session(
                    bob.home.identity, "bob", [trap.local_address], mallory.public_key
                )
                proof = await asyncio.wait_for(captured, 3)
                session.close()
                assert proof.public_key == bob.home.identity.public_key
                async with raw_link(agent.address, alice.home.identity.public_key) as link:
                    stream = link.open_stream()
                    stream.send_message(proof, end=True)
                    with pytest.raises(AccessDeniedError, match="identity proof failed"):
                        await stream.read_message()
        finally:
            trap.close()

    arun(scenario())


def test_claiming_an_allowed_key_in_a_session_proof_is_refused_and_serves_nothing(
    make_node,
) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    mallory = Identity.generate()

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            server_key = alice.home.identity.public_key
            async with raw_link(agent.address, server_key) as link:
                # Mallory claims bob's key, signs with hers, and asks for something at once.
                forged = session_proof(mallory, link, server_key)
                stream = link.open_stream()
                stream.send_message(
                    SessionProof(
                        version=PROTOCOL_VERSION,
                        public_key=bob.home.identity.public_key,
                        name="bob",
                        signature=forged.signature,
                    ),
                    end=True,
                )
                early = []
                for index in range(3):
                    early.append(request := link.open_stream())
                    request.send_message(Ping(sent=float(index)), end=True)
                with pytest.raises(AccessDeniedError, match="identity proof failed"):
                    await stream.read_message()
                for request in early:
                    with pytest.raises(GPUMeshError):
                        await asyncio.wait_for(request.read_message(), 3)
            # Closed links leave the agent once QUIC lets them go: wait (a bound on a
            # hang, not a verdict on speed), then nothing may be left of either.
            await until_async(lambda: not agent._links, "the agent to drop the links", within=30)
            assert not agent._links

    arun(scenario())


def test_a_stranger_with_a_valid_session_proof_is_not_paired_and_served_nothing(
    make_node,
) -> None:
    alice = make_node("alice")
    stranger = Identity.generate()

    async def scenario() -> None:
        async with sharing(alice) as agent:
            server_key = alice.home.identity.public_key
            async with raw_link(agent.address, server_key) as link:
                stream = link.open_stream()
                stream.send_message(session_proof(stranger, link, server_key), end=True)
                # More requests than a dialer may send with its proof: past them, reset.
                early = []
                for _ in range(session_module.EARLY_REQUESTS + 2):
                    early.append(request := link.open_stream())
                    request.send_message(Ping(sent=1.0), end=True)
                with pytest.raises(NotPairedError):
                    await stream.read_message()
                for request in early:
                    with pytest.raises(GPUMeshError):
                        await asyncio.wait_for(request.read_message(), 3)
                error = await asyncio.wait_for(link.wait_closed(), 2)
                assert isinstance(error, NotPairedError)

    arun(scenario())


def test_an_unproven_link_holds_at_most_the_early_buffer(make_node, monkeypatch) -> None:
    monkeypatch.setattr(session_module, "AUTH_TIMEOUT", 2.0)
    alice = make_node("alice")

    async def scenario() -> None:
        async with (
            sharing(alice) as agent,
            raw_link(agent.address, alice.home.identity.public_key) as link,
        ):
            # No proof, and two early requests of 6 MiB of bulk data each (under one
            # stream's window, over the early buffer together). Stream 0 carries a
            # proof's frame header and never its body.
            link.send(link.open_stream().stream_id, struct.pack("!BI", FrameKind.MESSAGE, 100))
            streams = []
            for _ in range(2):
                streams.append(stream := link.open_stream())
                stream.send_message(Ping(sent=1.0))
                await stream.send_data(bytes(6 * 1024 * 1024))
            # The second is ended (refused, and reset as it goes on sending); the
            # provider keeps the first, and no more than the early buffer in all.
            with pytest.raises((LimitError, ConnectionLostError)):
                await asyncio.wait_for(streams[1].read_message(), 3)
            (unproven,) = agent.endpoint.links
            for _ in range(300):  # until all of the first arrived (a ceiling, not a timing)
                if unproven.held() >= 6 * 1024 * 1024:
                    break
                await asyncio.sleep(0.01)
            assert 6 * 1024 * 1024 <= unproven.held() <= session_module.EARLY_BUFFER
            error = await asyncio.wait_for(link.wait_closed(), 4)
            assert isinstance(error, AccessDeniedError)
            assert "not completed in time" in error.message

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
