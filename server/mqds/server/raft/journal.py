"""The durable Raft journals of a node: one write-ahead log shared by every group.

Every group keeps its log, term, vote and members in a
:class:`~mqds.server.raft.group_journal.RaftJournal` (pysyncobj's journal
interface), durable once its ``sync`` returns. All groups of a node write to
one log (:class:`NodeLog`) with group commit: a sync queues the group's
records, and the first syncing thread that finds no write in progress writes
everything queued by every group with one ``write`` and one ``fdatasync``,
then wakes the others (those whose records it wrote return; of the rest, one
writes next). No thread of the log's own
sits between a group and the disk: under load every hop between threads
costs a wait for the GIL. Sixteen groups syncing at once cost one disk flush,
not sixteen (measured on the development machine: concurrent flushes of
separate files took 8 ms at the median and 35 ms at p99, one flush of
their combined data about 1 ms).

The log is a series of ``<dir>/wal-<8 digits>`` segments
(:mod:`mqds.server.raft.segments` has their format), replayed in order at
start (:mod:`mqds.server.raft.recovery`). When the active segment grows
past its size, the writer starts a new one beginning with
every group's state: STATE, then for a group with little in its log
(``copy_bytes``: ``COPY_BYTES``, or a quarter of the node's
``raft_log_max_bytes`` if less; an idle group keeps a couple of entries
after compacting) CLEAR and its entries, and for a busy one just HEAD at its
first live entry. So starting a segment costs little, instead of a rewrite of every live entry
(which stalled every group's sync for a second or more under load). A segment
also starts early, past ``EARLY_ROLL_BYTES``, when every group has so little
in its log that all of it is copied (at most an eighth of the segment): then
every older segment is dead at once. Groups compact when they go idle
(``timing.IdleLog``), so a node whose traffic stopped gives back its log
instead of keeping up to ``segment_bytes`` of dead entries. An older
segment is dropped once it and every segment before it hold only dead
entries: for each group, below what it has durably kept (compacted after a
snapshot), or followed by a CLEAR in a later segment. Dropping renames it
into ``<dir>/dead/`` (durably, before anything else happens to it), where a
thread of its own (:mod:`mqds.server.raft.reaper`) cuts it down a few MiB at
a time and deletes it: deleting 256 MiB at once stalled the node's log
writes 90-155 ms. Replaying the
segments that are left, in order, rebuilds every group: each retained
segment after the first starts with every group's state.

Other modules import the log's names from here: what moved into the modules
named above is re-exported.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     log = NodeLog(d)
...     j = log.journal(7)
...     j.add(b"\\x01", 1, 0); j.add(b"\\x00cmd", 2, 3); j.setCurrentTerm(3, "n2"); j.sync()
...     log.close()
...     again = NodeLog(d).journal(7)
...     (again[-1], again.getCurrentTerm(), again.getVotedForNodeId())
((b'\\x00cmd', 2, 3), 3, 'n2')
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from mqds.server.durable import fsync_dir, make_dirs, write_atomically
from mqds.server.raft.group_journal import NO_FLOOR, RaftJournal
from mqds.server.raft.reaper import DEAD_DIR, Reaper
from mqds.server.raft.reaper import REAP_PAUSE_S as _REAP_PAUSE_S
from mqds.server.raft.reaper import REAP_STEP_BYTES as _REAP_STEP_BYTES
from mqds.server.raft.recovery import Recovered, replay
from mqds.server.raft.segments import (
    CLEAR,
    DROP,
    ENTRY,
    HEAD,
    MAGIC,
    STATE,
    TRUNCATE,
    Entry,
    JournalCorrupt,
    list_segments,
    record,
    segment_name,
    segment_number,
    state_records,
)

__all__ = [
    "CLEAR",
    "COPY_BYTES",
    "DEAD_DIR",
    "DEFAULT_SEGMENT_BYTES",
    "DROP",
    "ENTRY",
    "HEAD",
    "MAGIC",
    "NO_FLOOR",
    "STATE",
    "TRUNCATE",
    "Entry",
    "JournalCorrupt",
    "NodeLog",
    "RaftJournal",
    "fsync_dir",
    "write_atomically",
]

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 256 * 1024 * 1024
# A group with at most this many bytes of entries has them copied into a new
# segment (so a group that went idle does not keep old segments forever).
COPY_BYTES = 1024 * 1024
# A segment past this size starts a new one early when every group's entries fit in the copy.
EARLY_ROLL_BYTES = 1024 * 1024
# os.writev takes at most this many buffers.
_IOV_MAX = os.sysconf("SC_IOV_MAX")


class NodeLog:
    """The write-ahead log of every Raft group on a node, with group commit."""

    def __init__(
        self, directory: str, segment_bytes: int = DEFAULT_SEGMENT_BYTES, copy_bytes: int | None = None
    ) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.copy_bytes = COPY_BYTES if copy_bytes is None else copy_bytes
        """A group with at most this many bytes of entries has them copied into a new segment."""
        make_dirs(directory)
        self._cond = threading.Condition()
        self._queue: list[bytes] = []
        self._queued_round = 1
        self._durable_round = 0
        self._error: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        """Told once, when the log is fenced (a write or sync failed, or ``fail``): the node's disk guard."""
        self._closed = False
        self._journals: dict[int, RaftJournal] = {}
        self.flushes = 0
        self.bytes_written = 0
        # Per group, the lowest index it has durably kept (entries below it
        # are dead everywhere).
        self._floors: dict[int, int] = {}
        self._queued_marks: list[tuple[int, int, int, bool]] = []
        # Whether an old segment may have become deletable since the last look
        # (a floor rose, a group was cleared, a segment started): only then
        # does a write look, not after every one.
        self._look_for_dead = True
        self._dead_dir = os.path.join(directory, DEAD_DIR)
        # The reaper's steps are read here, so that tests can make them small on this module.
        self._reaper = Reaper(_REAP_STEP_BYTES, _REAP_PAUSE_S)
        if os.path.isdir(self._dead_dir):
            # Dropped before a restart and not deleted yet.
            self._reaper.add(os.path.join(self._dead_dir, n) for n in sorted(os.listdir(self._dead_dir)))
        replayed = replay(directory)
        # What the log tells of each segment (by number), kept up by every
        # write: per group, the highest entry index written to it.
        self._segment_entries: dict[int, dict[int, int]] = replayed.segment_entries
        # Per group, the last segment with a CLEAR of it: its entries in
        # earlier segments are dead.
        self._cleared_in: dict[int, int] = replayed.cleared_in
        # Groups recovered but not opened (yet).
        self._recovered: dict[int, Recovered] = replayed.groups
        for group, recovered in self._recovered.items():
            self._floors[group] = recovered.entries[0][1] if recovered.entries else NO_FLOOR
        self._open_active()
        # True while a thread is writing (one at a time; see wait_durable).
        self._writing = False

    # -- files -------------------------------------------------------------------

    def _open_active(self) -> None:
        segments = list_segments(self.directory)
        if segments:
            self._active = segments[-1]
        else:
            self._active = os.path.join(self.directory, segment_name(1))
            write_atomically(self._active, MAGIC)
        self._fd = os.open(self._active, os.O_WRONLY | os.O_APPEND)
        self._active_size = os.fstat(self._fd).st_size

    # -- journals ------------------------------------------------------------------

    def journal(self, group: int) -> RaftJournal:
        """The journal of ``group`` (with what the log held for it)."""
        recovered = self._recovered.pop(group, None) or Recovered()
        journal = RaftJournal(self, group, recovered)
        self._journals[group] = journal
        return journal

    def drop_group(self, group: int) -> None:
        """Forget a group for good (its replica was deleted); durable when this returns."""
        self._journals.pop(group, None)
        self._recovered.pop(group, None)
        self.wait_durable(self.queue([record(group, DROP)], group, 0, NO_FLOOR, cleared=True))

    def queue(
        self,
        records: list[bytes],
        group: int | None = None,
        last_entry: int = 0,
        floor: int = 0,
        cleared: bool = False,
    ) -> int:
        """Queue records for the next write (with whatever other groups queue); the round ``wait_durable`` waits for.

        ``group`` names the group whose records they are: ``last_entry`` is
        the highest entry index among them (0 if none), ``floor`` the lowest
        index the group keeps once they are written (``NO_FLOOR`` when it
        keeps none) and ``cleared`` whether they clear its log, so the
        log knows which segments still hold live entries.
        """
        with self._cond:
            if self._closed:
                raise RuntimeError("the Raft log is closed")
            self._queue.extend(records)
            if group is not None:
                self._queued_marks.append((group, last_entry, floor, cleared))
            return self._queued_round

    def wait_durable(self, round_: int) -> None:
        """Return once every record queued up to ``round_`` is on disk, writing them on this thread if nobody is."""
        with self._cond:
            while self._durable_round < round_ and self._error is None:
                if self._writing:
                    self._cond.wait()
                else:
                    self._write_queued()
            if self._durable_round < round_ and self._error is not None:
                raise OSError(f"writing the Raft log failed: {self._error}")

    def close(self) -> None:
        """Write what is still queued, then close the active segment (no sync is accepted after this)."""
        self._reaper.stop()
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: not self._writing, timeout=30)
            if self._writing:
                return  # a write stuck for 30 s: leave its file open rather than pull it away
            if self._queue and self._error is None:
                self._write_queued()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    # -- writing (on whichever thread syncs first) ----------------------------------

    def _write_queued(self) -> None:
        """Write what every group queued, on the calling thread, and wake whoever waits for it.

        Called holding ``_cond`` while no write is in progress; the lock is
        released during the write, so other groups queue for the next one.
        """
        self._writing = True
        batch, self._queue = self._queue, []
        marks, self._queued_marks = self._queued_marks, []
        round_ = self._queued_round
        self._queued_round += 1
        failure: BaseException | None = None
        self._cond.release()
        try:
            self._write(batch, marks)
        except BaseException as err:  # the log's state on disk is unknown: refuse every later write
            log.exception("writing the Raft log failed")
            failure = err
        finally:
            self._cond.acquire()
        self._writing = False
        if failure is None:
            self._durable_round = round_
        else:
            self._fence(failure)
        self._cond.notify_all()

    def fail(self, err: BaseException) -> None:
        """Fence the log because the node's disk failed elsewhere (a replica's storage could not write)."""
        with self._cond:
            self._fence(err)
            self._cond.notify_all()

    @property
    def failure(self) -> BaseException | None:
        """Why the log was fenced (None while it takes writes)."""
        return self._error

    def _fence(self, err: BaseException) -> None:
        """Refuse every later write: what a failed write or fsync left on disk is unknown (never retried)."""
        if self._error is not None:
            return
        self._error = err
        if self.on_failure is not None:
            self.on_failure(err)

    def _write(self, batch: list[bytes], marks: list[tuple[int, int, int, bool]]) -> None:
        """Append ``batch`` to the active segment and flush it; then roll over and delete what is dead."""
        size = sum(map(len, batch))
        # Gathered by the kernel: joining first copied every record once more
        # (a whole large batch). A short write (a full disk, a signal) goes on
        # from where it stopped.
        written = os.writev(self._fd, batch) if len(batch) <= _IOV_MAX else 0
        if written < size:
            view = memoryview(b"".join(batch))[written:]
            while view:
                view = view[os.write(self._fd, view) :]
        os.fdatasync(self._fd)
        self.flushes += 1
        self.bytes_written += size
        self._active_size += size
        active = segment_number(self._active)
        entries = self._segment_entries.setdefault(active, {})
        for group, last_entry, floor, cleared in marks:
            if last_entry > entries.get(group, 0):
                entries[group] = last_entry
            if floor > self._floors.get(group, NO_FLOOR) or cleared:
                self._look_for_dead = True
            self._floors[group] = floor
            if cleared:
                self._cleared_in[group] = active
        if self._active_size > self.segment_bytes or (self._look_for_dead and self._little_left()):
            self._rotate()
            self._look_for_dead = True
        if self._look_for_dead and len(self._segment_entries) > 1:
            self._delete_dead_segments()
        self._look_for_dead = False

    def _little_left(self) -> bool:
        """Whether starting a segment now would copy every group's entries, and little (an eighth of the active one)."""
        if self._active_size <= EARLY_ROLL_BYTES:
            return False
        sizes = [journal.size_bytes for journal in list(self._journals.values())]
        sizes.extend(sum(len(e[0]) for e in r.entries) for r in self._recovered.values())
        return all(size <= self.copy_bytes for size in sizes) and sum(sizes) <= self._active_size // 8

    def _rotate(self) -> None:
        """Start a segment with every group's state, and the entries of groups holding at most ``copy_bytes``."""
        number = segment_number(self._active) + 1
        path = os.path.join(self.directory, segment_name(number))
        parts = [MAGIC]
        copied: dict[int, int] = {}
        for journal in list(self._journals.values()):
            records, last = journal.state_records(self.copy_bytes)
            parts.extend(records)
            if last is not None:
                copied[journal.group] = last
        for group, recovered in self._recovered.items():
            # Groups recovered but not opened (yet): their state and entries as recovered.
            parts.extend(state_records(group, recovered.entries, recovered, copy=True))
            copied[group] = recovered.entries[-1][1] if recovered.entries else 0
        write_atomically(path, b"".join(parts))
        os.close(self._fd)
        self._active = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._active_size = os.fstat(self._fd).st_size
        self._segment_entries[number] = {group: last for group, last in copied.items() if last}
        for group in copied:
            self._cleared_in[group] = number
        log.info("Raft log: started segment %d (%d bytes of group state)", number, self._active_size)

    def _delete_dead_segments(self) -> None:
        """Delete the oldest segments while every entry in them is dead."""
        active = segment_number(self._active)
        deleted = []
        for number in sorted(self._segment_entries):
            if number >= active:
                break
            written = self._segment_entries[number]
            if any(
                last >= self._floors.get(group, NO_FLOOR) and self._cleared_in.get(group, 0) <= number
                for group, last in written.items()
            ):
                break
            # Out of the log at once (a rename); deleted in the background.
            name = segment_name(number)
            os.makedirs(self._dead_dir, exist_ok=True)
            os.rename(os.path.join(self.directory, name), os.path.join(self._dead_dir, name))
            del self._segment_entries[number]
            deleted.append(name)
        if deleted:
            # Only once no segment can come back into the log after a crash
            # is it cut down (a half-cut segment in the log would be damage).
            fsync_dir(self.directory)
            self._reaper.add(os.path.join(self._dead_dir, name) for name in deleted)
            log.info("Raft log: dropped segment(s) %s, every entry in them compacted", deleted)
