"""No module of the package passes 1,000 lines: a module that grows past it has
taken on a second job and is split by responsibility (docs/layers.md says who
owns what)."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "gpumesh"
MOST = 1000


def test_no_module_passes_a_thousand_lines() -> None:
    sizes = {
        str(path.relative_to(SRC)): len(path.read_text(encoding="utf-8").splitlines())
        for path in SRC.rglob("*.py")
    }
    assert len(sizes) > 100  # the package was found
    assert {name: lines for name, lines in sizes.items() if lines > MOST} == {}
