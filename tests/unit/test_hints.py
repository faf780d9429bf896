"""identity/hints: the one grammar of address hints, good and hostile."""

from __future__ import annotations

import pytest

from gpumesh.identity.hints import check_hint, check_hints, split_hint
from gpumesh.protocol.addresses import parse_address
from tests.badhints import BAD_HINTS


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("192.0.2.1:47000", ("192.0.2.1", 47000)),
        ("[2001:db8::1]:1", ("2001:db8::1", 1)),
        ("node-1.example.org:65535", ("node-1.example.org", 65535)),
        ("localhost:4799", ("localhost", 4799)),
        ("example.org.:9", ("example.org.", 9)),
        ("a" * 63 + ".example:9", ("a" * 63 + ".example", 9)),
    ],
)
def test_ip_literals_and_host_names_split(text: str, expected: tuple[str, int]) -> None:
    assert split_hint(text) == expected
    assert parse_address(f" {text} ") == expected  # what a user typed may carry spaces


@pytest.mark.parametrize("text", BAD_HINTS)
def test_hostile_hints_are_refused_saying_what_they_are(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a host:port \(") as caught:
        check_hint(text)
    assert repr(text[:60]) in str(caught.value)  # quoted: markup and escapes stay inert
    with pytest.raises(ValueError):
        parse_address(text)


def test_a_host_alone_takes_the_default_port_only_when_asked() -> None:
    assert split_hint("relay.example.org", 4799) == ("relay.example.org", 4799)
    assert split_hint("[::1]", 4799) == ("::1", 4799)
    assert check_hint("relay.example.org", port_optional=True) == "relay.example.org"
    with pytest.raises(ValueError, match="no port"):
        check_hint("relay.example.org")


def test_a_name_over_253_characters_is_refused() -> None:
    name = ".".join(["a" * 63] * 3 + ["a" * 62])  # 254 characters, each label fine
    with pytest.raises(ValueError, match="neither an IP address nor a host name"):
        split_hint(name, 4799)
    assert split_hint(name[1:], 4799) == (name[1:], 4799)
    with pytest.raises(ValueError, match="over 255 characters"):
        split_hint(f"{name[1:]}:4799")


def test_check_hints_names_the_field_of_the_first_bad_hint() -> None:
    check_hints(["192.0.2.1:1", "example.org:2"], "relay.example.org")
    with pytest.raises(ValueError) as caught:
        check_hints(["192.0.2.1:1", "a..b:2"], "")
    assert caught.value.args[0] == "address" and "'a..b:2'" in caught.value.args[1]
    with pytest.raises(ValueError) as caught:
        check_hints(["192.0.2.1:1"], "<relay>")
    assert caught.value.args[0] == "relay"
