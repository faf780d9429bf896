"""The one wording of an unreachable peer: where it was tried, and what to check."""

from __future__ import annotations

import pytest

from gpumesh.errors import UnreachableError
from gpumesh.transport.reach import unreachable


@pytest.mark.parametrize(
    ("kwargs", "start"),
    [
        ({"refused": True}, "nothing is listening on 192.0.2.2:48202 (connection refused)"),
        ({"waited": 3.0}, "no answer from 192.0.2.2:48202 within 3s"),
        ({"reason": "Network is unreachable"}, "cannot reach 192.0.2.2:48202 (Network is"),
    ],
    ids=["refused", "silent", "no-route"],
)
def test_every_form_names_host_and_port_and_what_to_check(
    kwargs: dict[str, object], start: str
) -> None:
    error = unreachable("192.0.2.2:48202", **kwargs)  # type: ignore[arg-type]
    assert isinstance(error, UnreachableError)
    assert error.message.startswith(start)
    assert "is `gpumesh share` running there" in error.message
    assert "\n" not in error.message


def test_only_a_port_nobody_listens_on_is_marked_refused() -> None:
    # Dial errors are ranked by this field, never by the words of the message.
    assert unreachable("192.0.2.2:48202", refused=True).refused
    assert not unreachable("192.0.2.2:48202", waited=3.0).refused
    assert not unreachable("refused.example:1", reason="connection refused by policy").refused
    assert not UnreachableError("a peer's unreachable refusal").refused
