"""Directory entries not yet made durable, the graveyard that keeps what they still name, and the durable tree put back.

Each directory is known by its backing inode number. A directory the
filesystem has not changed since the mount, or since its last fsync, has no
record: its entries are durable. The first change (a create, mkdir, symlink,
unlink, rmdir, or rename into or out of it) records its entries as they were
(:class:`DirRecord`: name -> inode); a new directory's record is empty. An
fsync of the directory drops the record: what it holds now is durable.

A node (file or directory) taken out of the live tree by an unlink, rmdir or
rename over it, that a durable entry still names, is not deleted but moved to
the *graveyard* (``<state dir>/graveyard/<inode>``, on the backing
filesystem, so the move keeps the inode and its open descriptors). It is
deleted once no record names it and no open file holds it
(:meth:`Namespace.collect`).

A power loss (:meth:`Namespace.restore`) makes the live tree the durable one:

1. every directory with a record, in the live tree and in the graveyard,
   loses the names it does not hold durably (they go to the graveyard);
2. from the root down, every directory with a record gets back the durable
   names it lost, from the graveyard (or, for a file that a durable entry of
   another directory also names, as a hard link);
3. what is left in the graveyard was never durable: it is deleted.

Directories are synced one by one, as POSIX has it: a file renamed from one
directory to another whose old directory alone was synced exists in neither
after a power loss, and in both (two links) when only the new one was. A
directory that would need two names keeps the first one met; the summary
counts it as unplaceable.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class DirRecord:
    """A directory's durable entries (name -> inode), as of its last fsync."""

    durable: dict[str, int]


def scan(path: str) -> dict[str, os.stat_result]:
    """The entries of a directory with their ``lstat``."""
    out = {}
    with os.scandir(path) as entries:
        for entry in entries:
            try:
                out[entry.name] = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
    return out


def listing(path: str) -> dict[str, int]:
    """The entries of a directory: name -> inode."""
    return {name: st.st_ino for name, st in scan(path).items()}


class Namespace:
    """The durable entries of the directories changed since their last fsync, and the graveyard."""

    def __init__(self, root: str, graveyard: str) -> None:
        self.root = root
        self.graveyard = graveyard
        self.dirs: dict[int, DirRecord] = {}
        self.buried: set[int] = set()
        """Inodes in the graveyard."""

    # --- changes to the live tree -------------------------------------------------------------------------------

    def touch(self, dir_path: str) -> None:
        """Record a directory's entries before its first change since its last fsync."""
        ino = os.lstat(dir_path).st_ino
        if ino not in self.dirs:
            self.dirs[ino] = DirRecord(listing(dir_path))

    def new_dir(self, ino: int) -> None:
        """A directory made since: none of its entries is durable yet."""
        self.dirs[ino] = DirRecord({})

    def named(self) -> set[int]:
        """Every inode a recorded durable entry names."""
        out: set[int] = set()
        for record in self.dirs.values():
            out.update(record.durable.values())
        return out

    def grave(self, ino: int) -> str:
        return os.path.join(self.graveyard, str(ino))

    def discard(self, path: str, st: os.stat_result) -> bool:
        """Take ``path`` out of the live tree; whether its node is gone (False: kept in the graveyard)."""
        if st.st_ino in self.named():
            grave = self.grave(st.st_ino)
            if st.st_ino in self.buried:
                os.unlink(path)  # another name of the same file went there already
            else:
                os.rename(path, grave)
                self.buried.add(st.st_ino)
            return False
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(path)
            self.dirs.pop(st.st_ino, None)
        else:
            os.unlink(path)
        return True

    def commit(self, ino: int) -> bool:
        """A directory was synced: its entries are durable now; whether it had unsynced changes."""
        return self.dirs.pop(ino, None) is not None

    def collect(self, busy: set[int]) -> list[int]:
        """Delete the graveyard's nodes no durable entry names and no open file holds; the inodes deleted."""
        deleted: list[int] = []
        while True:
            named = self.named()
            gone = [ino for ino in self.buried if ino not in named and ino not in busy]
            if not gone:
                return deleted
            for ino in gone:
                deleted += self._remove_tree(self.grave(ino))
                self.buried.discard(ino)

    def _remove_tree(self, path: str) -> list[int]:
        """Delete a node and everything under it; the inodes gone (a file linked elsewhere too is not)."""
        inos = []
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            for name in os.listdir(path):
                inos += self._remove_tree(os.path.join(path, name))
            os.rmdir(path)
            self.dirs.pop(st.st_ino, None)
        else:
            os.unlink(path)
        if stat.S_ISDIR(st.st_mode) or st.st_nlink <= 1:
            inos.append(st.st_ino)
        return inos

    def unsynced(self) -> dict[str, dict[str, list[str]]]:
        """The live directories whose entries differ from their durable ones (path from the root -> names a power
        loss would take away, and names it would bring back): what a program forgot to sync, for the status."""
        out: dict[str, dict[str, list[str]]] = {}
        for dirpath, _, _ in os.walk(self.root):
            record = self.dirs.get(os.lstat(dirpath).st_ino)
            if record is None:
                continue
            live = listing(dirpath)
            added = sorted(name for name, ino in live.items() if record.durable.get(name) != ino)
            removed = sorted(name for name, ino in record.durable.items() if live.get(name) != ino)
            if added or removed:
                out[os.path.relpath(dirpath, self.root)] = {"not_durable": added, "durable_but_gone": removed}
        return out

    # --- power loss ---------------------------------------------------------------------------------------------

    def restore(self) -> tuple[dict[int, str], list[int], dict[str, int]]:
        """Make the live tree the durable one (see the module docstring).

        Returns where each node of the tree now is (inode -> one of its paths),
        the inodes deleted, and counts: entries removed, entries put back,
        unplaceable entries, nodes deleted.
        """
        counts = {"entries_removed": 0, "entries_restored": 0, "unplaceable": 0, "nodes_deleted": 0}
        self._drop_unsynced_names(counts)
        placed = self._put_back_durable_names(counts)
        deleted: list[int] = []
        for ino in sorted(self.buried):
            deleted += self._remove_tree(self.grave(ino))
        counts["nodes_deleted"] = len(deleted)
        self.buried.clear()
        self.dirs.clear()
        return placed, deleted, counts

    def _park(self, path: str, st: os.stat_result) -> str | None:
        """Move a node to the graveyard; its path there (None: another name of it is there already)."""
        if st.st_ino in self.buried:
            os.unlink(path)
            return None
        grave = self.grave(st.st_ino)
        os.rename(path, grave)
        self.buried.add(st.st_ino)
        return grave

    def _drop_unsynced_names(self, counts: dict[str, int]) -> None:
        queue = [self.root] + [self.grave(ino) for ino in sorted(self.buried)]
        while queue:
            directory = queue.pop()
            st_dir = os.lstat(directory)
            if not stat.S_ISDIR(st_dir.st_mode):
                continue
            record = self.dirs.get(st_dir.st_ino)
            for name, st in sorted(scan(directory).items()):
                path: str | None = os.path.join(directory, name)
                if record is not None and record.durable.get(name) != st.st_ino:
                    path = self._park(os.path.join(directory, name), st)
                    counts["entries_removed"] += 1
                if path is not None and stat.S_ISDIR(st.st_mode):
                    queue.append(path)

    def _put_back_durable_names(self, counts: dict[str, int]) -> dict[int, str]:
        placed: dict[int, str] = {}
        stack = [self.root]
        placed[os.lstat(self.root).st_ino] = self.root
        while stack:
            directory = stack.pop()
            record = self.dirs.get(os.lstat(directory).st_ino)
            if record is not None:
                present = listing(directory)
                for name, ino in sorted(record.durable.items()):
                    if name in present:
                        continue
                    if self._bring(ino, os.path.join(directory, name), placed):
                        counts["entries_restored"] += 1
                    else:
                        counts["unplaceable"] += 1
            for name, st in sorted(scan(directory).items()):
                path = os.path.join(directory, name)
                placed.setdefault(st.st_ino, path)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(path)
        return placed

    def _bring(self, ino: int, path: str, placed: dict[int, str]) -> bool:
        """Put node ``ino`` at ``path``: from the graveyard, or as a link to a file that has a name already."""
        if ino in self.buried:
            os.rename(self.grave(ino), path)
            self.buried.discard(ino)
            return True
        source = placed.get(ino) or self._locate(ino)
        if source is None or stat.S_ISDIR(os.lstat(source).st_mode):
            log.warning(
                "faultfs: power loss: cannot put node %d back at %s (a directory named twice, or gone)", ino, path
            )
            return False
        os.link(source, path, follow_symlinks=False)
        return True

    def _locate(self, ino: int) -> str | None:
        """Where node ``ino`` is now in the live tree (a slow walk: only for a file named by two directories)."""
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                if os.lstat(path).st_ino == ino:
                    return path
        return None


def clear_dir(path: str) -> None:
    """Make ``path`` an empty directory."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
