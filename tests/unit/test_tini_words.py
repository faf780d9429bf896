"""tini's line about a command it could not start, in our words, in a shell's
output as in a job's stderr (the line's text is tini.c's PRINT_FATAL)."""

from __future__ import annotations

import pytest

from gpumesh.runtime.states import shell_output_in_our_words

IMAGE = "busybox:1"


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_the_first_output_of_a_shell_names_the_command_and_image(newline: bytes) -> None:
    data = b"[FATAL tini (6)] exec bash failed: No such file or directory" + newline
    assert shell_output_in_our_words(data + b"more", IMAGE) == (
        b"gpumesh: bash: not found in image busybox:1 (exit 127)" + newline + b"more"
    )
    denied = b"[FATAL tini (7)] exec ./run.sh failed: Permission denied" + newline
    assert shell_output_in_our_words(denied, IMAGE) == (
        b"gpumesh: ./run.sh: not executable in image busybox:1 (exit 126)" + newline
    )


@pytest.mark.parametrize(
    "data",
    [b"hello\n", b"[FATAL tini (6)] something else\n", b"", b"[FATAL tini"],
)
def test_any_other_output_is_left_as_it_is(data: bytes) -> None:
    assert shell_output_in_our_words(data, IMAGE) == data
