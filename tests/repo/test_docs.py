"""The docs stay true: every error reason and every setting is documented, the README stays a
short front door, and every relative link leads somewhere."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from repo_paths import ROOT

from mqds.protocol.errors import REASONS, Reason
from mqds.server.config import NodeConfig

README = (ROOT / "README.md").read_text()
# The errors table lives with the client and the gRPC API; the settings table with running a node.
ERRORS_PAGE = (ROOT / "docs" / "client.md").read_text()
SETTINGS_PAGE = (ROOT / "docs" / "operations.md").read_text()
LINKED_PAGES = [ROOT / "README.md", ROOT / "client" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def test_every_error_reason_is_in_the_errors_table() -> None:
    for reason in Reason:
        info = REASONS[reason]
        row = next((line for line in ERRORS_PAGE.splitlines() if line.startswith(f"| {reason.value} |")), None)
        assert row is not None, f"docs/client.md lacks a row for {reason.value}"
        assert info.code.name in row
        assert info.error_class.__name__ in row
        assert ("| yes |" in row) == info.retriable


def test_every_setting_is_in_the_settings_table() -> None:
    for f in dataclasses.fields(NodeConfig):
        assert f"| `{f.name}` |" in SETTINGS_PAGE, f.name


def test_the_two_commands_come_first() -> None:
    first_block = README.split("```", 2)[1]
    assert "make demo" in first_block and "make test" in first_block


def test_the_readme_is_a_front_door() -> None:
    assert len(README.splitlines()) <= 400, "README.md grew past 400 lines: move the detail into a docs/ page"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = _FENCE.sub("", page.read_text())
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def _relative_links(page: Path) -> list[str]:
    text = _INLINE_CODE.sub("", _FENCE.sub("", page.read_text()))
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_that_exist(page: Path) -> None:
    broken = []
    for link in _relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target)):
            broken.append(link)
    assert not broken, f"{page.relative_to(ROOT)} links to what does not exist: {broken}"


def test_the_link_check_sees_links() -> None:
    assert "docs/client.md" in _relative_links(ROOT / "README.md")
    assert _anchors(ROOT / "docs" / "operations.md") >= {"metrics-and-health", "command-line"}


def _table_rows(section: str) -> list[str]:
    """The rows of the first table under the README's ``## section`` heading (header and rule left out)."""
    text = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return lines[2:]


@pytest.mark.parametrize("section", ["Figures", "Status"])
def test_every_readme_figure_and_status_row_points_at_a_docs_section(section: str) -> None:
    """Each row of the figures and status tables says where its detail is: a link to a section of a page
    under docs/ (that the section exists, the link test above checks)."""
    rows = _table_rows(section)
    assert len(rows) >= 5
    bare = [
        row.split("|")[1].strip()[:70]
        for row in rows
        if not any(link.startswith("docs/") and "#" in link for link in _relative_links_of(row))
    ]
    assert not bare, f"README rows of {section} without a link to a docs/ section: {bare}"


def _relative_links_of(text: str) -> list[str]:
    return [t for t in _LINK.findall(_INLINE_CODE.sub("", text)) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_every_design_note_is_linked_from_the_readme() -> None:
    """A package's DESIGN.md is where its design is explained; a newcomer finds each from the front door."""
    notes = {
        path.relative_to(ROOT).as_posix()
        for path in ROOT.glob("*/mqds/**/DESIGN.md")
        if ".venv" not in path.parts and "build" not in path.parts
    }
    assert notes, "the check sees the design notes"
    linked = set(re.findall(r"\]\(([^)#]+/DESIGN\.md)\)", README))
    assert not notes - linked, f"design notes the README does not link: {sorted(notes - linked)}"
