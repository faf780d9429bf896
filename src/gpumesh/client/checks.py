"""What ``doctor`` and ``netcheck`` report: checks, each with a state and one line."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAIL", "OK", "WARN", "Check"]

OK = "ok"
WARN = "warn"
FAIL = "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    """``ok``, ``warn`` or ``fail``."""
    detail: str
    """One line for people: what was found, or which step failed and why."""
    fix: str = ""
