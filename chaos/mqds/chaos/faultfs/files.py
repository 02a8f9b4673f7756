"""What a file would hold after a power loss: its durable size and the durable bytes its unsynced writes covered.

A file the filesystem has not seen written since the mount, or since its last
fsync, has no record: what is there is durable. The first write, truncate or
create makes a :class:`FileRecord` (keyed by the backing inode number), which
keeps the *undo* of everything not yet synced:

- ``durable_size``: the size an fsync last made durable (0 for a file created
  since); bytes past it are simply cut off by a power loss, so appends, the
  common case (the Raft log, RocksDB's WAL and tables), cost nothing to track;
- ``saved``: the ranges below ``durable_size`` that were overwritten or cut by
  a truncate since then, whose durable bytes were first copied into an undo
  file (sparse, each byte at its own offset, created only when needed);
- ``lost``: ranges a failed fsync took: Linux marks the pages of a failed
  writeback clean, so a later fsync that succeeds does not write them (the
  PostgreSQL "fsyncgate" lesson). Their durable bytes (the old ones, or zeros
  past the old size) stay in the undo file through later good fsyncs, until
  the range is written again;
- ``written`` and ``last_write``: what was written since the last fsync (the
  ranges a failed fsync loses) and the last run of writes, each beginning
  where the one before ended (the one a power loss may tear: a ``write()``
  reaches the filesystem cut at page boundaries, a log appends records).

An fsync that succeeds makes the live file durable (``durable_size`` = its
size) except the ``lost`` ranges; when none are left the record is dropped.
A power loss truncates the live file to ``durable_size``, copies the saved
ranges back from the undo file and, when asked, writes a prefix of the last
unsynced write back on top (a torn write).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from mqds.chaos.faultfs.extents import Extents


def copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """Copy ``length`` bytes at ``offset`` of ``src`` to the same offset of ``dst`` (both file descriptors)."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, length - done, offset + done, offset + done)
        except OSError:
            n = 0
        if n <= 0:  # not supported between these files, or the source is short: copy by hand
            chunk = os.pread(src, min(length - done, 1 << 20), offset + done)
            if not chunk:
                # The source ends before the range: what is left reads as zeros.
                chunk = bytes(min(length - done, 1 << 20))
            n = os.pwrite(dst, chunk, offset + done)
        done += n


@dataclass
class FileRecord:
    """The undo of one file's unsynced writes (see the module docstring)."""

    ino: int
    durable_size: int
    undo_path: str
    saved: Extents = field(default_factory=Extents)
    lost: Extents = field(default_factory=Extents)
    written: Extents = field(default_factory=Extents)
    last_write: tuple[int, int] | None = None
    _undo_fd: int = -1

    # --- before the live file changes -------------------------------------------------------------------------

    def before_write(self, live: int, offset: int, length: int) -> None:
        """Save the durable bytes ``[offset, offset+length)`` will overwrite; note the write."""
        self._save(live, offset, min(offset + length, self.durable_size))
        # Written again: the bytes are dirty once more, and the next good fsync makes them durable.
        self.lost.remove(offset, offset + length)
        self.written.add(offset, offset + length)
        if self.last_write is not None and sum(self.last_write) == offset:
            # The next write of a run (the kernel splits a write() at page boundaries; a log appends record after
            # record): a torn write tears the run.
            self.last_write = (self.last_write[0], self.last_write[1] + length)
        else:
            self.last_write = (offset, length)

    def before_truncate(self, live: int, live_size: int, new_size: int) -> None:
        """Save the durable bytes a truncate to ``new_size`` cuts off."""
        if new_size < live_size:
            self._save(live, new_size, min(live_size, self.durable_size))
            self.written.clip(new_size)
            if self.last_write is not None:
                offset, length = self.last_write
                self.last_write = (offset, min(length, new_size - offset)) if offset < new_size else None

    def _save(self, live: int, start: int, end: int) -> None:
        for s, e in self.saved.missing(start, end):
            copy_range(live, self._undo(), s, e - s)
            self.saved.add(s, e)

    def _undo(self) -> int:
        if self._undo_fd < 0:
            self._undo_fd = os.open(self.undo_path, os.O_RDWR | os.O_CREAT, 0o600)
        return self._undo_fd

    # --- fsync ---------------------------------------------------------------------------------------------------

    def commit(self, live_size: int) -> bool:
        """An fsync succeeded: the live file is durable but for the lost ranges; whether the record is now clean."""
        self.durable_size = live_size
        self.lost.clip(live_size)
        self.saved = Extents(self.lost.ranges())
        self.written.clear()
        self.last_write = None
        return not self.lost

    def fail(self) -> int:
        """An fsync failed: what was written since the last one is lost for good; how many bytes."""
        zeros = [(s, e) for s, e in self.written if e > self.durable_size]
        for s, e in zeros:
            # Past the durable size the old content is nothing: zeros, should a later fsync extend the file.
            start = max(s, self.durable_size)
            for zs, ze in self.saved.missing(start, e):
                os.pwrite(self._undo(), bytes(ze - zs), zs)
                self.saved.add(zs, ze)
        lost = self.written.total()
        for s, e in self.written:
            self.lost.add(s, e)
        self.written.clear()
        self.last_write = None
        return lost

    # --- power loss -----------------------------------------------------------------------------------------------

    def torn_bytes(self, live: int, live_size: int, keep: float) -> tuple[int, bytes] | None:
        """A prefix (``keep`` of it: 1 byte at least, never all) of the last unsynced write, as the file has it."""
        if self.last_write is None:
            return None
        offset, length = self.last_write
        length = min(length, live_size - offset)
        if length < 2:
            return None
        prefix = min(length - 1, max(1, int(length * keep)))
        return offset, os.pread(live, prefix, offset)

    def restore(self, live: int) -> int:
        """Make the live file what is durable; how many bytes of it changed (cut or put back)."""
        live_size = os.fstat(live).st_size
        changed = max(0, live_size - self.durable_size)
        os.ftruncate(live, self.durable_size)
        for s, e in self.saved.overlap(0, self.durable_size):
            copy_range(self._undo(), live, s, e - s)
            changed += e - s
        return changed

    def close(self) -> None:
        """Forget the undo file."""
        if self._undo_fd >= 0:
            os.close(self._undo_fd)
            self._undo_fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.undo_path)
