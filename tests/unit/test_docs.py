"""The README stays true: every error reason and every setting is documented."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mqds.protocol.errors import REASONS, Reason
from mqds.server.config import NodeConfig

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_error_reason_is_in_the_readme_table() -> None:
    for reason in Reason:
        info = REASONS[reason]
        row = next((line for line in README.splitlines() if line.startswith(f"| {reason.value} |")), None)
        assert row is not None, f"README lacks a row for {reason.value}"
        assert info.code.name in row
        assert info.error_class.__name__ in row
        assert ("| yes |" in row) == info.retriable


def test_every_setting_is_in_the_readme() -> None:
    for f in dataclasses.fields(NodeConfig):
        assert f"| `{f.name}` |" in README, f.name


def test_the_two_commands_come_first() -> None:
    first_block = README.split("```", 2)[1]
    assert "make demo" in first_block and "make test" in first_block
