"""The fault filesystem's open files and directories: :class:`Handle`, and the :class:`HandleTable` FUSE's ``fh`` names.

Operations on an open file use the backing descriptor its open made, not a
path: the file may have been renamed or unlinked since. A power loss closes
them all (:meth:`HandleTable.close_all`); their later calls fail with EIO
until the kernel releases them.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass


@dataclass
class Handle:
    """An open file or directory: the backing descriptor, and the path the error patterns match."""

    fd: int
    ino: int
    path: str
    is_dir: bool
    sync_writes: bool = False
    """Opened O_SYNC or O_DSYNC: each write is synced before it returns."""
    dead: bool = False
    """The power was lost while it was open: every call on it fails."""


class HandleTable:
    """Open handles by FUSE file handle number (callers hold the filesystem's lock)."""

    def __init__(self) -> None:
        self._handles: dict[int, Handle] = {}
        self._next = 1

    def add(self, fd: int, path: str, *, is_dir: bool, sync_writes: bool = False) -> int:
        fh = self._next
        self._next += 1
        self._handles[fh] = Handle(fd, os.fstat(fd).st_ino, path, is_dir, sync_writes)
        return fh

    def get(self, fh: int | None) -> Handle:
        """The live handle ``fh`` (OSError EBADF for an unknown one, EIO for one the power loss closed)."""
        h = self._handles.get(fh or 0)
        if h is None:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        if h.dead:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return h

    def pop(self, fh: int) -> Handle | None:
        return self._handles.pop(fh, None)

    def busy(self) -> set[int]:
        """The inodes open files hold."""
        return {h.ino for h in self._handles.values() if not h.dead}

    def open_count(self) -> int:
        return sum(1 for h in self._handles.values() if not h.dead)

    def renamed(self, old: str, new: str) -> None:
        """``old`` (a file, or a directory and everything under it) is at ``new`` now."""
        for h in self._handles.values():
            if h.path == old or h.path.startswith(old + "/"):
                h.path = new + h.path[len(old) :]

    def close_all(self) -> None:
        """Close every backing descriptor; the handles stay, dead, until the kernel releases them."""
        for h in self._handles.values():
            if not h.dead:
                os.close(h.fd)
                h.dead = True
