"""App manifest digests and deltas (pure functions)."""

from __future__ import annotations

from gpumesh.files.manifest import apply_delta, delta, digest

A = (10, 0o644, "a" * 64)
B = (20, 0o755, "b" * 64)
C = (30, 0o600, "c" * 64)


def test_the_digest_ignores_order_and_sees_every_field() -> None:
    one = {"x": A, "y/z": B}
    assert digest(one) == digest({"y/z": B, "x": A})
    assert digest(one) != digest({"x": A, "y/z": (20, 0o644, "b" * 64)})
    assert digest(one) != digest({"x": A, "y/zz": B})
    assert digest({}) != digest(one)


def test_a_delta_rebuilds_the_new_manifest_from_the_old() -> None:
    old = {"keep": A, "change": A, "gone": B}
    new = {"keep": A, "change": C, "added": B}
    put, remove = delta(old, new)
    assert sorted(p[0] for p in put) == ["added", "change"]
    assert remove == ["gone"]
    rebuilt = apply_delta(old, {str(p[0]): (p[1], p[2], p[3]) for p in put}, remove)  # type: ignore[misc]
    assert rebuilt == new
    assert digest(rebuilt) == digest(new)
    assert delta(new, new) == ([], [])
