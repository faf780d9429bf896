"""Two and three real nodes on 127.0.0.1: pairing, the authenticated link, refusals.

Real QUIC over loopback UDP, real SQLite homes; no mocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest

from gpumesh.client.node import Node
from gpumesh.errors import (
    AccessDeniedError,
    ConnectionLostError,
    KeyMismatchError,
    NotPairedError,
    ProtocolError,
    UnreachableError,
)
from gpumesh.protocol.handshake import AuthForm, ClientAuth
from gpumesh.protocol.messages import ALPN, ALPN_CHALLENGE, Ping, Pong, StatusReply, StatusRequest
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.quic import QuicLink
from gpumesh.transport.session import accept_session, open_session
from gpumesh.transport.stream import Stream
from gpumesh.version import __version__
from tests.integration.conftest import arun, pair_both, sharing


def test_mutual_pairing_connects_and_reports_path_and_rtt(make_node) -> None:
    alice, bob = make_node("alice-pc"), make_node("bob-laptop")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            result = await bob.connect("alice-pc")
            assert result.path == "direct"
            assert result.address == f"127.0.0.1:{agent.address[1]}"
            assert result.remote.name == "alice-pc"
            assert result.remote.node_id == alice.info().node_id
            assert 0 < result.rtt_ms < 1000

    arun(scenario())
    # Both sides recorded the exchange: the dialer the address that worked.
    seen_by_bob = bob.peer("alice-pc")
    assert seen_by_bob.last_seen is not None
    assert seen_by_bob.last_address.startswith("127.0.0.1:")
    assert alice.peer("bob-laptop").last_seen is not None


def test_peer_addressed_by_id_prefix(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            prefix = alice.info().node_id[:6]
            result = await bob.connect(prefix)
            assert result.peer.name == "alice"

    arun(scenario())


def test_one_way_pairing_is_refused_as_not_paired(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice):
            bob.pair(alice.pairing_code())  # alice never pairs bob
            with pytest.raises(NotPairedError, match="alice has not paired with you"):
                await bob.connect("alice")

    arun(scenario())


def test_denied_peer_is_refused_and_allow_restores(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            alice.deny("bob")
            with pytest.raises(AccessDeniedError, match="alice has denied you access"):
                await bob.connect("alice")
            alice.allow("bob")
            assert (await bob.connect("alice")).remote.name == "alice"

    arun(scenario())


def test_deny_closes_an_open_connection_within_one_second(make_node, tmp_path) -> None:
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")
    # `gpumesh deny` runs in another process: use a separate store connection.
    alice_cli = Node(tmp_path / "alice")

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            pair_both(alice, carol)
            async with bob.session("alice") as bob_session, carol.session("alice") as carol_s:
                assert isinstance(await bob_session.request(Ping(sent=1.0)), Pong)
                denied_at = time.monotonic()
                alice_cli.deny("bob")
                # The promise is "within a second" (bench figures); on a loaded CI
                # machine the verdict only asks that it happens, under a generous ceiling.
                error = await asyncio.wait_for(bob_session.link.wait_closed(), 10.0)
                assert time.monotonic() - denied_at < 10.0
                assert isinstance(error, AccessDeniedError)
                assert "revoked" in error.message
                with pytest.raises(AccessDeniedError):
                    await bob_session.request(Ping(sent=2.0))
                # Another peer's open connection is untouched.
                assert isinstance(await carol_s.request(StatusRequest()), StatusReply)

    try:
        arun(scenario())
    finally:
        alice_cli.close()


def test_every_request_is_checked_not_only_the_first(make_node, tmp_path) -> None:
    """Even if the revocation watcher has not run yet, the next request is refused."""
    alice, bob = make_node("alice"), make_node("bob")
    alice_cli = Node(tmp_path / "alice")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            async with bob.session("alice") as session:
                agent._links.clear()  # blind the watcher: only the per-request check remains
                alice_cli.deny("bob")
                with pytest.raises(AccessDeniedError):
                    await session.request(Ping(sent=1.0))

    try:
        arun(scenario())
    finally:
        alice_cli.close()


def test_nothing_listening_fails_fast_with_a_clear_message(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    # A long dial timeout: failing well before it means the refusal was noticed.
    bob.home.config.set("connect_timeout", "60")
    bob.home.config.save()

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
        # alice stopped sharing: the port is closed now.
        started = time.monotonic()
        with pytest.raises(UnreachableError, match="nothing is listening"):
            await bob.connect("alice")
        assert time.monotonic() - started < 20

    arun(scenario())


def test_silent_address_times_out_in_seconds_not_a_hang(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    bob.home.config.set("connect_timeout", "60")  # the 1 s asked for below is what counts
    bob.home.config.save()
    # A bound UDP socket that never answers: like a firewall that drops packets.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        port = blackhole.getsockname()[1]

        async def scenario() -> None:
            async with sharing(alice):
                pair_both(alice, bob)
            bob.home.store._execute(
                "UPDATE peers SET addresses = ?, last_address = ''",
                (f'["127.0.0.1:{port}"]',),
            )
            started = time.monotonic()
            with pytest.raises(
                UnreachableError, match=r"no answer from 127\.0\.0\.1:\d+ within 1s"
            ):
                await bob.connect("alice", timeout=1.0)
            assert time.monotonic() - started < 20  # not the 60 s connect_timeout

        arun(scenario())


def test_server_with_another_key_is_refused_as_key_mismatch(make_node, tmp_path) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            port = agent.address[1]
        # Someone else now answers on alice's address with a different key.
        impostor = Node(tmp_path / "impostor")
        impostor.init("alice")
        impostor.pair(bob.pairing_code())
        from gpumesh.agent.server import Agent

        fake = Agent(impostor.home, host="127.0.0.1", port=port)
        await fake.start()
        try:
            with pytest.raises(KeyMismatchError, match="different key than the one you paired"):
                await bob.connect("alice")
        finally:
            fake.stop()
            impostor.close()

    arun(scenario())


def test_another_node_at_one_address_does_not_stop_the_dial_at_the_next(
    make_node, tmp_path
) -> None:
    # A pairing code lists 127.0.0.1 beside the LAN address: a dialer that shares on
    # the same port reaches its own node there first. That wrong key must not end
    # the dial while another address may be the peer's.
    alice, bob = make_node("alice"), make_node("bob")
    impostor = Node(tmp_path / "impostor")
    impostor.init("carol")

    async def scenario() -> None:
        from gpumesh.agent.server import Agent

        fake = Agent(impostor.home, host="127.0.0.1", port=0)
        await fake.start()
        try:
            async with sharing(alice) as agent:
                pair_both(alice, bob)
                peer = bob.home.store.find_peer("alice")
                wrong, right = (f"127.0.0.1:{a.address[1]}" for a in (fake, agent))
                bob.home.store.save_peer(peer.public_key, "alice", [wrong, right], "")
                assert bob.home.store.find_peer("alice").dial_addresses()[0] == wrong
                result = await bob.connect("alice", timeout=10)
                assert (result.path, result.address) == ("direct", right)
                assert result.peer.name == "alice"
        finally:
            fake.stop()
            impostor.close()

    arun(scenario())


def test_three_nodes_each_pair_has_its_own_access(make_node) -> None:
    alice, bob, carol = make_node("alice"), make_node("bob"), make_node("carol")

    async def scenario() -> None:
        async with sharing(alice), sharing(bob):
            pair_both(alice, bob)
            pair_both(alice, carol)
            carol.pair(bob.pairing_code())  # carol -> bob one way only
            assert (await bob.connect("alice")).remote.name == "alice"
            assert (await carol.connect("alice")).remote.name == "alice"
            assert (await alice.connect("bob")).remote.name == "bob"
            with pytest.raises(NotPairedError):
                await carol.connect("bob")
            alice.deny("carol")
            with pytest.raises(AccessDeniedError):
                await carol.connect("alice")
            assert (await bob.connect("alice")).remote.name == "alice"

    arun(scenario())


def test_bulk_stream_delivers_every_byte(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice):
            pair_both(alice, bob)
            result = await bob.throughput("alice", 48 * 1024 * 1024 + 12345)
            assert result.bytes == 48 * 1024 * 1024 + 12345

    arun(scenario())


def test_closing_the_agent_ends_open_sessions(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            async with bob.session("alice") as session:
                agent.stop()
                error = await asyncio.wait_for(session.link.wait_closed(), 30.0)
                assert isinstance(error, ConnectionLostError)

    arun(scenario())


def test_connection_floods_from_one_source_are_rate_limited(make_node) -> None:
    from gpumesh.agent.ratelimit import ConnectionLimiter
    from gpumesh.agent.server import Agent
    from gpumesh.protocol.admission import DropReason

    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        # quiet_burst=0: every new connection validates its address with a Retry
        # first, as they all do under a flood; then its address's budget applies.
        limiter = ConnectionLimiter(rate=0.01, burst=2, quiet_burst=0)
        agent = Agent(alice.home, host="127.0.0.1", port=0, limiter=limiter)
        await agent.start()
        try:
            pair_both(alice, bob)
            for _ in range(2):
                assert (await bob.connect("alice", pings=1)).remote.name == "alice"
            # The third new connection from 127.0.0.1 gets no answer at all.
            with pytest.raises(UnreachableError, match="no answer"):
                await bob.connect("alice", timeout=1.0)
            assert agent.refusals.totals[DropReason.OVER_RATE] >= 1
        finally:
            agent.stop()

    arun(scenario())


# --- the identity proof's two forms ------------------------------------------------


def test_the_first_request_leaves_with_the_proof_and_its_reply_with_the_welcome(
    make_node,
) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            session = await open_session(
                bob.home.identity, "bob", [agent.address], alice.home.identity.public_key
            )
            try:
                # Returned without reading a Welcome: nothing was awaited after the
                # QUIC handshake but sending the proof.
                assert session.link.alpn == ALPN
                assert not session.welcomed
                assert isinstance(await session.request(Ping(sent=1.0)), Pong)
                assert session.welcomed
                assert session.peer_name == "alice"
            finally:
                session.close()

    arun(scenario())


def test_a_dialer_one_version_behind_still_connects(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            pair_both(alice, bob)
            server_key = alice.home.identity.public_key
            # What the previous release does: offer gpumesh/1 only, answer the challenge.
            link = await QuicEndpoint.dial(
                agent.address, expected_key=server_key, timeout=3, alpns=(ALPN_CHALLENGE,)
            )
            try:
                assert link.alpn == ALPN_CHALLENGE
                auth = ClientAuth(bob.home.identity, "bob", server_key)
                stream = link.open_stream()
                stream.send_message(auth.start(AuthForm.CHALLENGE))
                proof = auth.receive(await stream.read_message())
                assert proof is not None
                stream.send_message(proof, end=True)
                assert auth.receive(await stream.read_message()) is None
                assert auth.done and auth.server_name == "alice"
                request = link.open_stream()
                request.send_message(Ping(sent=1.0), end=True)
                assert isinstance(await request.read_message(), Pong)
            finally:
                link.close()

    arun(scenario())


def test_a_provider_one_version_behind_still_serves(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")
    alice_id = alice.home.identity
    proven: list[bytes] = []

    async def serve(link: QuicLink) -> None:
        # What the previous release's provider does: gpumesh/1 only, challenge first.
        accepted = await accept_session(link, alice_id, "alice", proven.append)
        assert accepted.early == []

        async def answer(stream: Stream) -> None:
            ping = await stream.expect(Ping)
            stream.send_message(Pong(sent=ping.sent, time=1.0), end=True)

        link.on_stream = lambda stream: tasks.add(asyncio.ensure_future(answer(stream)))

    tasks: set[asyncio.Future[None]] = set()

    async def scenario() -> None:
        old = QuicEndpoint.listen(
            alice_id,
            "127.0.0.1",
            0,
            on_link=lambda link: tasks.add(asyncio.ensure_future(serve(link))),
            alpns=(ALPN_CHALLENGE,),
        )
        try:
            session = await open_session(
                bob.home.identity, "bob", [old.local_address], alice_id.public_key
            )
            try:
                assert session.link.alpn == ALPN_CHALLENGE
                assert session.welcomed  # this form waits for it before any request
                assert isinstance(await session.request(Ping(sent=1.0)), Pong)
                assert proven == [bob.home.identity.public_key]
            finally:
                session.close()
        finally:
            old.close()

    arun(scenario())


def test_a_refusal_reaches_every_request_sent_with_the_proof(make_node) -> None:
    alice, bob = make_node("alice"), make_node("bob")

    async def scenario() -> None:
        async with sharing(alice) as agent:
            bob.pair(alice.pairing_code())  # alice never paired back
            session = await open_session(
                bob.home.identity, "bob", [agent.address], alice.home.identity.public_key
            )
            try:
                # As a copy or a shell would: no wait for a Welcome. Under load the
                # refusal may already be in (the link closed with it): then opening
                # the stream is what tells it.
                raw: Stream | None = None
                with contextlib.suppress(NotPairedError):
                    raw = session.open_stream()
                    raw.send_message(Ping(sent=0.0), end=True)
                requests = [
                    asyncio.ensure_future(session.request(Ping(sent=float(i)))) for i in range(3)
                ]
                results = await asyncio.gather(*requests, return_exceptions=True)
                assert all(isinstance(result, NotPairedError) for result in results), results
                if raw is not None:
                    with pytest.raises(NotPairedError):
                        await raw.read_message()
                with pytest.raises(NotPairedError, match="has not paired with you"):
                    await session.established()
            finally:
                session.close()

    arun(scenario())


def test_a_peer_that_shares_no_protocol_version_is_named_as_such(make_node) -> None:
    """A provider that dropped every connection protocol this node speaks (a much
    newer release): the dial fails with the versions named and what to do, not
    with the TLS library's words."""
    alice, bob = make_node("alice"), make_node("bob")
    alice_id = alice.home.identity

    async def scenario() -> None:
        newer = QuicEndpoint.listen(
            alice_id, "127.0.0.1", 0, on_link=lambda link: None, alpns=("gpumesh/9",)
        )
        try:
            with pytest.raises(ProtocolError) as caught:
                await open_session(
                    bob.home.identity, "bob", [newer.local_address], alice_id.public_key, timeout=5
                )
        finally:
            newer.close()
        message = caught.value.message
        assert f"({ALPN}, {ALPN_CHALLENGE}; GPUMesh {__version__})" in message
        assert message.endswith("upgrade GPUMesh on the older side")

    arun(scenario())
