"""The owner's requests to end one session: files in the home, each taken once."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumesh.store.stops import STOPS_DIR, request_stop, take_stops, valid_session_id


def test_each_request_is_taken_once(tmp_path: Path) -> None:
    assert take_stops(tmp_path) == []  # no folder yet
    request_stop(tmp_path, "shell-5d1e0b9a4c2f")
    request_stop(tmp_path, "cuda-9b2f6d0c3e1a")
    request_stop(tmp_path, "shell-5d1e0b9a4c2f")  # asked twice: one request
    assert sorted(take_stops(tmp_path)) == ["cuda-9b2f6d0c3e1a", "shell-5d1e0b9a4c2f"]
    assert take_stops(tmp_path) == []
    assert (tmp_path / STOPS_DIR).stat().st_mode & 0o777 == 0o700


def test_a_request_still_being_written_is_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / STOPS_DIR
    folder.mkdir()
    (folder / "shell-1.tmp").write_bytes(b"")  # write_private's temporary name
    assert take_stops(tmp_path) == []
    assert (folder / "shell-1.tmp").exists()


@pytest.mark.parametrize("bad", ["", "../agent.json", "a/b", ".hidden", "x" * 65, "a.b"])
def test_only_an_id_the_agent_could_give_names_a_file(tmp_path: Path, bad: str) -> None:
    assert not valid_session_id(bad)
    with pytest.raises(ValueError):
        request_stop(tmp_path, bad)
    assert not (tmp_path / STOPS_DIR).exists()
