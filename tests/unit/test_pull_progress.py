"""Folding Docker's pull events into layers and bytes (runtime/pull.py)."""

from __future__ import annotations

from gpumesh.runtime.pull import PullProgress, PullTracker

IMAGE = "127.0.0.1:5000/team/trainer:2"


def _feed(tracker: PullTracker, *events: dict[str, object]) -> list[bool]:
    return [tracker.feed(event) for event in events]


def test_a_pull_is_counted_in_layers_and_compressed_bytes() -> None:
    tracker = PullTracker(IMAGE)
    changed = _feed(
        tracker,
        {"status": "Pulling from team/trainer", "id": "2"},
        {"status": "Already exists", "progressDetail": {}, "id": "aaa"},
        {"status": "Pulling fs layer", "progressDetail": {}, "id": "bbb"},
        {"status": "Pulling fs layer", "progressDetail": {}, "id": "ccc"},
        {"status": "Waiting", "progressDetail": {}, "id": "ccc"},
    )
    assert changed == [False, True, True, True, False]
    assert tracker.progress() == PullProgress(IMAGE, 3, 1, 0, 0)

    _feed(
        tracker,
        {"status": "Downloading", "progressDetail": {"current": 400, "total": 1000}, "id": "bbb"},
        {"status": "Downloading", "progressDetail": {"current": 50, "total": 200}, "id": "ccc"},
    )
    assert tracker.progress() == PullProgress(IMAGE, 3, 1, 450, 1200)

    _feed(
        tracker,
        {"status": "Verifying Checksum", "progressDetail": {}, "id": "bbb"},
        {"status": "Download complete", "progressDetail": {}, "id": "bbb"},
        {"status": "Extracting", "progressDetail": {"current": 9999, "total": 5000}, "id": "bbb"},
        {"status": "Pull complete", "progressDetail": {}, "id": "bbb"},
    )
    # Extracting counts uncompressed bytes: they never enter the download figures.
    assert tracker.progress() == PullProgress(IMAGE, 3, 2, 1050, 1200)

    _feed(
        tracker,
        {"status": "Download complete", "progressDetail": {}, "id": "ccc"},
        {"status": "Pull complete", "progressDetail": {}, "id": "ccc"},
        {"status": "Digest: sha256:" + "0" * 64},
        {"status": f"Status: Downloaded newer image for {IMAGE}"},
    )
    assert tracker.progress() == PullProgress(IMAGE, 3, 3, 1200, 1200, done=True)


def test_odd_events_change_nothing() -> None:
    """The engine's stream is trusted less than it looks: unknown statuses,
    missing ids, wrong types and a current beyond its total do not corrupt figures."""
    tracker = PullTracker(IMAGE)
    changed = _feed(
        tracker,
        {"status": "Something new", "id": "x"},
        {"status": 7, "id": "x"},
        {"status": "Downloading", "progressDetail": "weird", "id": "y"},
        {"status": "Downloading", "progressDetail": {"current": "1", "total": None}, "id": "y"},
        {"progressDetail": {"current": 5, "total": 10}, "id": "z"},
        {"status": "Downloading", "progressDetail": {"current": 50, "total": 10}, "id": "w"},
    )
    assert changed == [False, False, True, False, False, True]
    assert tracker.progress() == PullProgress(IMAGE, 2, 0, 10, 10)
