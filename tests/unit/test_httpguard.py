"""The HTTP guard's rules and the token back-off, without sockets: caps per address
and in total, room made at the cost of the oldest waiting connection, the
request deadline, and the 429 wait that doubles up to a minute."""

from __future__ import annotations

import pytest

from gpumesh.control.guesses import TokenGuesses
from gpumesh.errors import ConfigError
from gpumesh.httpguard import UNIX_PEER, Admitted, ConnectionTable, Limits, Refused


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _admitted(verdict: Admitted | Refused) -> Admitted:
    assert isinstance(verdict, Admitted), verdict
    return verdict


def test_an_address_over_its_cap_pushes_out_its_own_oldest_waiting_connection() -> None:
    clock = Clock()
    table = ConnectionTable(Limits(per_client=3, connections=100), clock)
    first = _admitted(table.open("10.0.0.9")).conn
    clock.now += 1
    others = [_admitted(table.open("10.0.0.9")).conn for _ in range(2)]
    owner = _admitted(table.open("10.0.0.1")).conn
    table.busy(others[0])  # its request is in: never pushed out
    verdict = _admitted(table.open("10.0.0.9"))
    assert [e.conn for e in verdict.evict] == [first]
    assert "limit per address" in verdict.evict[0].refusal.message
    assert "3" in verdict.evict[0].refusal.message
    assert table.count("10.0.0.9") == 3 and table.count("10.0.0.1") == 1
    assert owner not in [e.conn for e in verdict.evict]


def test_a_connection_whose_head_is_in_is_never_pushed_out_to_make_room() -> None:
    clock = Clock()
    table = ConnectionTable(Limits(per_client=2), clock)
    owner = _admitted(table.open("10.0.0.1")).conn
    table.headed(owner)  # its head arrived; its body may still be coming
    clock.now += 1
    flood = _admitted(table.open("10.0.0.1")).conn
    for _ in range(100):  # another at the same address opening as fast as it can
        clock.now += 0.01
        verdict = _admitted(table.open("10.0.0.1"))
        assert [e.conn for e in verdict.evict] == [flood]
        flood = verdict.conn
    assert table.left(owner) is not None  # the deadline still runs for its body
    clock.now += Limits().deadline
    assert table.overdue(owner) is not None


def test_an_address_whose_connections_are_all_busy_is_refused_with_the_number() -> None:
    table = ConnectionTable(Limits(per_client=2), Clock())
    for _ in range(2):
        table.busy(_admitted(table.open("10.0.0.9")).conn)
    verdict = table.open("10.0.0.9")
    assert isinstance(verdict, Refused) and verdict.status == 429
    assert verdict.message == (
        "2 connections from 10.0.0.9 are busy and the limit per address is 2: "
        "close some, then retry"
    )


def test_the_total_cap_makes_room_at_the_cost_of_the_address_holding_most() -> None:
    clock = Clock()
    table = ConnectionTable(Limits(per_client=10, connections=4), clock)
    early = _admitted(table.open("10.0.0.2")).conn  # the oldest, but of a small holder
    clock.now += 1
    flood = [_admitted(table.open("10.0.0.9")).conn for _ in range(3)]
    verdict = _admitted(table.open("10.0.0.3"))
    assert [e.conn for e in verdict.evict] == [flood[0]]
    assert "4 connections, its limit" in verdict.evict[0].refusal.message
    assert len(table) == 4 and early not in [e.conn for e in verdict.evict]


def test_a_full_server_of_busy_connections_refuses_in_one_line() -> None:
    table = ConnectionTable(Limits(connections=2), Clock())
    for key in ("a", "b"):
        table.busy(_admitted(table.open(key)).conn)
    verdict = table.open("c")
    assert isinstance(verdict, Refused) and verdict.status == 503
    assert "2 busy connections, its limit is 2" in verdict.message


def test_the_unix_socket_counts_in_the_total_only() -> None:
    table = ConnectionTable(Limits(per_client=1, connections=3), Clock())
    for _ in range(3):
        table.busy(_admitted(table.open(UNIX_PEER)).conn)
    assert isinstance(table.open(UNIX_PEER), Refused)


def test_loopback_addresses_share_the_total_cap_only() -> None:
    table = ConnectionTable(Limits(per_client=1, connections=5), Clock())
    for key in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1", "127.0.0.1"):
        _admitted(table.open(key))
    verdict = _admitted(table.open("10.0.0.9"))  # room is made at loopback's cost
    assert len(verdict.evict) == 1 and len(table) == 5


def test_trusted_proxies_have_no_per_address_cap() -> None:
    table = ConnectionTable(Limits(per_client=1, exempt=frozenset({"10.0.0.5"})), Clock())
    for _ in range(3):
        table.busy(_admitted(table.open("10.0.0.5")).conn)
    assert len(table) == 3


def test_the_deadline_runs_while_a_connection_waits_and_stops_while_it_is_busy() -> None:
    clock = Clock()
    table = ConnectionTable(Limits(deadline=3.0), clock)
    conn = _admitted(table.open("10.0.0.9")).conn
    clock.now += 2.9
    assert table.overdue(conn) is None
    clock.now += 0.2
    refusal = table.overdue(conn)
    assert refusal is not None and refusal.status == 408
    assert "within 3 s, the request deadline" in refusal.message
    table.busy(conn)  # an event stream may run for hours
    clock.now += 1000
    assert table.overdue(conn) is None and table.left(conn) is None
    table.waiting(conn)  # answered: the next request has the whole deadline again
    assert table.left(conn) == pytest.approx(3.0)


def test_limits_keep_descriptors_in_reserve_and_read_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Limits(connections=1024, reserve=256).fitted(1024).connections == 768
    assert Limits(connections=100, reserve=256).fitted(1 << 20).connections == 100
    assert Limits(reserve=256).fitted(256).connections == 128  # few: half kept free
    limits = Limits(bodies={"POST /login": 10})
    assert limits.body_limit("POST", "/login") == 10
    assert limits.body_limit("GET", "/login") == limits.body
    monkeypatch.setenv("GPUMESH_HTTP_DEADLINE", "2.5")
    monkeypatch.setenv("GPUMESH_HTTP_PER_CLIENT", "7")
    read = Limits.from_env(body=5)
    assert (read.deadline, read.per_client, read.body) == (2.5, 7, 5)
    monkeypatch.setenv("GPUMESH_HTTP_CONNECTIONS", "many")
    with pytest.raises(ConfigError, match="GPUMESH_HTTP_CONNECTIONS='many': give a number"):
        Limits.from_env()


def test_five_wrong_tokens_earn_a_wait_that_doubles_up_to_a_minute() -> None:
    clock = Clock()
    guesses = TokenGuesses(clock)
    for _ in range(4):
        guesses.wrong("10.0.0.9")
        assert guesses.refusal("10.0.0.9") is None
    guesses.wrong("10.0.0.9")
    refusal = guesses.refusal("10.0.0.9")
    assert refusal is not None
    assert refusal.startswith("5 wrong API tokens in a row from 10.0.0.9, over the limit of 5")
    assert "refused for 1.0 s more" in refusal
    assert guesses.refusal("10.0.0.1") is None  # another address is not held back
    waits = []
    for _ in range(9):
        clock.now += 61
        assert guesses.refusal("10.0.0.9") is None
        guesses.wrong("10.0.0.9")
        start = clock.now
        while guesses.refusal("10.0.0.9") is not None:
            clock.now += 0.5
        waits.append(clock.now - start)
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0, 60.0]
    guesses.right("10.0.0.9")
    guesses.wrong("10.0.0.9")
    assert guesses.refusal("10.0.0.9") is None  # a right token starts the count again


def test_the_first_wait_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMESH_API_BACKOFF", "0.2")
    assert TokenGuesses.from_env().first == 0.2
    monkeypatch.setenv("GPUMESH_API_BACKOFF", "0")
    with pytest.raises(ConfigError, match="GPUMESH_API_BACKOFF='0': give seconds"):
        TokenGuesses.from_env()
