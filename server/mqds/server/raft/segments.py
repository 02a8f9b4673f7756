"""The file format of the node's Raft log: segments, their records, encoding and reading them back.

``<dir>/wal-<8 digits>`` segments hold records
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
is cut off when it is read (:func:`read_segment`); damage anywhere else
raises :class:`JournalCorrupt`. What the records mean for a group when
replayed is :mod:`mqds.server.raft.recovery`'s; who writes them and when,
:mod:`mqds.server.raft.journal`'s and :mod:`mqds.server.raft.group_journal`'s.

>>> body = record(7, STATE, state_body(3, 9, "n2", ["n1", "n2"]))[9:-4]
>>> decode_state(body)
(3, 9, 'n2', ['n1', 'n2'])
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"MQDSWAL1"
ENTRY, TRUNCATE, HEAD, CLEAR, STATE, DROP = 1, 2, 3, 4, 5, 6
KINDS = (ENTRY, TRUNCATE, HEAD, CLEAR, STATE, DROP)

_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<IB")  # group, kind
_ENTRY = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
_STATE = struct.Struct("<QQ")
_U16 = struct.Struct("<H")

_COPY_ONCE_BYTES = 64 * 1024
"""Entry records of commands this large are joined in one copy (``entry_record``)."""

Entry = tuple[bytes, int, int]
"""A Raft log entry as pysyncobj holds it: command, index, term."""


class JournalCorrupt(RuntimeError):
    """The log cannot be read; the message says where and why."""


# -- writing records ------------------------------------------------------------


def record(group: int, kind: int, body: bytes = b"") -> bytes:
    inner = _HEAD.pack(group, kind) + body
    return _LEN.pack(len(inner)) + inner + _LEN.pack(zlib.crc32(inner))


def entry_record(group: int, index: int, term: int, command: bytes) -> bytes:
    """``record(group, ENTRY, index and term + command)``; a large command is copied once, not three times."""
    if len(command) < _COPY_ONCE_BYTES:
        return record(group, ENTRY, _ENTRY.pack(index, term) + command)  # faster for small ones
    head = _HEAD.pack(group, ENTRY) + _ENTRY.pack(index, term)
    crc = zlib.crc32(command, zlib.crc32(head))
    return b"".join((_LEN.pack(len(head) + len(command)), head, command, _LEN.pack(crc)))


def index_record(group: int, kind: int, index: int) -> bytes:
    """A TRUNCATE or HEAD record."""
    return record(group, kind, _U64.pack(index))


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _U16.pack(len(raw)) + raw


def state_body(term: int, commit: int, voted_for: str | None, members: list[str] | None) -> bytes:
    parts = [_STATE.pack(term, commit), _text(voted_for or "")]
    if members is None:
        parts.append(_U16.pack(0))
    else:
        parts.append(_U16.pack(len(members) + 1))
        parts.extend(_text(m) for m in members)
    return b"".join(parts)


def state_records(group: int, entries: Sequence[Entry], state: Any, copy: bool) -> list[bytes]:
    """What a new segment starts with for a group: its state, then its entries or where they begin."""
    records = [record(group, STATE, state_body(state.term, state.commit, state.voted_for, state.members))]
    if copy or not entries:
        records.append(record(group, CLEAR))
        records.extend(entry_record(group, idx, term, cmd) for cmd, idx, term in entries)
    else:
        records.append(index_record(group, HEAD, entries[0][1]))
    return records


# -- reading records ------------------------------------------------------------


def decode_entry(body: bytes) -> Entry:
    """An ENTRY record's body as (command, index, term)."""
    index, term = _ENTRY.unpack_from(body)
    return bytes(body[_ENTRY.size :]), index, term


def entry_index(body: bytes) -> int:
    """The index of an ENTRY record's body."""
    return int(_ENTRY.unpack_from(body)[0])


def decode_index(body: bytes) -> int:
    """The index of a TRUNCATE or HEAD record's body."""
    return int(_U64.unpack_from(body)[0])


def decode_state(body: bytes) -> tuple[int, int, str | None, list[str] | None]:
    """A STATE record's body as (term, commit index, vote, members); None for no vote or no member list."""
    term, commit = _STATE.unpack_from(body)
    pos = _STATE.size
    voted, pos = _read_text(body, pos)
    (count,) = _U16.unpack_from(body, pos)
    pos += 2
    members: list[str] | None = None
    if count:
        members = []
        for _ in range(count - 1):
            member, pos = _read_text(body, pos)
            members.append(member)
    return term, commit, voted or None, members


def _read_text(body: bytes, pos: int) -> tuple[str, int]:
    (size,) = _U16.unpack_from(body, pos)
    pos += 2
    return bytes(body[pos : pos + size]).decode("utf-8"), pos + size


def read_segment(path: str, last: bool) -> Iterator[tuple[int, int, bytes]]:
    """The records of a segment as (group, kind, body), cutting a torn record off the end of the ``last`` one."""
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
        if kind not in KINDS:
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


# -- segment files --------------------------------------------------------------


def list_segments(directory: str) -> list[str]:
    """The paths of the log's segments, oldest first."""
    names = sorted(n for n in os.listdir(directory) if n.startswith("wal-") and n[4:].isdigit())
    return [os.path.join(directory, n) for n in names]


def segment_name(number: int) -> str:
    return f"wal-{number:08d}"


def segment_number(path: str) -> int:
    return int(os.path.basename(path)[4:])
