"""A hole-punched session's QUIC connection keeps the window of a direct one.

Real QUIC over real UDP on loopback, with a real relay (in-process): a dialer
reaches a provider through the relay, punching moves the session to the direct
address underneath QUIC, and a bulk upload runs over it. On a lossless link the
move must cost QUIC nothing: no packet declared lost, and the congestion window
still in slow start after the upload.

Why this matters: qh3's congestion control leaves slow start at the first loss
and then grows its window by one datagram per round trip. A hole-punched copy
over the WAN lab once lost the handshake's first 1-RTT packets (the lab's
firewall rule dropped the dialer's last Initial, and with it the client Finished
sent in the same GSO buffer), so it left slow start at a window of 12 KB and ran
at a fifth of a direct copy's speed for the whole transfer. Anything that drops
or strands packets at the switch (a path used before the peer maps it, packets
from the punched address taken for a stranger's) shows up here as a loss.
"""

from __future__ import annotations

import asyncio
import os

from gpumesh.identity.keys import Identity
from gpumesh.relay.config import RelayConfig
from gpumesh.relay.server import serve
from gpumesh.transport.endpoint import QuicEndpoint
from gpumesh.transport.quic import QuicLink, Recovery
from gpumesh.transport.relayclient import RelayClient, dial_relayed
from tests.integration.window import UPLOAD, Receiver, assert_kept_slow_start


async def _punched_upload() -> tuple[str, Recovery]:
    relay = await serve(RelayConfig(host="127.0.0.1", port=0, open=True))
    relay_address = relay.address
    provider = Identity.generate()
    consumer = Identity.generate()
    receiver = Receiver()
    endpoint = QuicEndpoint.listen(provider, "127.0.0.1", 0, on_link=receiver.on_link)
    port = endpoint.local_address[1]
    serving = RelayClient(
        endpoint,
        relay_address,
        "test relay",
        provider,
        serving=True,
        candidates=lambda: [f"127.0.0.1:{port}"],
        authorize=lambda key: key == consumer.public_key,
    )
    endpoint.relay = serving
    serving.start()
    link: QuicLink | None = None
    try:
        await serving.wait_registered(10)

        def make_client(dialer: QuicEndpoint) -> RelayClient:
            local = dialer.local_address[1]
            return RelayClient(
                dialer,
                relay_address,
                "test relay",
                consumer,
                serving=False,
                candidates=lambda: [f"127.0.0.1:{local}"],
            )

        link, path = await dial_relayed(
            make_client, provider.public_key, timeout=10, local_host="127.0.0.1"
        )
        await asyncio.wait_for(path.settled.wait(), 10)
        described = link.describe_path()
        stream = link.open_stream()
        await stream.send_data(os.urandom(UPLOAD))
        stream.end_data()
        await asyncio.wait_for(receiver.done.wait(), 60)
        recovery = link.recovery()
        assert recovery is not None
        return described, recovery
    finally:
        if link is not None:
            link.close()
        receiver.cancel()
        endpoint.close()
        relay.close()


def test_a_punched_session_loses_nothing_at_the_switch_and_stays_in_slow_start() -> None:
    described, recovery = asyncio.run(_punched_upload())
    assert described.startswith("direct (hole-punched) 127.0.0.1:")
    # (Probe timeouts are not asserted: on a loaded machine a handshake slower than
    # loopback's tiny round trip fires one, which costs the window nothing.)
    assert_kept_slow_start(recovery)
