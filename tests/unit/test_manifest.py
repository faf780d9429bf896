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


def test_the_digest_is_that_of_compact_json_whatever_the_names() -> None:
    """Both ends (and older versions) must agree byte for byte: json.dumps's form."""
    import hashlib
    import json

    names = ["plain", 'quote"back\\slash', "tab\tnew\nline", "del\x7f", "caf\u00e9/\u65e5\u672c"]
    names += [f"ctl{chr(i)}" for i in range(32)]
    for name in names:
        files = {name: A, "z": (2**40, 0o644, "f" * 64)}
        canonical = [[path, *files[path]] for path in sorted(files)]
        text = json.dumps(canonical, separators=(",", ":"))
        assert digest(files) == hashlib.sha256(text.encode()).hexdigest(), name


def test_the_scans_one_search_for_no_rule_answers_as_each_rule_would() -> None:
    """What `app sync` sends: the combined search must leave out what pathspec would."""
    import copy

    from gpumesh.files.pack import _IgnoreRules

    lines = [
        "*.log",
        "!keep.log",
        "/build/",
        "data/**/raw",
        "a[bc]d?",
        "\\#literal",
        "name\\ with\\ space",
        "deep/*.tmp",
        "!deep/x.tmp",
        "(?P<x>)",
        "**/cache",
    ]
    paths = [
        "main.py",
        "x.log",
        "keep.log",
        "sub/keep.log",
        "build/",
        "build/out.o",
        "sub/build/",
        "data/a/b/raw",
        "data/raw",
        "abdx",
        "acd",
        "#literal",
        "name with space",
        "deep/a.tmp",
        "deep/x.tmp",
        "deep/more/a.tmp",
        "(?P<x>)",
        "cache/",
        "a/b/cache",
        ".git/",
        "sub/.venv/",
        "m.pyc",
        "node_modules/",
        "caf\u00e9.log",
    ]
    for count in range(len(lines) + 1):
        rules = _IgnoreRules(lines[:count])
        assert rules._any is not None
        slow = copy.copy(rules)
        slow._any = None
        for path in paths:
            assert rules.why_ignored(path) == slow.why_ignored(path), (lines[:count], path)
