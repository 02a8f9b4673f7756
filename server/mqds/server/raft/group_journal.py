"""The Raft journal of one group: pysyncobj's journal interface over the node's shared log.

pysyncobj's own file journal writes entries into an mmap it does not flush
before acknowledging them, and stores term and vote with a rename but no
fsync. Here every group gets a :class:`RaftJournal` with pysyncobj's
interface (``pysyncobj.journal.Journal``) and a different contract: changes
are kept in memory and recorded, and :meth:`RaftJournal.sync` returns once
all of them are on disk (written by the node's log,
:class:`mqds.server.raft.journal.NodeLog`, with every other group's). A
group calls it before it lets any message leave the node, so a follower's
acknowledgement and a vote are only ever sent for what is on disk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from pysyncobj.journal import Journal

from mqds.server.durable import fsync_dir
from mqds.server.raft.recovery import Recovered
from mqds.server.raft.segments import (
    CLEAR,
    HEAD,
    STATE,
    TRUNCATE,
    Entry,
    entry_record,
    index_record,
    record,
    state_body,
    state_records,
)

# The live floor of a group without live entries: everything it wrote is dead.
NO_FLOOR = 2**64
# How often a changed commit index alone is recorded.
_COMMIT_RECORD_INTERVAL_S = 1.0


class SharedLog(Protocol):
    """What a group's journal asks of the node's log (:class:`mqds.server.raft.journal.NodeLog`, which makes one)."""

    def queue(self, records: list[bytes], group: int, last_entry: int, floor: int, cleared: bool) -> int:
        """Queue a group's records for the log's next write; the round that makes them durable."""
        ...

    def wait_durable(self, round_: int) -> None:
        """Return once the round ``round_`` (any group's) is on disk."""
        ...


class RaftJournal(Journal):
    """Raft log, term, vote and membership of one group, durable on :meth:`sync`."""

    def __init__(self, node_log: SharedLog, group: int, recovered: Recovered) -> None:
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
            self._pending.append(entry_record(self.group, idx, term, command))
            if idx > self._pending_last_entry:
                self._pending_last_entry = idx

    def clear(self) -> None:
        with self._lock:
            self._entries = []
            self._bytes = 0
            self._pending.append(record(self.group, CLEAR))
            self._pending_cleared = True

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        with self._lock:
            if entryFrom >= len(self._entries):
                return
            index = self._entries[entryFrom][1]
            self._bytes -= sum(len(e[0]) for e in self._entries[entryFrom:])
            del self._entries[entryFrom:]
            self._pending.append(index_record(self.group, TRUNCATE, index))

    def deleteEntriesTo(self, entryTo: int) -> None:
        with self._lock:
            if entryTo <= 0:
                return
            self._bytes -= sum(len(e[0]) for e in self._entries[:entryTo])
            del self._entries[:entryTo]
            head = self._entries[0][1] if self._entries else 0
            self._pending.append(index_record(self.group, HEAD, head))

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
        round_ = self.stage()
        if round_ is not None:
            self._log.wait_durable(round_)

    def wait_durable(self, round_: int) -> None:
        """Return once the node log's round ``round_`` (from ``stage``, any group's) is on disk."""
        self._log.wait_durable(round_)

    def stage(self) -> int | None:
        """Queue every change so far for the node log's next write; the round that makes it durable, or None.

        ``sync`` is this followed by ``NodeLog.wait_durable``; several groups
        staged before one wait share a single write and flush.
        """
        with self._lock:
            if self._state_dirty or (
                self._commit_dirty and time.monotonic() - self._state_recorded_at > _COMMIT_RECORD_INTERVAL_S
            ):
                body = state_body(self.term, self.commit, self.voted_for, self._members)
                self._pending.append(record(self.group, STATE, body))
                self._state_dirty = self._commit_dirty = False
                self._state_recorded_at = time.monotonic()
            records, self._pending = self._pending, []
            last_entry, self._pending_last_entry = self._pending_last_entry, 0
            cleared, self._pending_cleared = self._pending_cleared, False
            floor = self._entries[0][1] if self._entries else NO_FLOOR
        if not records:
            return None
        if self._dir_to_sync is not None:
            fsync_dir(self._dir_to_sync)
            self._dir_to_sync = None
        round_ = self._log.queue(records, self.group, last_entry, floor, cleared)
        self.syncs += 1
        return round_

    def state_records(self, copy_bytes: int) -> tuple[list[bytes], int | None]:
        """What a new log segment starts with for this journal, and the last entry copied into it.

        Its entries are copied when they hold at most ``copy_bytes``
        (the last index copied is returned, 0 for none); otherwise only where
        they begin (and None).
        """
        with self._lock:
            copy = self._bytes <= copy_bytes
            last = (self._entries[-1][1] if self._entries else 0) if copy else None
            return state_records(self.group, self._entries, self, copy), last
