"""A shard restored from a backup: records written as exported (``export.py``), then the views reloaded.

A part of :class:`mqds.server.storage.shard.ShardStorage` (it inherits
:class:`ShardRestore`). A restore is three kinds of logged command, applied
alike by every replica (``cluster/vnode.py``):

- ``begin`` refuses a shard that holds messages or broker state, and clears
  the rest (an empty first generation, the trie of a shard that stored and
  lost nothing): the backup's keys replace them. It marks the shard as
  being restored (``m:restoring``): until ``finish``, the vnode refuses
  every other command (SHARD_RESTORING), so nothing written meanwhile
  mixes with the backup's keys;
- ``records`` writes one column family's keys and values as they are,
  creating a generation's column family when it is not there yet;
- ``finish`` sets the last timestamp to the backup's fence and reads the
  shard's views (generations, topic trie, counters) again from the
  database, as opening it does.

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
    (keys.GENERATION_PREFIX, 6, 25),
    (keys.CHANGES_PREFIX, 6, 8),
    (keys.PRESENCE_PREFIX, 10, 0),
    (keys.TRIE_PREFIX, 0, 4),
    (keys.DEDUP_PREFIX, 0, 20),
)
_INDEX_KEY_LEN = keys.INDEX_PREFIX_LEN + 8


def _refuse(what: str) -> errors.MqdsError:
    return errors.error(Reason.INVALID_REQUEST, what)


def check_records(shard: int, column_family: str, keys_: Sequence[bytes], values: Sequence[bytes]) -> None:
    """Refuse records a restore must not write, or that the shard could not read (INVALID_REQUEST, saying which).

    Checked on the leader before the records are logged, so every replica
    applies what is logged without failing: the Raft state, another shard's
    identity, and keys or values of the wrong shape for what the shard
    reads at opening or when reading (generation records, trie edges,
    messages, posting lists) are refused.
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
    """A restore began (``begin``) and has not finished: the vnode refuses every other command meanwhile."""
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

    def restore_begin(self, *, applied_index: int | None = None) -> MqdsError | None:
        """Clear an empty shard for a restore; the refusal (SHARD_NOT_EMPTY) when it is not empty."""
        with self._lock:
            what = self.holds()
            if what is not None:
                if applied_index is not None:
                    self._write(WriteBatch(raw_mode=True), False, applied_index)
                return errors.error(
                    Reason.SHARD_NOT_EMPTY,
                    f"shard {self.shard} holds {what}: a backup is restored into a new, empty cluster only",
                )
            batch = WriteBatch(raw_mode=True)
            for key in _all_keys(self._db):
                if key not in _KEPT:
                    batch.delete(key, self._meta_handle)
            batch.put(keys.META_RESTORING, b"", self._meta_handle)
            names = self._generation_families()
            self._generations.by_number.clear()
            self._write(batch, True, applied_index)
            for name in names:
                self._db.drop_column_family(name)
            self.reload()
            return None

    def _generation_families(self) -> list[str]:
        return sorted(name for name in Rdict.list_cf(self.path) if keys.parse_generation_cf(name) is not None)

    def restore_records(
        self,
        column_family: str,
        keys_: Sequence[bytes],
        values: Sequence[bytes],
        *,
        applied_index: int | None = None,
    ) -> int:
        """Write records of one column family as they are (creating a generation's family); how many."""
        with self._lock:
            handle = self._meta_handle if column_family == DEFAULT_CF else self._family_handle(column_family)
            batch = WriteBatch(raw_mode=True)
            for key, value in zip(keys_, values, strict=True):
                batch.put(key, value, handle)
            self._write(batch, False, applied_index)
            return len(keys_)

    def _family_handle(self, name: str) -> object:
        db: Rdict = self._db
        try:
            return db.get_column_family_handle(name)
        except Exception:  # not there yet: created, the same on every replica
            created = db.create_column_family(name, self._engine.cf_options())
            del created
            return db.get_column_family_handle(name)

    def restore_finish(self, last_ts: int, *, applied_index: int | None = None) -> list[GenerationInfo]:
        """Set the last timestamp to the backup's fence and read the views again; the generations restored."""
        with self._lock:
            batch = WriteBatch(raw_mode=True)
            batch.put(keys.META_LAST_TS, keys.u64(last_ts), self._meta_handle)
            batch.delete(keys.META_RESTORING, self._meta_handle)
            self._write(batch, True, applied_index)
            self.reload()
            return self.generations()
