"""The faults a fault filesystem injects on command: a full disk, I/O errors on chosen files, slow syncs.

:class:`Faults` holds what is in force and counts what it did. The
filesystem asks it before each operation: :meth:`Faults.error` (an errno for
this operation on this path, or None), :meth:`Faults.space_error` (ENOSPC for
a write that would grow the filesystem past its limit), :meth:`Faults.create_error`
(ENOSPC for a create once it is full), and sleeps :attr:`Faults.sync_delay_s` before each fsync.

Paths are matched with :func:`fnmatch.fnmatchcase` against the path inside the
mount without its leading slash (``raft/seg-0001.log``); ``*`` matches across
``/``, so ``*.log`` is every ``.log`` file at any depth and ``*`` every file.
"""

from __future__ import annotations

import errno
import fnmatch
from collections import Counter
from dataclasses import dataclass
from typing import Any

# The operations an error rule can fail. "write" covers truncates; "fsync" covers fdatasync and a directory's fsync.
OPERATIONS = ("read", "write", "fsync")
ERRNOS = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC, "EROFS": errno.EROFS}


@dataclass(frozen=True)
class ErrorRule:
    """Fail ``ops`` on the paths that match ``pattern`` with ``errno_name``."""

    pattern: str
    ops: frozenset[str]
    errno_name: str = "EIO"

    def __post_init__(self) -> None:
        unknown = set(self.ops) - set(OPERATIONS)
        if unknown or not self.ops:
            raise ValueError(f"error rule operations must be some of {', '.join(OPERATIONS)}; got {sorted(self.ops)}")
        if self.errno_name not in ERRNOS:
            raise ValueError(f"error rule errno must be one of {', '.join(ERRNOS)}; got {self.errno_name!r}")
        if not self.pattern:
            raise ValueError("an error rule needs a path pattern ('*' for every file)")

    def matches(self, op: str, path: str) -> bool:
        return op in self.ops and fnmatch.fnmatchcase(path, self.pattern)

    def to_json(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "ops": sorted(self.ops), "errno": self.errno_name}


class Faults:
    """What is injected now, and counts of what was (callers hold the filesystem's lock)."""

    def __init__(self) -> None:
        self.space_limit_bytes: int | None = None
        self.rules: list[ErrorRule] = []
        self.sync_delay_s = 0.0
        self.counts: Counter[str] = Counter()

    def error(self, op: str, path: str | None) -> int | None:
        """The errno ``op`` on ``path`` fails with, or None."""
        relative = (path or "").lstrip("/")
        for rule in self.rules:
            if rule.matches(op, relative):
                self.counts[f"{rule.errno_name.lower()}_{op}"] += 1
                return ERRNOS[rule.errno_name]
        return None

    def space_error(self, used_bytes: int, growth: int) -> int | None:
        """ENOSPC when growing by ``growth`` bytes does not fit (overwriting, growth 0, always does), else None."""
        limit = self.space_limit_bytes
        if limit is None or growth <= 0 or used_bytes + growth <= limit:
            return None
        self.counts["enospc"] += 1
        return errno.ENOSPC

    def create_error(self, used_bytes: int) -> int | None:
        """ENOSPC for a new file, directory or link once the limit is reached, else None."""
        limit = self.space_limit_bytes
        if limit is None or used_bytes < limit:
            return None
        self.counts["enospc"] += 1
        return errno.ENOSPC

    def heal(self) -> None:
        """Lift every fault."""
        self.space_limit_bytes = None
        self.rules = []
        self.sync_delay_s = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "space_limit_bytes": self.space_limit_bytes,
            "errors": [r.to_json() for r in self.rules],
            "sync_delay_s": self.sync_delay_s,
            "counts": dict(self.counts),
        }
