"""A relayed session's bulk crosses the relay in runs, and loses nothing there.

Real QUIC over real UDP on loopback, with a real relay (in-process) whose socket
reads every datagram on its own (no receive offload): that is how datagrams
arrive at a relay from a real link (the WAN lab's TUN device hands them over one
by one), unlike loopback, where a sender's GSO buffer arrives whole. Punching is
off at both ends (no candidates), so every byte of a bulk upload goes through the
relay.

Why this matters: the relay is one more Python process on each datagram's way.
Measured on the 2-core machine, it spent 23 us of CPU per datagram forwarded one
by one (a ``sendto`` each, and the node behind it a ``recvmsg`` each); sending
each wake-up's packets to one node as runs (one GSO write, read back with one
GRO read) cut that to 13 us. If forwarding goes back to one write per datagram,
``writes`` comes close to ``packets_sent`` here. And a relayed session must keep
the window of a direct one: any packet the relay drops or reorders shows up as a
loss that QUIC takes for congestion.
"""

from __future__ import annotations

import asyncio
import os

from gpumesh.identity.keys import Identity
from gpumesh.protocol.punch import PunchConfig
from gpumesh.relay.config import RelayConfig
from gpumesh.relay.server import RelayServer, serve
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.quic import QuicLink, Recovery
from gpumesh.transport.relayclient import RelayClient, dial_relayed
from tests.integration.window import UPLOAD, Receiver, assert_kept_slow_start

NO_PUNCHING = PunchConfig(max_candidates=0)


async def _relayed_upload() -> tuple[str, Recovery, RelayServer, bytes]:
    relay = await serve(RelayConfig(host="127.0.0.1", port=0, open=True), receive_offload=False)
    provider = Identity.generate()
    consumer = Identity.generate()
    receiver = Receiver()
    endpoint = QuicEndpoint.listen(provider, "127.0.0.1", 0, on_link=receiver.on_link)
    serving = RelayClient(
        endpoint,
        relay.address,
        "test relay",
        provider,
        serving=True,
        authorize=lambda key: key == consumer.public_key,
        punch_config=NO_PUNCHING,
    )
    endpoint.relay = serving
    serving.start()
    link: QuicLink | None = None
    try:
        await serving.wait_registered(10)

        def make_client(dialer: QuicEndpoint) -> RelayClient:
            return RelayClient(
                dialer,
                relay.address,
                "test relay",
                consumer,
                serving=False,
                punch_config=NO_PUNCHING,
            )

        link, _path = await dial_relayed(
            make_client, provider.public_key, timeout=10, local_host="127.0.0.1"
        )
        payload = os.urandom(UPLOAD)
        stream = link.open_stream()
        await stream.send_data(payload)
        stream.end_data()
        await asyncio.wait_for(receiver.done.wait(), 60)
        assert bytes(receiver.received) == payload
        described = link.describe_path()
        recovery = link.recovery()
        assert recovery is not None
        return described, recovery, relay, payload
    finally:
        if link is not None:
            link.close()
        receiver.cancel()
        endpoint.close()
        relay.close()


def test_a_relayed_upload_crosses_the_relay_in_runs_and_keeps_its_window() -> None:
    described, recovery, relay, _ = asyncio.run(_relayed_upload())
    assert described == "relayed via test relay"
    # Every datagram of the upload went through the relay, one by one into it ...
    assert relay.packets_sent > UPLOAD // 1500
    # ... and out of it in runs: a few packets per write at the very least (the
    # sender's bursts are up to 64 datagrams; one write each would make these equal).
    assert relay.writes * 4 < relay.packets_sent, (relay.writes, relay.packets_sent)
    assert relay.dropped == 0
    assert_kept_slow_start(recovery)
