"""What a follow prints while its provider cannot be reached: the reason once, and
again only when it changes or after the job was heard from again."""

from __future__ import annotations

import pytest

from gpumesh.cli._notes import ReconnectNotes, ViewPrinter
from gpumesh.client.views.jobs import Output, Reconnecting

DOWN = "cannot reach alice-pc directly (nothing is listening on 127.0.0.1:47000)"
RELAY = "cannot reach alice-pc through the relay r:4799 (unknown-peer)"


def test_the_same_reason_is_said_once_until_the_job_is_heard_again() -> None:
    notes = ReconnectNotes()
    first = notes.note(DOWN)
    assert first == f"{DOWN} (reconnecting; Ctrl-C stops following)"
    assert notes.note(DOWN) is None
    assert notes.note(RELAY) is not None  # another reason: said
    assert notes.note(RELAY) is None
    notes.heard()
    assert notes.note(RELAY) is not None  # a new outage


def test_the_printer_says_a_repeated_failure_once(capsys: pytest.CaptureFixture[str]) -> None:
    viewer = ViewPrinter("job")
    down = Reconnecting(seq=0, code="transport_error", message=DOWN)
    for _ in range(5):
        viewer.show(down)
    viewer.show(Output(seq=1, stream="stderr", data="YmFjawo=", text="back\n"))  # heard from
    viewer.show(down)
    err = capsys.readouterr().err
    assert err.count(DOWN) == 2, err  # before and after the output
    assert "link lost" not in err
