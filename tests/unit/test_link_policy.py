"""transport/linkpolicy: a QUIC link's decisions, driven with plain numbers."""

from __future__ import annotations

from gpumesh.transport.linkpolicy import (
    EARLY_COPIES,
    FEC_LONG_RTT,
    LOSS_BURST,
    LinkPolicy,
)

INF = float("inf")
LONG = 2 * FEC_LONG_RTT
SHORT = FEC_LONG_RTT / 5


def test_parity_starts_only_when_offered_taken_and_the_link_is_long() -> None:
    auto = LinkPolicy("auto", is_client=True)
    assert not auto.parity_due(LONG, 0)  # the peer has not said it takes FEC yet
    assert auto.peer_takes_fec()
    assert not auto.parity_due(INF, 0)  # no round trip seen yet
    assert not auto.parity_due(SHORT, 0)
    assert auto.parity_due(FEC_LONG_RTT, 0)
    assert auto.parity_due(SHORT, 1)  # a short link's first loss

    off = LinkPolicy("off", is_client=True)
    assert not off.peer_takes_fec()  # not offered: the peer's word changes nothing
    assert not off.parity_due(LONG, 5)

    on = LinkPolicy("on", is_client=False)
    assert on.peer_takes_fec() and on.parity_due(SHORT, 0)


def test_the_least_round_trip_is_kept() -> None:
    policy = LinkPolicy("auto", is_client=True)
    assert policy.least_rtt(None) == INF
    assert policy.least_rtt(0.05) == 0.05
    assert policy.least_rtt(0.2) == 0.05  # queues under bulk do not count
    assert policy.least_rtt(0.01) == 0.01


def test_first_flight_datagrams_go_twice_only_up_to_early_copies() -> None:
    policy = LinkPolicy("auto", is_client=True)
    assert policy.copies([1200] * 40, INF) == 40
    assert policy.copies([1200] * 40, LONG) == EARLY_COPIES - 40
    assert policy.copies([1200] * 5, LONG) == 0
    assert policy.early_duplicates == EARLY_COPIES

    short = LinkPolicy("auto", is_client=True)
    assert short.copies([1200] * 3, SHORT) == 0  # a short link needs none, and gets none later
    assert short.early_copies == 0
    assert LinkPolicy("on", is_client=True).copies([1200] * 3, SHORT) == 3
    assert LinkPolicy("off", is_client=True).copies([1200] * 3, INF) == 0


def test_an_unvalidated_path_never_gets_more_than_three_times_what_it_sent() -> None:
    policy = LinkPolicy("on", is_client=False)
    policy.received(1200)  # the client's Initial: 3600 bytes may go back
    flight = [600, 1000, 1200]
    count = policy.copies(flight, INF)
    sent = sum(flight) + sum(flight[:count])
    policy.sending(sent)
    assert count == 1 and sent <= 3 * 1200
    assert policy.copies([150], INF) == 0  # 200 bytes spare, less 150 sent: no copy
    policy.validated = True
    policy.received(1200)
    assert policy.copies([1200] * 10, INF) == 10  # validated: no cap any more

    client = LinkPolicy("on", is_client=True)  # the dialer's peer is never unvalidated
    assert client.copies([1200] * 3, INF) == 3


def test_a_loss_burst_is_reported_once() -> None:
    policy = LinkPolicy("auto", is_client=True)
    assert policy.loss_burst(2) is None
    assert policy.loss_burst(2 + LOSS_BURST) == LOSS_BURST
    assert policy.loss_burst(2 + LOSS_BURST) is None  # the same burst, seen again
    assert policy.loss_burst(LOSS_BURST + 5) is None  # 3 more: no burst
    assert policy.loss_burst(3 * LOSS_BURST) == 2 * LOSS_BURST - 5
