"""One line of a verification report: what was checked on which stage, expected, found, verdict."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    stage: int | None  # None: the whole bundle
    check: str
    expected: str
    found: str
    verdict: str  # "pass", "FAIL" or "skip"
