"""The image rules without Docker: names an image goes by, the allow list, what to prune."""

from __future__ import annotations

import pytest

from gpumesh.agent.images import Pulled, check_allowed, image_names, to_prune
from gpumesh.errors import AccessDeniedError


@pytest.mark.parametrize(
    ("image", "names"),
    [
        (
            "busybox",
            [
                "busybox",
                "busybox:latest",
                "library/busybox:latest",
                "docker.io/library/busybox:latest",
            ],
        ),
        ("pytorch/pytorch:2.4", ["pytorch/pytorch:2.4", "docker.io/pytorch/pytorch:2.4"]),
        ("ghcr.io/org/img:1", ["ghcr.io/org/img:1"]),
        ("localhost:5000/img", ["localhost:5000/img", "localhost:5000/img:latest"]),
        (
            "nvidia/cuda@sha256:ab",
            ["nvidia/cuda@sha256:ab", "docker.io/nvidia/cuda@sha256:ab"],
        ),
    ],
)
def test_the_names_an_image_goes_by(image: str, names: list[str]) -> None:
    assert image_names(image) == names


@pytest.mark.parametrize(
    ("image", "patterns", "allowed"),
    [
        ("anything/at:all", "*", True),
        ("nvidia/cuda:12.8.0-runtime-ubuntu22.04", "nvidia/cuda:* pytorch/pytorch:*", True),
        ("docker.io/nvidia/cuda:12.8.0", "nvidia/cuda:*", False),  # written with the registry
        ("nvidia/cuda:12.8.0", "docker.io/nvidia/cuda:*", True),  # allowed with the registry
        ("busybox", "library/busybox:*", True),
        ("busybox", "busybox:1.36", False),
        ("evil/cuda:1", "nvidia/cuda:*", False),
        ("nvidia/cuda-evil:1", "nvidia/cuda:*", False),
        ("ghcr.io/me/train:v1", "ghcr.io/me/*", True),
    ],
)
def test_allowed_images_match_any_name_of_the_image(
    image: str, patterns: str, allowed: bool
) -> None:
    if allowed:
        check_allowed(image, patterns, "alice-pc")
    else:
        with pytest.raises(AccessDeniedError) as caught:
            check_allowed(image, patterns, "alice-pc")
        assert caught.value.message == (
            f"alice-pc refused image {image!r}: it runs only images matching "
            f"{', '.join(patterns.split())} (its allowed_images); pick one of those, or ask "
            "its owner"
        )


def test_pruning_offers_the_least_recently_used_first_and_says_how_much_is_over() -> None:
    pulled = [
        Pulled("a", 40, last_used=3.0),
        Pulled("b", 30, last_used=1.0),
        Pulled("c", 20, last_used=2.0),
        Pulled("new", 50, last_used=4.0),
    ]
    assert to_prune(pulled, budget=200, keep="new") == (0, [])
    excess, order = to_prune(pulled, budget=100, keep="new")
    assert excess == 40
    assert [item.image for item in order] == ["b", "c", "a"]
    # the image a job is about to use is never offered, even when it is the oldest
    excess, order = to_prune(pulled, budget=100, keep="b")
    assert [item.image for item in order] == ["c", "a", "new"]
