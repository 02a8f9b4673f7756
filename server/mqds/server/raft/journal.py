"""The durable Raft journals of a node: one write-ahead log shared by every group.

pysyncobj's own file journal writes entries into an mmap it does not flush
before acknowledging them, and stores term and vote with a rename but no
fsync. Here every group gets a :class:`RaftJournal` with pysyncobj's
interface (``pysyncobj.journal.Journal``) and a different contract: changes
are kept in memory and recorded, and :meth:`RaftJournal.sync` returns once
all of them are on disk. A group calls it before it lets any message leave
the node, so a follower's acknowledgement and a vote are only ever sent for
what is on disk.

All groups of a node write to one log (:class:`NodeLog`) with group commit:
a sync queues the group's records, and the first syncing thread that finds
no write in progress writes everything queued by every group with one
``write`` and one ``fdatasync``, then wakes the others (those whose records
it wrote return; of the rest, one writes next). No thread of the log's own
sits between a group and the disk: under load every hop between threads
costs a wait for the GIL. Sixteen groups syncing at once cost one disk flush,
not sixteen (measured on the development machine: concurrent flushes of
separate files took 8 ms at the median and 35 ms at p99, one flush of
their combined data about 1 ms).

On disk, ``<dir>/wal-<8 digits>`` segments hold records
``u32 length | u32 group | u8 kind | body | u32 crc32`` (little-endian; the
CRC covers group, kind and body) after an 8-byte magic ``MQDSWAL1``:

====  ========  ===================================================================
kind  name      body
====  ========  ===================================================================
1     ENTRY     u64 index, u64 term, command: replaces entries from ``index`` on
2     TRUNCATE  u64 index: entries from ``index`` on are gone (rejected by a leader)
3     HEAD      u64 index: entries before ``index`` are gone (compacted)
4     CLEAR     the group's log is empty (a snapshot was installed)
5     STATE     u64 term, u64 commit index, u16 + UTF-8 vote, u16 count + 1 (0: no
                member list) and each member as u16 + UTF-8
6     DROP      the replica was deleted from this node: forget the group
====  ========  ===================================================================

A record cut short at the end of the last segment (a crash during a write)
is cut off on open; damage anywhere else refuses to start. When the active
segment grows past its size, the writer starts a new one beginning with
every group's state: STATE, then for a group with little in its log
(``copy_bytes``: ``COPY_BYTES``, or a quarter of the node's
``raft_log_max_bytes`` if less; an idle group keeps a couple of entries
after compacting) CLEAR and its entries, and for a busy one just HEAD at its
first live entry. So starting a segment costs little, instead of a rewrite of every live entry
(which stalled every group's sync for a second or more under load). An older
segment is dropped once it and every segment before it hold only dead
entries: for each group, below what it has durably kept (compacted after a
snapshot), or followed by a CLEAR in a later segment. Dropping renames it
into ``<dir>/dead/`` (durably, before anything else happens to it), where a
thread of its own cuts it down a few MiB at a time and deletes it: deleting
256 MiB at once stalled the node's log writes 90-155 ms. Replaying the
segments that are left, in order, rebuilds every group: each retained
segment after the first starts with every group's state.

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

import collections
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pysyncobj.journal import Journal

log = logging.getLogger(__name__)

MAGIC = b"MQDSWAL1"
ENTRY, TRUNCATE, HEAD, CLEAR, STATE, DROP = 1, 2, 3, 4, 5, 6

_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<IB")  # group, kind
_ENTRY = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
_STATE = struct.Struct("<QQ")
_U16 = struct.Struct("<H")

DEFAULT_SEGMENT_BYTES = 256 * 1024 * 1024
# The live floor of a group without live entries: everything it wrote is dead.
NO_FLOOR = 2**64
# A group with at most this many bytes of entries has them copied into a new
# segment (so a group that went idle does not keep old segments forever).
COPY_BYTES = 1024 * 1024
# How often a changed commit index alone is recorded.
_COMMIT_RECORD_INTERVAL_S = 1.0

Entry = tuple[bytes, int, int]


class JournalCorrupt(RuntimeError):
    """The log cannot be read; the message says where and why."""


def _record(group: int, kind: int, body: bytes = b"") -> bytes:
    inner = _HEAD.pack(group, kind) + body
    return _LEN.pack(len(inner)) + inner + _LEN.pack(zlib.crc32(inner))


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _U16.pack(len(raw)) + raw


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new file, both whole."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


@dataclass
class _Recovered:
    entries: list[Entry] = field(default_factory=list)
    term: int = 0
    commit: int = 1
    voted_for: str | None = None
    members: list[str] | None = None

    def apply(self, kind: int, body: bytes) -> None:
        entries = self.entries
        if kind == ENTRY:
            index, term = _ENTRY.unpack_from(body)
            while entries and entries[-1][1] >= index:
                entries.pop()
            entries.append((bytes(body[_ENTRY.size :]), index, term))
        elif kind == TRUNCATE:
            (index,) = _U64.unpack_from(body)
            while entries and entries[-1][1] >= index:
                entries.pop()
        elif kind == HEAD:
            (index,) = _U64.unpack_from(body)
            keep = next((i for i, e in enumerate(entries) if e[1] >= index), len(entries))
            del entries[:keep]
        elif kind == CLEAR:
            entries.clear()
        elif kind == STATE:
            self.term, self.commit = _STATE.unpack_from(body)
            pos = _STATE.size
            voted, pos = _read_text(body, pos)
            self.voted_for = voted or None
            (count,) = _U16.unpack_from(body, pos)
            pos += 2
            if count:
                members = []
                for _ in range(count - 1):
                    member, pos = _read_text(body, pos)
                    members.append(member)
                self.members = members
        else:
            raise ValueError(f"unknown record kind {kind}")


def _read_text(body: bytes, pos: int) -> tuple[str, int]:
    (size,) = _U16.unpack_from(body, pos)
    pos += 2
    return bytes(body[pos : pos + size]).decode("utf-8"), pos + size


class NodeLog:
    """The write-ahead log of every Raft group on a node, with group commit."""

    def __init__(
        self, directory: str, segment_bytes: int = DEFAULT_SEGMENT_BYTES, copy_bytes: int | None = None
    ) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.copy_bytes = COPY_BYTES if copy_bytes is None else copy_bytes
        """A group with at most this many bytes of entries has them copied into a new segment."""
        os.makedirs(directory, exist_ok=True)
        self._cond = threading.Condition()
        self._queue: list[bytes] = []
        self._queued_round = 1
        self._durable_round = 0
        self._error: BaseException | None = None
        self._closed = False
        self._journals: dict[int, RaftJournal] = {}
        self.flushes = 0
        self.bytes_written = 0
        # What the writes so far tell of each segment (by number): per group,
        # the highest entry index written to it; and per group, the lowest
        # index it has durably kept (entries below it are dead everywhere).
        self._segment_entries: dict[int, dict[int, int]] = {}
        self._floors: dict[int, int] = {}
        # Per group, the last segment with a CLEAR of it: its entries in
        # earlier segments are dead.
        self._cleared_in: dict[int, int] = {}
        self._queued_marks: list[tuple[int, int, int, bool]] = []
        # Whether an old segment may have become deletable since the last look
        # (a floor rose, a group was cleared, a segment started): only then
        # does a write look, not after every one.
        self._look_for_dead = True
        self._dead_dir = os.path.join(directory, DEAD_DIR)
        self._reaper = _Reaper()
        if os.path.isdir(self._dead_dir):
            # Dropped before a restart and not deleted yet.
            self._reaper.add(os.path.join(self._dead_dir, n) for n in sorted(os.listdir(self._dead_dir)))
        self._recovered = self._recover()
        for group, recovered in self._recovered.items():
            self._floors[group] = recovered.entries[0][1] if recovered.entries else NO_FLOOR
        self._open_active()
        # True while a thread is writing (one at a time; see persist).
        self._writing = False

    # -- files -------------------------------------------------------------------

    def _segments(self) -> list[str]:
        names = sorted(n for n in os.listdir(self.directory) if n.startswith("wal-") and n[4:].isdigit())
        return [os.path.join(self.directory, n) for n in names]

    def _recover(self) -> dict[int, _Recovered]:
        groups: dict[int, _Recovered] = {}
        segments = self._segments()
        for position, path in enumerate(segments):
            last = position == len(segments) - 1
            written: dict[int, int] = {}
            number = _segment_number(path)
            for group, kind, body in self._read_segment(path, last):
                if kind == DROP:
                    groups.pop(group, None)
                    self._cleared_in[group] = number
                else:
                    groups.setdefault(group, _Recovered()).apply(kind, body)
                    if kind == ENTRY:
                        written[group] = max(written.get(group, 0), _ENTRY.unpack_from(body)[0])
                    elif kind == CLEAR:
                        self._cleared_in[group] = number
            self._segment_entries[number] = written
        return groups

    def _read_segment(self, path: str, last: bool) -> Iterator[tuple[int, int, bytes]]:
        with open(path, "rb") as fh:
            raw = fh.read()
        if not raw.startswith(MAGIC):
            if last and len(raw) < len(MAGIC):
                os.remove(path)  # created but never written: a crash during rotation
                return
            raise JournalCorrupt(f"{path}: not an mqds Raft log segment")
        pos = len(MAGIC)
        end = len(raw)
        while pos + 4 <= end:
            (size,) = _LEN.unpack_from(raw, pos)
            stop = pos + 4 + size + 4
            if size < _HEAD.size or stop > end:
                break
            inner = raw[pos + 4 : pos + 4 + size]
            if zlib.crc32(inner) != _LEN.unpack_from(raw, pos + 4 + size)[0]:
                break
            group, kind = _HEAD.unpack_from(inner)
            if kind not in (ENTRY, TRUNCATE, HEAD, CLEAR, STATE, DROP):
                break
            yield group, kind, memoryview(inner)[_HEAD.size :].tobytes()
            pos = stop
        if pos != end:
            if not last:
                raise JournalCorrupt(f"{path}: damaged record at byte {pos} (not at the end of the log)")
            # A record cut short by a crash: everything acknowledged before it
            # was synced whole, so cut it off.
            log.warning("%s: cutting %d bytes of a torn record at the end", path, end - pos)
            with open(path, "r+b") as out:
                out.truncate(pos)
                out.flush()
                os.fsync(out.fileno())

    def _open_active(self) -> None:
        segments = self._segments()
        if segments:
            self._active = segments[-1]
        else:
            self._active = os.path.join(self.directory, "wal-00000001")
            write_atomically(self._active, MAGIC)
        self._fd = os.open(self._active, os.O_WRONLY | os.O_APPEND)
        self._active_size = os.fstat(self._fd).st_size

    # -- journals ------------------------------------------------------------------

    def journal(self, group: int) -> RaftJournal:
        """The journal of ``group`` (with what the log held for it)."""
        recovered = self._recovered.pop(group, None) or _Recovered()
        journal = RaftJournal(self, group, recovered)
        self._journals[group] = journal
        return journal

    def drop_group(self, group: int) -> None:
        """Forget a group for good (its replica was deleted); durable when this returns."""
        self._journals.pop(group, None)
        self._recovered.pop(group, None)
        self.persist([_record(group, DROP)], group, 0, NO_FLOOR, cleared=True)

    def persist(
        self,
        records: list[bytes],
        group: int | None = None,
        last_entry: int = 0,
        floor: int = 0,
        cleared: bool = False,
    ) -> None:
        """Write records and return once they are on disk (with whatever other groups queued).

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
            mine = self._queued_round
            while self._durable_round < mine and self._error is None:
                if self._writing:
                    self._cond.wait()
                else:
                    self._write_queued()
            if self._durable_round < mine and self._error is not None:
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
            self._error = failure
        self._cond.notify_all()

    def _write(self, batch: list[bytes], marks: list[tuple[int, int, int, bool]]) -> None:
        """Append ``batch`` to the active segment and flush it; then roll over and delete what is dead."""
        data = b"".join(batch)
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fdatasync(self._fd)
        self.flushes += 1
        self.bytes_written += len(data)
        self._active_size += len(data)
        active = _segment_number(self._active)
        entries = self._segment_entries.setdefault(active, {})
        for group, last_entry, floor, cleared in marks:
            if last_entry > entries.get(group, 0):
                entries[group] = last_entry
            if floor > self._floors.get(group, NO_FLOOR) or cleared:
                self._look_for_dead = True
            self._floors[group] = floor
            if cleared:
                self._cleared_in[group] = active
        if self._active_size > self.segment_bytes:
            self._rotate()
            self._look_for_dead = True
        if self._look_for_dead and len(self._segment_entries) > 1:
            self._delete_dead_segments()
        self._look_for_dead = False

    def _rotate(self) -> None:
        """Start a segment with every group's state, and the entries of groups holding at most ``copy_bytes``."""
        number = _segment_number(self._active) + 1
        path = os.path.join(self.directory, f"wal-{number:08d}")
        parts = [MAGIC]
        copied: dict[int, int] = {}
        for journal in list(self._journals.values()):
            records, last = journal.state_records(self.copy_bytes)
            parts.extend(records)
            if last is not None:
                copied[journal.group] = last
        for group, recovered in self._recovered.items():
            # Groups recovered but not opened (yet): their state and entries as recovered.
            parts.extend(_state_records(group, recovered.entries, recovered, copy=True))
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
        active = _segment_number(self._active)
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
            name = f"wal-{number:08d}"
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


DEAD_DIR = "dead"
"""Where dead segments wait, under the log's directory, to be deleted a few MiB at a time."""
_REAP_STEP_BYTES = 8 * 1024 * 1024
_REAP_PAUSE_S = 0.02


class _Reaper:
    """Deletes dead segments on a thread of its own, cutting each down a few MiB at a time.

    Deleting a 256 MiB segment at once took 90-155 ms on ext4 mounted with
    ``discard`` (the freed blocks are trimmed in the journal commit), and ran
    inside a log write, so every group of the node waited for it; other
    files' ``fdatasync`` on the disk waited too. Truncated in steps with a
    pause between them, the same delete costs other writers a few ms at most.
    The thread runs only while there is something to delete.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: collections.deque[str] = collections.deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.deleted = 0

    def add(self, paths: Iterable[str]) -> None:
        with self._lock:
            self._pending.extend(paths)
            if self._pending and self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="raft-log-reaper", daemon=True)
                self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop deleting (what is left is deleted when the log is opened again)."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Until nothing is left to delete (tests); whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._thread is None:
                    return True
            time.sleep(0.01)
        return False

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending or self._stopping:
                    self._thread = None
                    return
                path = self._pending.popleft()
            try:
                self._delete(path)
            except OSError as err:
                log.warning("Raft log: could not delete the dead segment %s: %s", path, err)

    def _delete(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            size = os.fstat(fd).st_size
            while size > 0:
                if self._stopping:
                    return
                size = max(0, size - _REAP_STEP_BYTES)
                os.ftruncate(fd, size)
                time.sleep(_REAP_PAUSE_S)
        finally:
            os.close(fd)
        os.remove(path)
        self.deleted += 1


def _segment_number(path: str) -> int:
    return int(os.path.basename(path)[4:])


def _state_body(term: int, commit: int, voted_for: str | None, members: list[str] | None) -> bytes:
    parts = [_STATE.pack(term, commit), _text(voted_for or "")]
    if members is None:
        parts.append(_U16.pack(0))
    else:
        parts.append(_U16.pack(len(members) + 1))
        parts.extend(_text(m) for m in members)
    return b"".join(parts)


def _state_records(group: int, entries: Sequence[Entry], state: Any, copy: bool) -> list[bytes]:
    """What a new segment starts with for a group: its state, then its entries or where they begin."""
    records = [_record(group, STATE, _state_body(state.term, state.commit, state.voted_for, state.members))]
    if copy or not entries:
        records.append(_record(group, CLEAR))
        records.extend(_record(group, ENTRY, _ENTRY.pack(idx, term) + cmd) for cmd, idx, term in entries)
    else:
        records.append(_record(group, HEAD, _U64.pack(entries[0][1])))
    return records


class RaftJournal(Journal):
    """Raft log, term, vote and membership of one group, durable on :meth:`sync`."""

    def __init__(self, node_log: NodeLog, group: int, recovered: _Recovered) -> None:
        self._log = node_log
        self.group = group
        self._lock = threading.Lock()
        self._entries: list[Entry] = recovered.entries
        self._bytes = sum(len(e[0]) for e in self._entries)
        self.term = recovered.term
        self.voted_for = recovered.voted_for
        self.commit = recovered.commit
        self._members = recovered.members
        self._pending: list[bytes] = []
        self._pending_last_entry = 0
        self._pending_cleared = False
        self._state_dirty = False
        self._commit_dirty = False
        self._state_recorded_at = 0.0
        self._dir_to_sync: str | None = None
        self.syncs = 0

    # -- pysyncobj's Journal interface -----------------------------------------

    def add(self, command: bytes, idx: int, term: int) -> None:
        with self._lock:
            self._entries.append((command, idx, term))
            self._bytes += len(command)
            self._pending.append(_record(self.group, ENTRY, _ENTRY.pack(idx, term) + command))
            if idx > self._pending_last_entry:
                self._pending_last_entry = idx

    def clear(self) -> None:
        with self._lock:
            self._entries = []
            self._bytes = 0
            self._pending.append(_record(self.group, CLEAR))
            self._pending_cleared = True

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        with self._lock:
            if entryFrom >= len(self._entries):
                return
            index = self._entries[entryFrom][1]
            self._bytes -= sum(len(e[0]) for e in self._entries[entryFrom:])
            del self._entries[entryFrom:]
            self._pending.append(_record(self.group, TRUNCATE, _U64.pack(index)))

    def deleteEntriesTo(self, entryTo: int) -> None:
        with self._lock:
            if entryTo <= 0:
                return
            self._bytes -= sum(len(e[0]) for e in self._entries[:entryTo])
            del self._entries[:entryTo]
            head = self._entries[0][1] if self._entries else 0
            self._pending.append(_record(self.group, HEAD, _U64.pack(head)))

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        self.sync()

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        if raftCommitIndex != self.commit:
            self.commit = raftCommitIndex
            self._commit_dirty = True

    def getRaftCommitIndex(self) -> int:
        return self.commit

    def setCurrentTerm(self, term: int, votedForNodeId: str | None) -> None:
        self.term = term
        self.voted_for = votedForNodeId
        self._state_dirty = True

    def getCurrentTerm(self) -> int:
        return self.term

    def getVotedForNodeId(self) -> str | None:
        return self.voted_for

    def onOneSecondTimer(self) -> None:
        pass

    # -- mqds ------------------------------------------------------------------

    @property
    def members(self) -> list[str] | None:
        """The group's members as last recorded, or None if never recorded."""
        return None if self._members is None else list(self._members)

    def set_members(self, members: Sequence[str]) -> None:
        """Record the group's membership (made durable by the next sync)."""
        self._members = sorted(members)
        self._state_dirty = True

    @property
    def size_bytes(self) -> int:
        """Bytes of commands held (what compaction is triggered by)."""
        return self._bytes

    def sync_directory_first(self, path: str) -> None:
        """Make the next sync fsync ``path`` first (a snapshot renamed into it must outlive what it replaces)."""
        self._dir_to_sync = path

    def sync(self) -> None:
        """Make every change so far durable. Call before any message leaves the node."""
        with self._lock:
            if self._state_dirty or (
                self._commit_dirty and time.monotonic() - self._state_recorded_at > _COMMIT_RECORD_INTERVAL_S
            ):
                body = _state_body(self.term, self.commit, self.voted_for, self._members)
                self._pending.append(_record(self.group, STATE, body))
                self._state_dirty = self._commit_dirty = False
                self._state_recorded_at = time.monotonic()
            records, self._pending = self._pending, []
            last_entry, self._pending_last_entry = self._pending_last_entry, 0
            cleared, self._pending_cleared = self._pending_cleared, False
            floor = self._entries[0][1] if self._entries else NO_FLOOR
        if not records:
            return
        if self._dir_to_sync is not None:
            fsync_dir(self._dir_to_sync)
            self._dir_to_sync = None
        self._log.persist(records, self.group, last_entry, floor, cleared)
        self.syncs += 1

    def state_records(self, copy_bytes: int) -> tuple[list[bytes], int | None]:
        """What a new log segment starts with for this journal, and the last entry copied into it.

        Its entries are copied when they hold at most ``copy_bytes``
        (the last index copied is returned, 0 for none); otherwise only where
        they begin (and None).
        """
        with self._lock:
            copy = self._bytes <= copy_bytes
            last = (self._entries[-1][1] if self._entries else 0) if copy else None
            return _state_records(self.group, self._entries, self, copy), last
