"""Snapshot manifests: what pysyncobj's "dump file" holds for us, and how a group writes and reads one.

pysyncobj compacts its log by serialising the state into a file and
dropping the entries it covers; a follower whose next entry was compacted
away receives that file and loads it. Ours is a small manifest (the last
two entries, the members, and the state machine's payload): the machine's
state itself stays in its own storage (for a vnode, RocksDB), and a
follower's ``machine.install()`` fetches it from the manifest's source.

Layout (little-endian): ``MQDSSNP1 | u32 group | u16 len, source |
(u64 index, u64 term, u32 len, command) x 2 | u16 count, (u16 len, member)
x count | u32 len, payload | u32 crc32`` (the CRC covers everything before it).
"""

from __future__ import annotations

import logging
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mqds.server.durable import sync_file
from mqds.server.raft import codec
from mqds.server.raft.journal import write_atomically
from mqds.server.raft.machine import StateMachine
from mqds.server.raft.names import PeerNode

log = logging.getLogger(__name__)

_MANIFEST_MAGIC = b"MQDSSNP1"
_MANIFEST_ENTRY = struct.Struct("<QQI")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


def encode_manifest(
    group: int,
    source: str,
    last: tuple[bytes, int, int],
    prev: tuple[bytes, int, int],
    members: list[str],
    payload: bytes,
) -> bytes:
    parts = [_MANIFEST_MAGIC, _U32.pack(group)]
    raw = source.encode("utf-8")
    parts += [_U16.pack(len(raw)), raw]
    for cmd, idx, term in (last, prev):
        parts += [_MANIFEST_ENTRY.pack(idx, term, len(cmd)), cmd]
    parts.append(_U16.pack(len(members)))
    for member in members:
        raw = member.encode("utf-8")
        parts += [_U16.pack(len(raw)), raw]
    parts += [_U32.pack(len(payload)), payload]
    # The last entry may be a whole batch of tens of MiB: one copy, not two.
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    parts.append(_U32.pack(crc))
    return b"".join(parts)


@dataclass(frozen=True)
class Manifest:
    group: int
    source: str
    last: tuple[bytes, int, int]
    prev: tuple[bytes, int, int]
    members: list[str]
    payload: bytes


def decode_manifest(raw: bytes) -> Manifest:
    if len(raw) < len(_MANIFEST_MAGIC) + 8 or not raw.startswith(_MANIFEST_MAGIC):
        raise ValueError("not an mqds snapshot manifest")
    body, crc = raw[:-4], _U32.unpack(raw[-4:])[0]
    if zlib.crc32(body) != crc:
        raise ValueError("snapshot manifest checksum mismatch")
    pos = len(_MANIFEST_MAGIC)
    (group,) = _U32.unpack_from(body, pos)
    pos += 4

    def text() -> str:
        nonlocal pos
        (size,) = _U16.unpack_from(body, pos)
        pos += 2
        value = body[pos : pos + size].decode("utf-8")
        pos += size
        return value

    source = text()
    entries = []
    for _ in range(2):
        idx, term, size = _MANIFEST_ENTRY.unpack_from(body, pos)
        pos += _MANIFEST_ENTRY.size
        entries.append((bytes(body[pos : pos + size]), idx, term))
        pos += size
    (count,) = _U16.unpack_from(body, pos)
    pos += 2
    members = [text() for _ in range(count)]
    (size,) = _U32.unpack_from(body, pos)
    pos += 4
    payload = bytes(body[pos : pos + size])
    for cmd, _, _ in entries:
        codec.check_command(cmd)
    return Manifest(group, source, entries[0], entries[1], members, payload)


class ManifestFiles:
    """A group's snapshot manifests: pysyncobj's serializer (``write``) and deserializer (``read``), and the
    snapshots installed here.

    ``sync_directory_first`` is the group journal's: a manifest's rename must
    be on disk before the log entries it covers are dropped.
    """

    def __init__(
        self,
        group: int,
        name: str,
        node_id: str,
        directory: str,
        machine: StateMachine,
        sync_directory_first: Callable[[str], None],
    ) -> None:
        self._group = group
        self._name = name
        self._node_id = node_id
        self._directory = directory
        self._machine = machine
        self._sync_directory_first = sync_directory_first
        # Counted for the metrics, each written by the group's thread only
        # (so plain ints, exact and free); read by scrapes from any thread.
        self.snapshots_installed = 0
        self.snapshot_install_seconds = 0.0
        self.installing = False
        """True while a snapshot is being fetched and installed: the replica cannot serve (readiness)."""

    def write(self, tmp_file: str, data: tuple[Any, Any, Any]) -> None:
        """pysyncobj's serializer: the manifest of a compaction (``data``: the last two entries, the members)."""
        last, prev, cluster = data
        payload = self._machine.snapshot()
        members = sorted(str(n.id) for n in cluster)
        raw = encode_manifest(self._group, self._node_id, tuple(last), tuple(prev), members, payload)
        write_atomically(tmp_file, raw)
        # pysyncobj renames it into place and then drops the entries it
        # covers: the rename must be on disk before that drop is.
        self._sync_directory_first(self._directory)
        log.debug("%s: snapshot at index %d", self._name, last[1])

    def read(self, file_name: str) -> tuple[Any, Any, list[PeerNode]]:
        """pysyncobj's deserializer: load a manifest (this replica's, or one its leader sent), installing the
        machine's state it describes if it is ahead of the machine."""
        # A manifest received from the leader was written and renamed into place
        # by pysyncobj without an fsync, and pysyncobj drops the entries it covers
        # from the log once this returns: it must be on disk before that drop is.
        sync_file(file_name)
        with open(file_name, "rb") as fh:
            manifest = decode_manifest(fh.read())
        index = manifest.last[1]
        applied = self._machine.applied_index
        if 0 < applied < index and manifest.source == self._node_id:
            # This replica wrote the manifest itself, by compacting entries it
            # had applied, after syncing the machine's storage: the storage
            # holds every effect up to ``index``. What lies between is entries
            # that changed nothing (election no-ops, membership changes), which
            # versions before ``skip`` did not record. Asking for a snapshot
            # here wedged idle shards on restart: every replica had the same
            # gap, so none could serve one.
            log.info("%s: applied %d, manifest at %d written here: nothing to install", self._name, applied, index)
            self._machine.skip(index)
        elif applied < index:
            log.info(
                "%s: installing snapshot at index %d from %s (applied here: %d)",
                self._name,
                index,
                manifest.source,
                self._machine.applied_index,
            )
            started = time.monotonic()
            self.installing = True
            try:
                self._machine.install(manifest.payload, index, manifest.source, manifest.members)
            finally:
                self.installing = False
            self.snapshots_installed += 1
            self.snapshot_install_seconds += time.monotonic() - started
        # As nodes, not ids: pysyncobj drops this node from the list by comparing
        # with its own Node, and an id never equals a Node. With ids it kept
        # itself as a peer, a phantom member that raised every majority by one,
        # so after a restart or a snapshot a group could not elect a leader with
        # one replica down (found by the chaos runs).
        return manifest.last, manifest.prev, [PeerNode(m) for m in manifest.members]
