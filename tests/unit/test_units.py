"""units: parse_size / format_size / format_duration, decimal vs binary suffixes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumesh.errors import ConfigError
from gpumesh.units import format_duration, format_rate, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GB", 8 * 10**9),
        ("16GiB", 16 * 2**30),
        ("512m", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1024", 1024),
        ("0", 0),
        ("7b", 7),
        ("3kb", 3000),
        ("2KiB", 2048),
        ("1TB", 10**12),
        ("1tib", 2**40),
        ("1.5GB", 1_500_000_000),
        (" 8 GB ", 8 * 10**9),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "lots", "8XB", "-1GB", "8 G B", "1e3", "8GBs", "1,5GB"])
def test_parse_size_refuses_bad_input_naming_examples(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text)
    message = str(info.value)
    assert repr(text) in message
    assert "8GB" in message
    assert "16GiB" in message


_MULTIPLIERS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KiB": 1024,
    "M": 1000**2,
    "MB": 1000**2,
    "MiB": 1024**2,
    "G": 1000**3,
    "GB": 1000**3,
    "GiB": 1024**3,
    "T": 1000**4,
    "TB": 1000**4,
    "TiB": 1024**4,
}


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(sorted(_MULTIPLIERS)),
    st.booleans(),
)
def test_parse_size_whole_numbers_in_any_unit_and_case(number: int, unit: str, upper: bool) -> None:
    text = f"{number}{unit.upper() if upper else unit.lower()}"
    assert parse_size(text) == number * _MULTIPLIERS[unit]


@pytest.mark.parametrize("text", ["2.01KB", "2.01MB", "2.03KB"])
def test_parse_size_decimal_fraction_is_not_truncated(text: str) -> None:
    number, unit = text[:-2], text[-2:]
    multiplier = {"KB": 10**3, "MB": 10**6, "GB": 10**9}[unit]
    whole, frac = number.split(".")
    assert parse_size(text) == (int(whole) * 100 + int(frac)) * multiplier // 100


@pytest.mark.parametrize(
    ("num_bytes", "expected"),
    [
        (0, "0B"),
        (900, "900B"),
        (999, "999B"),
        (1000, "1KB"),
        (1500, "1.5KB"),
        (10**6, "1MB"),
        (8 * 10**9, "8GB"),
        (1_250_000_000, "1.2GB"),
        (3 * 10**12, "3TB"),
        (5 * 10**15, "5000TB"),
    ],
)
def test_format_size(num_bytes: int, expected: str) -> None:
    assert format_size(num_bytes) == expected


@given(st.integers(min_value=0, max_value=999).map(lambda n: n * 10**6))
def test_format_size_round_trips_whole_megabytes(num_bytes: int) -> None:
    assert parse_size(format_size(num_bytes)) == num_bytes


def test_format_size_never_prints_a_thousand_of_a_unit() -> None:
    assert format_size(999_999) == "1MB"


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(0.85, "850ms"), (12, "12s"), (240, "4m"), (3 * 3600, "3h"), (2 * 86400, "2d")],
)
def test_format_duration(seconds: float, expected: str) -> None:
    assert format_duration(seconds) == expected


@pytest.mark.parametrize(
    ("num_bytes", "seconds", "expected"),
    [(6100, 0.4, "15.2KB/s"), (300, 2, "150B/s"), (2.5e9, 1, "2.5GB/s"), (10**6, 0, "-")],
)
def test_format_rate_takes_the_unit_its_size_calls_for(
    num_bytes: float, seconds: float, expected: str
) -> None:
    assert format_rate(num_bytes, seconds) == expected
