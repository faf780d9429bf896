"""protocol/punch: the hole-punching state machine, driven by hand (no sockets, no clock).

Two punchers stand for the two ends; a tiny "network" function decides which
probes arrive, which is how each NAT behaviour is modelled here.
"""

from __future__ import annotations

import itertools

from gpumesh.protocol.punch import PunchConfig, Puncher
from gpumesh.protocol.relay import Probe, decode_packet, encode_packet, probe_mac

SECRET = b"s" * 16
SESSION = 77
A_PUBLIC = ("203.0.113.2", 47000)
B_PUBLIC = ("203.0.113.3", 47000)


def _puncher(candidates: list[tuple[str, int]], start: int = 0) -> Puncher:
    counter = itertools.count(start)
    return Puncher(SESSION, SECRET, candidates, 0.0, random_tx=lambda: next(counter))


def _probe(packet: bytes) -> Probe:
    message = decode_packet(packet)
    assert isinstance(message, Probe)
    return message


def _exchange(a: Puncher, b: Puncher, now: float, *, a_to_b: bool, b_to_a: bool) -> None:
    """One round: each side's due probes travel if the 'network' lets them."""
    a_out, b_out = a.poll(now), b.poll(now)
    queue = [("b", p, addr) for p, addr in a_out if a_to_b and addr == B_PUBLIC]
    queue += [("a", p, addr) for p, addr in b_out if b_to_a and addr == A_PUBLIC]
    while queue:
        to, packet, _ = queue.pop(0)
        if to == "b":
            replies = b.on_probe(_probe(packet), A_PUBLIC, now)
            queue += [("a", p, addr) for p, addr in replies if b_to_a and addr == A_PUBLIC]
        else:
            replies = a.on_probe(_probe(packet), B_PUBLIC, now)
            queue += [("b", p, addr) for p, addr in replies if a_to_b and addr == B_PUBLIC]


def test_both_sides_find_the_direct_path_when_probes_get_through() -> None:
    a = _puncher([B_PUBLIC, ("10.0.2.2", 47000)])
    b = _puncher([A_PUBLIC], start=1000)
    _exchange(a, b, 0.0, a_to_b=True, b_to_a=True)
    assert a.state == "direct" and a.direct == B_PUBLIC
    assert b.state == "direct" and b.direct == A_PUBLIC
    assert [e.kind for e in a.take_events()] == ["direct"]
    assert a.direct_after == 0.0


def test_probes_go_to_every_candidate_at_the_interval() -> None:
    a = _puncher([B_PUBLIC, ("10.0.2.2", 47000)])
    first = a.poll(0.0)
    assert [addr for _, addr in first] == [B_PUBLIC, ("10.0.2.2", 47000)]
    assert a.poll(0.1) == []  # not due yet
    assert len(a.poll(0.2)) == 2


def test_gives_up_and_stays_relayed_when_nothing_answers() -> None:
    config = PunchConfig(interval=0.2, give_up=1.0)
    a = Puncher(SESSION, SECRET, [B_PUBLIC], 0.0, random_tx=lambda: 1, config=config)
    now = 0.0
    while a.state == "probing" and now < 5:
        a.poll(now)
        now += 0.2
    assert a.state == "relayed" and a.direct is None
    assert [e.kind for e in a.take_events()] == ["gave_up"]
    assert a.next_wakeup() is None


def test_one_way_traffic_is_not_a_direct_path() -> None:
    # B's probes reach A, but nothing from A reaches B (a filtering NAT on B's side
    # that never opened): A answers, but neither side may call the path direct.
    a = _puncher([B_PUBLIC])
    b = _puncher([A_PUBLIC], start=1000)
    for step in range(5):
        _exchange(a, b, step * 0.2, a_to_b=False, b_to_a=True)
    assert a.state == "probing" and b.state == "probing"


def test_an_answer_from_another_address_than_the_one_probed_does_not_count() -> None:
    a = _puncher([B_PUBLIC])
    [(packet, _)] = a.poll(0.0)
    tx = _probe(packet).tx
    reply = Probe(session=SESSION, tx=tx, reply=True, mac=probe_mac(SECRET, SESSION, tx, True))
    assert a.on_probe(reply, ("203.0.113.3", 50123), 0.01) == []
    assert a.state == "probing"


def test_a_forged_probe_is_ignored() -> None:
    a = _puncher([B_PUBLIC])
    [(packet, _)] = a.poll(0.0)
    tx = _probe(packet).tx
    forged = Probe(session=SESSION, tx=tx, reply=True, mac=probe_mac(b"x" * 16, SESSION, tx, True))
    assert a.on_probe(forged, B_PUBLIC, 0.01) == []
    assert a.state == "probing"
    # and an unsolicited forged probe gets no answer (nothing reflects off us)
    stranger = Probe(session=SESSION, tx=5, reply=False, mac=b"\0" * 16)
    assert a.on_probe(stranger, ("198.51.100.9", 1), 0.02) == []


def test_a_probe_from_an_unknown_address_is_answered_and_probed_back() -> None:
    a = _puncher([B_PUBLIC])
    remapped = ("203.0.113.3", 61000)  # B's NAT picked another port
    probe = Probe(session=SESSION, tx=9, reply=False, mac=probe_mac(SECRET, SESSION, 9, False))
    out = a.on_probe(probe, remapped, 0.0)
    kinds = [(_probe(p).reply, addr) for p, addr in out]
    assert (True, remapped) in kinds and (False, remapped) in kinds
    assert remapped in a.candidates


def test_a_silent_direct_path_falls_back_and_probing_restarts() -> None:
    config = PunchConfig(interval=0.2, give_up=5.0, keepalive=1.0, dead_after=3.0)
    counter = itertools.count()
    a = Puncher(SESSION, SECRET, [B_PUBLIC], 0.0, random_tx=lambda: next(counter), config=config)
    [(packet, _)] = a.poll(0.0)
    tx = _probe(packet).tx
    a.on_probe(
        Probe(session=SESSION, tx=tx, reply=True, mac=probe_mac(SECRET, SESSION, tx, True)),
        B_PUBLIC,
        0.05,
    )
    assert a.state == "direct"
    keepalives = a.poll(1.1)
    assert [addr for _, addr in keepalives] == [B_PUBLIC]
    a.on_inbound(2.0)  # traffic keeps it alive
    a.poll(4.0)
    assert a.state == "direct"
    a.poll(5.1)  # nothing since 2.0: dead
    assert a.state == "probing" and a.direct is None
    assert [e.kind for e in a.take_events()] == ["direct", "lost"]


def test_probe_packets_round_trip_and_stay_small() -> None:
    probe = Probe(session=2**62, tx=2**62, reply=True, mac=b"m" * 16)
    packet = encode_packet(probe)
    assert decode_packet(packet) == probe
    assert packet[0] < 0x40  # never mistaken for QUIC (fixed bit 0x40)
    assert len(packet) < 64
