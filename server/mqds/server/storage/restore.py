"""A shard restored from a backup: records written as exported (``export.py``), then the views reloaded.

A part of :class:`mqds.server.storage.shard.ShardStorage` (it inherits
:class:`ShardRestore`). A restore is a state of the shard's replicated state
machine: four kinds of logged command, applied alike by every replica
(``cluster/vnode.py``), move it in and out of restore mode, whose mark
(``m:restoring``) is a key of the shard's database, so it survives restarts
and leader changes and travels in snapshots:

- ``begin`` refuses a shard that holds messages or broker state, and clears
  the rest (an empty first generation, the trie of a shard that stored and
  lost nothing): the backup's keys replace them. It puts the shard in
  restore mode: until ``finish`` or ``abandon``, the vnode refuses every
  other command (SHARD_RESTORING), so nothing written meanwhile mixes with
  the backup's keys. A ``begin`` again while nothing was written yet (a
  retried call) is taken;
- ``records`` writes one column family's keys and values as they are,
  creating a generation's column family when it is not there yet, and keeps
  in the mark the largest timestamp the records hold (their messages', and
  where their generations start);
- ``finish`` sets the last timestamp to the backup's fence, refused below
  that largest timestamp (new messages would be stored before old ones),
  ends restore mode and reads the shard's views (generations, topic trie,
  counters) again from the database, as opening it does;
- ``abandon`` clears what the restore wrote and ends restore mode: the shard
  is empty and writable again, as before ``begin``.

``records``, ``finish`` and ``abandon`` outside restore mode are refused
(NOT_RESTORING) and change nothing: a forged or late step never writes into
a shard that holds acknowledged data.

The Raft state (``m:applied``, ``m:applied_part``) is the restored
replica's own and never written from a backup.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import Any

from rocksdict import Rdict, WriteBatch

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.storage import keys
from mqds.server.storage.engine import Engine
from mqds.server.storage.generations import GenerationInfo, Generations
from mqds.v1 import storage_pb2 as pb

DEFAULT_CF = "default"

_KEPT = frozenset({keys.META_FORMAT, keys.META_SHARD, keys.META_LTS, keys.META_APPLIED, keys.META_APPLIED_PART})
"""What ``begin`` keeps of the metadata family: its identity, trie thresholds and Raft state.

The backup's records replace the first two; the Raft state is the replica's own."""
_PROTECTED = frozenset({keys.META_APPLIED, keys.META_APPLIED_PART, keys.META_RESTORING})
"""Keys a restore never writes."""
BROKER_STATE = (
    (keys.CLIENT_PREFIX, "client state"),
    (keys.NODE_CLIENT_PREFIX, "online clients"),
    (keys.SUBSCRIPTION_PREFIX, "subscriptions"),
    (keys.POSITION_PREFIX, "read positions"),
    (keys.RETAINED_PREFIX, "retained messages"),
    (keys.QUEUE_ACK_PREFIX, "queue acknowledgements"),
    (keys.QUEUE_FLOOR_PREFIX, "queue floors"),
    (keys.SHARE_MEMBER_PREFIX, "share groups"),
    (keys.DEDUP_PREFIX, "records of stored batches"),
)


_VALUE_SIZES = {
    keys.META_FORMAT: 2,
    keys.META_SHARD: 4,
    keys.META_LAST_TS: 8,
    keys.META_LTS: 8,
    keys.META_NEXT_NODE: 4,
    keys.META_DEDUP_PRUNED: 8,
}
"""Metadata keys whose value the shard reads with a fixed size (opening it would fail on another)."""
_PREFIXED = (
    # prefix, key length (0: any), value length (0: any)
    (keys.GENERATION_PREFIX, 6, 0),  # 25 or 33 bytes (version 1 or 2): checked below
    (keys.CHANGES_PREFIX, 6, 8),
    (keys.PRESENCE_PREFIX, 10, 0),
    (keys.TRIE_PREFIX, 0, 4),
    (keys.DEDUP_PREFIX, 0, 20),
)
_INDEX_KEY_LEN = keys.INDEX_PREFIX_LEN + 8


def _refuse(what: str) -> errors.MqdsError:
    return errors.error(Reason.INVALID_REQUEST, what)


def check_records(
    shard: int, column_family: str, keys_: Sequence[bytes], values: Sequence[bytes], latest_us: int | None = None
) -> None:
    """Refuse records a restore must not write, or that the shard could not read (INVALID_REQUEST, saying which).

    Checked on the leader before the records are logged, so every replica
    applies what is logged without failing: the Raft state, another shard's
    identity, and keys or values of the wrong shape for what the shard
    reads at opening or when reading (generation records, trie edges,
    messages, posting lists) are refused. With ``latest_us``, so are records
    of a later timestamp (``records_ts``): a backup holds what a cluster
    stored up to its fence, never messages from the future.
    """
    if len(keys_) != len(values):
        raise _refuse(f"{len(keys_)} keys but {len(values)} values")
    if column_family != DEFAULT_CF and keys.parse_generation_cf(column_family) is None:
        raise _refuse(f"column family {column_family!r} is neither 'default' nor a generation's (gen-NNNNNNNN)")
    check = _check_default if column_family == DEFAULT_CF else _check_generation
    for key, value in zip(keys_, values, strict=True):
        if not key:
            raise _refuse("a record has an empty key")
        check(shard, key, value)
    if latest_us is not None:
        ts = records_ts(column_family, keys_, values)
        if ts > latest_us:
            raise _refuse(
                f"the records hold timestamp {ts}, after {latest_us}, the latest this node takes (a few minutes "
                "after its clock): a backup holds what its cluster stored up to its fence; check the clocks of "
                "both clusters"
            )


def records_ts(column_family: str, keys_: Sequence[bytes], values: Sequence[bytes]) -> int:
    """The largest timestamp of checked records (``check_records``): their messages', where their generations start.

    What ``finish``'s last timestamp may not be below: timestamps only grow,
    so the shard's next message must come after every restored one.
    """
    latest = 0
    if column_family == DEFAULT_CF:
        for key, value in zip(keys_, values, strict=True):
            if key.startswith(keys.GENERATION_PREFIX):
                # A rotation sets the last timestamp to since - 1.
                latest = max(latest, keys.GenerationRecord.decode(value).since_us - 1)
        return latest
    for key in keys_:
        # D: u32 stream, u64 timestamp; I: ..., u64 timestamp of the batch's first such message.
        latest = max(latest, keys.data_key_ts(key) if key[:1] == keys.DATA_TAG else keys.read_u64(key[-8:]))
    return latest


def _check_default(shard: int, key: bytes, value: bytes) -> None:
    if key in _PROTECTED:
        raise _refuse(f"{key!r} is the replica's Raft state: never restored")
    size = _VALUE_SIZES.get(key)
    if size is not None and len(value) != size:
        raise _refuse(f"{key!r} holds {len(value)} bytes, not {size}")
    if key == keys.META_SHARD and keys.read_u32(value) != shard:
        raise _refuse(f"the records are of shard {keys.read_u32(value)}, not shard {shard}")
    if key == keys.META_FORMAT and keys.read_u16(value) not in keys.READABLE_FORMATS:
        raise _refuse(f"the records' storage format {keys.read_u16(value)} is not one this node reads")
    for prefix, key_len, value_len in _PREFIXED:
        if key.startswith(prefix):
            if (key_len and len(key) != key_len) or (value_len and len(value) != value_len):
                raise _refuse(f"{key[:24]!r} = {len(value)} bytes is not a record of its kind ({prefix!r})")
            if prefix == keys.GENERATION_PREFIX:
                if len(value) not in keys.GenerationRecord.SIZES:
                    raise _refuse(f"{key[:24]!r} = {len(value)} bytes is not a record of its kind ({prefix!r})")
                try:
                    keys.GenerationRecord.decode(value)
                except ValueError as err:
                    raise _refuse(f"generation record {key!r}: {err}") from None
            if prefix == keys.TRIE_PREFIX and len(key) < 6:
                raise _refuse(f"{key!r} is not a trie edge")
            return


def _check_generation(shard: int, key: bytes, value: bytes) -> None:
    tag = key[:1]
    if tag == keys.DATA_TAG and len(key) == keys.DATA_KEY_LEN:
        try:
            pb.Message.FromString(value)
        except Exception:  # DecodeError, or a RuntimeError from upb
            raise _refuse(f"the value of data key {key.hex()} is not a stored message") from None
        return
    if tag == keys.INDEX_TAG and len(key) == _INDEX_KEY_LEN:
        try:
            keys.decode_postings(keys.read_u64(key[-8:]), value)
        except (ValueError, struct.error) as err:
            raise _refuse(f"the value of index key {key.hex()} is not a posting list: {err}") from None
        return
    raise _refuse(f"{key[:24]!r} is not a key of a generation")


def _all_keys(cf: Rdict) -> list[bytes]:
    return [key for key, _ in cf.items()]


def _first_key(cf: Rdict) -> bytes | None:
    for key, _ in cf.items():
        return bytes(key)
    return None


class ShardRestore:
    """Restore steps of one shard (``ShardStorage`` provides the attributes below)."""

    shard: int
    path: str
    last_ts: int
    restoring: bool
    """A restore began (``begin``) and has not finished or been abandoned: the vnode refuses every other command."""
    restored_ts: int
    """While ``restoring``: the largest timestamp of the records written (``records_ts``), kept in the mark."""
    _lock: threading.RLock
    _engine: Engine
    _db: Any
    _meta_handle: Any
    _generations: Generations

    def _write(self, batch: WriteBatch, sync: bool, applied_index: int | None) -> None:
        raise NotImplementedError

    def reload(self) -> None:
        raise NotImplementedError

    def generations(self) -> list[GenerationInfo]:
        raise NotImplementedError

    def holds(self) -> str | None:
        """What the shard holds that a restore would overwrite (messages, broker state), or None."""
        with self._lock:
            # Every generation family on disk, also those a restore that stopped half-way created before
            # their records were read (the views know only the generations with records).
            for name in self._generation_families():
                cf = self._db.get_column_family(name)
                try:
                    if _first_key(cf) is not None:
                        return f"messages in generation {keys.parse_generation_cf(name)}"
                finally:
                    del cf
            for prefix, what in BROKER_STATE:
                for key in self._db.keys(from_key=prefix):
                    if key.startswith(prefix):
                        return what
                    break
            return None

    def _refused(self, refusal: MqdsError, applied_index: int | None) -> MqdsError:
        """A step refused alike by every replica: it changes nothing but the applied index."""
        if applied_index is not None:
            self._write(WriteBatch(raw_mode=True), False, applied_index)
        return refusal

    def _not_restoring(self, step: str, applied_index: int | None) -> MqdsError:
        return self._refused(
            errors.error(
                Reason.NOT_RESTORING,
                f"shard {self.shard} is not being restored: ImportShard {step} comes after a begin put the "
                "shard in restore mode (mqds restore begins, writes, then finishes or abandons every shard); "
                "a restore that finished or was abandoned takes no more steps",
            ),
            applied_index,
        )

    def restore_begin(self, *, applied_index: int | None = None) -> MqdsError | None:
        """Clear an empty shard and put it in restore mode; the refusal (SHARD_NOT_EMPTY) when it is not empty."""
        with self._lock:
            what = self.holds()
            if what is not None:
                under_way = (
                    " written by a restore under way: finish it, or abandon it (mqds restore --abandon) and begin again"
                    if self.restoring
                    else ": a backup is restored into a new, empty cluster only"
                )
                return self._refused(
                    errors.error(Reason.SHARD_NOT_EMPTY, f"shard {self.shard} holds {what}{under_way}"),
                    applied_index,
                )
            self._clear(restoring=True, applied_index=applied_index)
            return None

    def _clear(self, *, restoring: bool, applied_index: int | None) -> None:
        """Delete every key but ``_KEPT`` and every generation; the shard in restore mode or out of it."""
        batch = WriteBatch(raw_mode=True)
        for key in _all_keys(self._db):
            if key not in _KEPT:
                batch.delete(key, self._meta_handle)
        if restoring:
            batch.put(keys.META_RESTORING, b"", self._meta_handle)
        names = self._generation_families()
        self._generations.by_number.clear()
        self._write(batch, True, applied_index)
        for name in names:
            self._db.drop_column_family(name)
        self.reload()

    def _generation_families(self) -> list[str]:
        return sorted(name for name in Rdict.list_cf(self.path) if keys.parse_generation_cf(name) is not None)

    def restore_records(
        self,
        column_family: str,
        keys_: Sequence[bytes],
        values: Sequence[bytes],
        *,
        applied_index: int | None = None,
    ) -> int | MqdsError:
        """Write records of one column family as they are (creating a generation's family); how many.

        Outside restore mode the records are refused (NOT_RESTORING) and nothing is written.
        """
        with self._lock:
            if not self.restoring:
                return self._not_restoring("records", applied_index)
            handle = self._meta_handle if column_family == DEFAULT_CF else self._family_handle(column_family)
            batch = WriteBatch(raw_mode=True)
            for key, value in zip(keys_, values, strict=True):
                batch.put(key, value, handle)
            latest = max(self.restored_ts, records_ts(column_family, keys_, values))
            if latest > self.restored_ts:
                batch.put(keys.META_RESTORING, keys.u64(latest), self._meta_handle)
            self._write(batch, False, applied_index)
            self.restored_ts = latest
            return len(keys_)

    def _family_handle(self, name: str) -> object:
        db: Rdict = self._db
        try:
            return db.get_column_family_handle(name)
        except Exception:  # not there yet: created, the same on every replica
            created = db.create_column_family(name, self._engine.cf_options())
            del created
            return db.get_column_family_handle(name)

    def restore_finish(self, last_ts: int, *, applied_index: int | None = None) -> list[GenerationInfo] | MqdsError:
        """Set the last timestamp to the backup's fence, end restore mode and read the views again; the
        generations restored. Refused (nothing changes) outside restore mode, and below the records' timestamps."""
        with self._lock:
            if not self.restoring:
                return self._not_restoring("finish", applied_index)
            if last_ts < self.restored_ts:
                return self._refused(
                    errors.error(
                        Reason.INVALID_REQUEST,
                        f"shard {self.shard}: last_ts {last_ts} is before timestamp {self.restored_ts} of the "
                        "records written: finish with the backup's fence (its manifest's fence_us), or abandon "
                        "the restore",
                    ),
                    applied_index,
                )
            batch = WriteBatch(raw_mode=True)
            batch.put(keys.META_LAST_TS, keys.u64(last_ts), self._meta_handle)
            batch.delete(keys.META_RESTORING, self._meta_handle)
            self._write(batch, True, applied_index)
            self.reload()
            return self.generations()

    def restore_abandon(self, *, applied_index: int | None = None) -> MqdsError | None:
        """Clear what the restore wrote and end restore mode: the shard is empty and writable again.

        Refused (NOT_RESTORING, nothing changes) outside restore mode: a shard that holds data is never cleared.
        """
        with self._lock:
            if not self.restoring:
                return self._not_restoring("abandon", applied_index)
            self._clear(restoring=False, applied_index=applied_index)
            return None
