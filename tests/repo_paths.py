"""Where the repository is, for the tests that read its files, whichever folder under tests/ they live in."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
