"""The shipped hook files with their mqds additions switched on, as a user does by uncommenting them.

Each file in deploy/hooks/ holds its seed's rules, then, after a line starting
``# -- mqds additions``, rules the seed does not list, commented out. Tests
that need acknowledgements (which the Redis guide lists none of) load the file
with that block uncommented, so the block itself is what they test.
"""

from __future__ import annotations

import re
from pathlib import Path

ADDITIONS_MARK = "# -- mqds additions"
_RULE_LINE = re.compile(r"#( ?)((\[\[rule\]\])|(hook|topic|action) = .*)$")


def with_mqds_additions(path: Path) -> str:
    """The TOML text of ``path`` with the rules of its mqds additions block uncommented."""
    text = path.read_text(encoding="utf-8")
    head, mark, tail = text.partition(ADDITIONS_MARK)
    assert mark, f"{path} has no {ADDITIONS_MARK!r} block"
    lines = []
    for line in tail.splitlines():
        found = _RULE_LINE.fullmatch(line)
        lines.append(found.group(2) if found else line)
    return head + mark + "\n".join(lines) + "\n"


def write_with_mqds_additions(path: Path, folder: Path) -> Path:
    """``with_mqds_additions(path)`` written to a file of the same name in ``folder``."""
    out = folder / path.name
    out.write_text(with_mqds_additions(path), encoding="utf-8")
    return out
