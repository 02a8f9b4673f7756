"""The durable Raft journal of one group: what pysyncobj's log rests on.

pysyncobj's own file journal writes entries into an mmap it does not flush
before acknowledging them, and stores term and vote with a rename but no
fsync. This journal keeps the same interface (``pysyncobj.journal.Journal``)
with a different contract: every change is buffered, and :meth:`sync` makes
all of them durable (``fdatasync``) before the group lets any message leave
the node. So a follower's acknowledgement and a vote are only ever sent for
what is on disk.

Files in the group's directory:

``journal``
    ``b"MQDSJRN1"``, then records ``u32 length | u8 kind | body | u32 crc32``
    (little-endian; the CRC covers kind and body). Kind 1 is an entry
    (``u64 index, u64 term, command``), kind 2 removes the entries from an
    index on (a rejected tail). A torn record at the end (a crash during a
    write) is cut off on open. Compaction and ``clear`` rewrite the file.
``state``
    ``b"MQDSRST1"``, ``u64 term``, ``u64 commit index``, ``u16`` length and
    UTF-8 of the node voted for (empty: none), ``u16`` count and the member
    ids of the group, each ``u16`` length + UTF-8, and a CRC-32. Replaced
    atomically (write, fsync, rename, fsync of the directory).

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     j = RaftJournal(d)
...     j.add(b"\\x01", 1, 0); j.add(b"\\x00cmd", 2, 3); j.setCurrentTerm(3, "n2"); j.sync()
...     j._destroy()
...     again = RaftJournal(d)
...     (again[-1], again.getCurrentTerm(), again.getVotedForNodeId())
((b'\\x00cmd', 2, 3), 3, 'n2')
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Sequence
from typing import Any

from pysyncobj.journal import Journal

log = logging.getLogger(__name__)

JOURNAL_MAGIC = b"MQDSJRN1"
STATE_MAGIC = b"MQDSRST1"
KIND_ENTRY = 1
KIND_TRUNCATE = 2

_LEN = struct.Struct("<I")
_ENTRY_HEAD = struct.Struct("<BQQ")
_TRUNCATE = struct.Struct("<BQ")
_STATE_HEAD = struct.Struct("<QQ")
_U16 = struct.Struct("<H")

# How often a changed commit index alone is written to the state file.
_COMMIT_PERSIST_INTERVAL_S = 1.0

Entry = tuple[bytes, int, int]


def _record(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body + _LEN.pack(zlib.crc32(body))


def _fsync_dir(path: str) -> None:
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
    _fsync_dir(os.path.dirname(path) or ".")


class JournalCorrupt(RuntimeError):
    """The journal or state file cannot be read; the message says which and why."""


class RaftJournal(Journal):
    """Raft log, term, vote and membership of one group, durable on :meth:`sync`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._path = os.path.join(directory, "journal")
        self._state_path = os.path.join(directory, "state")
        self._entries: list[Entry] = []
        self._bytes = 0
        self._pending: list[bytes] = []
        self._rewrite = False
        self._term = 0
        self._voted_for: str | None = None
        self._commit = 1
        self._members: list[str] | None = None
        self._state_dirty = False
        self._commit_dirty = False
        self._state_written_at = 0.0
        self._load_state()
        self._load_entries()
        self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND)
        self.syncs = 0

    # -- loading -------------------------------------------------------------

    def _load_state(self) -> None:
        try:
            with open(self._state_path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            return
        if len(raw) < len(STATE_MAGIC) + _STATE_HEAD.size + 4 or not raw.startswith(STATE_MAGIC):
            raise JournalCorrupt(f"{self._state_path}: not an mqds Raft state file")
        body, crc = raw[:-4], _LEN.unpack(raw[-4:])[0]
        if zlib.crc32(body) != crc:
            raise JournalCorrupt(f"{self._state_path}: checksum mismatch")
        pos = len(STATE_MAGIC)
        self._term, self._commit = _STATE_HEAD.unpack_from(body, pos)
        pos += _STATE_HEAD.size
        voted, pos = self._read_str(body, pos)
        self._voted_for = voted or None
        (count,) = _U16.unpack_from(body, pos)
        pos += 2
        if count:
            members = []
            for _ in range(count - 1):
                member, pos = self._read_str(body, pos)
                members.append(member)
            self._members = members

    @staticmethod
    def _read_str(body: bytes, pos: int) -> tuple[str, int]:
        (size,) = _U16.unpack_from(body, pos)
        pos += 2
        return body[pos : pos + size].decode("utf-8"), pos + size

    def _load_entries(self) -> None:
        if not os.path.exists(self._path):
            write_atomically(self._path, JOURNAL_MAGIC)
            return
        with open(self._path, "rb") as fh:
            raw = fh.read()
        if not raw.startswith(JOURNAL_MAGIC):
            raise JournalCorrupt(f"{self._path}: not an mqds Raft journal")
        pos = len(JOURNAL_MAGIC)
        entries: list[Entry] = []
        end = len(raw)
        good = pos
        while pos + 8 <= end:
            (size,) = _LEN.unpack_from(raw, pos)
            if pos + 8 + size > end:
                break
            body = raw[pos + 4 : pos + 4 + size]
            if zlib.crc32(body) != _LEN.unpack_from(raw, pos + 4 + size)[0]:
                break
            kind = body[0]
            if kind == KIND_ENTRY:
                _, index, term = _ENTRY_HEAD.unpack_from(body)
                entries.append((bytes(body[_ENTRY_HEAD.size :]), index, term))
            elif kind == KIND_TRUNCATE:
                _, index = _TRUNCATE.unpack_from(body)
                while entries and entries[-1][1] >= index:
                    entries.pop()
            else:
                break
            pos += 8 + size
            good = pos
        if good != end:
            # A record cut short by a crash, or garbage after it: everything
            # acknowledged before it was synced whole, so cut it off.
            log.warning("%s: cutting %d bytes of a torn record at the end", self._path, end - good)
            with open(self._path, "r+b") as fh:
                fh.truncate(good)
                fh.flush()
                os.fsync(fh.fileno())
        self._entries = entries
        self._bytes = sum(len(e[0]) for e in entries)

    # -- pysyncobj's Journal interface -----------------------------------------

    def add(self, command: bytes, idx: int, term: int) -> None:
        self._entries.append((command, idx, term))
        self._bytes += len(command)
        if not self._rewrite:
            self._pending.append(_record(_ENTRY_HEAD.pack(KIND_ENTRY, idx, term) + command))

    def clear(self) -> None:
        self._entries = []
        self._bytes = 0
        self._pending = []
        self._rewrite = True

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        if entryFrom >= len(self._entries):
            return
        index = self._entries[entryFrom][1]
        self._bytes -= sum(len(e[0]) for e in self._entries[entryFrom:])
        del self._entries[entryFrom:]
        if not self._rewrite:
            self._pending.append(_record(_TRUNCATE.pack(KIND_TRUNCATE, index)))

    def deleteEntriesTo(self, entryTo: int) -> None:
        # Called after a snapshot covering these entries was written; the
        # rewrite in sync() makes the snapshot's rename durable first.
        self._bytes -= sum(len(e[0]) for e in self._entries[:entryTo])
        del self._entries[:entryTo]
        self._pending = []
        self._rewrite = True

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        if self._fd >= 0:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = -1

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:
        if raftCommitIndex != self._commit:
            self._commit = raftCommitIndex
            self._commit_dirty = True

    def getRaftCommitIndex(self) -> int:
        return self._commit

    def setCurrentTerm(self, term: int, votedForNodeId: str | None) -> None:
        self._term = term
        self._voted_for = votedForNodeId
        self._state_dirty = True

    def getCurrentTerm(self) -> int:
        return self._term

    def getVotedForNodeId(self) -> str | None:
        return self._voted_for

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

    @property
    def dirty(self) -> bool:
        return bool(self._pending or self._rewrite or self._state_dirty)

    def sync(self) -> None:
        """Make every change so far durable. Call before any message leaves the node."""
        if self._rewrite:
            self._rewrite_file()
        elif self._pending:
            data = b"".join(self._pending)
            self._pending = []
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            os.fdatasync(self._fd)
            self.syncs += 1
        if self._state_dirty or (
            self._commit_dirty and time.monotonic() - self._state_written_at > _COMMIT_PERSIST_INTERVAL_S
        ):
            self._write_state()

    def _rewrite_file(self) -> None:
        # The snapshot (dump file) that made a head compaction possible was
        # renamed into place just before: make that rename durable before the
        # entries it replaces disappear.
        _fsync_dir(self.directory)
        parts = [JOURNAL_MAGIC]
        parts.extend(_record(_ENTRY_HEAD.pack(KIND_ENTRY, idx, term) + cmd) for cmd, idx, term in self._entries)
        os.close(self._fd)
        self._fd = -1
        write_atomically(self._path, b"".join(parts))
        self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND)
        self._rewrite = False
        self._pending = []
        self.syncs += 1

    def _write_state(self) -> None:
        voted = (self._voted_for or "").encode("utf-8")
        parts = [STATE_MAGIC, _STATE_HEAD.pack(self._term, self._commit), _U16.pack(len(voted)), voted]
        if self._members is None:
            parts.append(_U16.pack(0))
        else:
            parts.append(_U16.pack(len(self._members) + 1))
            for member in self._members:
                raw = member.encode("utf-8")
                parts += [_U16.pack(len(raw)), raw]
        body = b"".join(parts)
        write_atomically(self._state_path, body + _LEN.pack(zlib.crc32(body)))
        self._state_dirty = False
        self._commit_dirty = False
        self._state_written_at = time.monotonic()
