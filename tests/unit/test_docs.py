"""docs/architecture.md stays true: every test its security model cites exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_the_security_model_names_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Security model") :]
    named = set(re.findall(r"\btest_\w+", section)) - {"test_"}
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), re.MULTILINE))
        defined.add(path.stem)  # a file named as a whole
    assert named, "the security model names no test"
    assert sorted(named - defined) == []
