"""How ``Job.logs`` cuts a job's output into lines: per stream, whole across chunks."""

from __future__ import annotations

from gpumesh.client.mesh import _Lines


def test_a_line_split_across_chunks_comes_whole_and_streams_stay_apart() -> None:
    lines = _Lines()
    assert lines.add("stdout", b"one\ntw") == ["one"]
    assert lines.add("stderr", b"err") == []
    assert lines.add("stdout", b"o\r\nthree\n") == ["two", "three"]
    assert lines.add("stderr", b"or\n") == ["error"]
    assert lines.rest() == []


def test_an_unfinished_last_line_and_bad_bytes_still_come_out() -> None:
    lines = _Lines()
    assert lines.add("stdout", b"\xffok\n\nlast") == ["\ufffdok", ""]
    assert lines.rest() == ["last"]
    assert lines.rest() == []
