"""A shard restored from a backup: records written as exported (``export.py``), then the views reloaded.

The steps are methods of :class:`mqds.server.storage.shard.ShardStorage`
(``restore_begin``, ``restore_records``, ``restore_finish``,
``restore_abandon``), which owns the lock, the write path and the views
they reload; the functions here check records and build what the steps
write from the database they are given. A restore is a state of the
shard's replicated state machine: four kinds of logged command, applied alike by every replica
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
from collections.abc import Sequence

from rocksdict import Rdict, WriteBatch

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.storage import keys
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
    (keys.DELIVERY_PREFIX, "deliveries waiting for an ack"),
    (keys.DELIVERED_PREFIX, "delivered cursors"),
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
    (keys.DELIVERED_PREFIX, 0, 8),  # a consumer's delivered cursor (deliveries.py)
    (keys.MESSAGE_EXPIRY_PREFIX, keys.MESSAGE_EXPIRY_KEY_LEN, 0),  # read by expiry steps (expiry.py)
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


def generation_families(path: str) -> list[str]:
    """Every generation family on disk, also those a restore that stopped half-way created before their
    records were read (the shard's views know only the generations with records)."""
    return sorted(name for name in Rdict.list_cf(path) if keys.parse_generation_cf(name) is not None)


def holds(db: Rdict, families: Sequence[str]) -> str | None:
    """What a shard holds that a restore would overwrite (messages in ``families``, broker state), or None."""
    for name in families:
        cf = db.get_column_family(name)
        try:
            if _first_key(cf) is not None:
                return f"messages in generation {keys.parse_generation_cf(name)}"
        finally:
            del cf
    for prefix, what in BROKER_STATE:
        for key in db.keys(from_key=prefix):
            if key.startswith(prefix):
                return what
            break
    return None


def clear_batch(db: Rdict, meta_handle: object, *, restoring: bool) -> WriteBatch:
    """A batch deleting every metadata key but ``_KEPT``, and setting the restore mark (``restoring``) or not."""
    batch = WriteBatch(raw_mode=True)
    for key in _all_keys(db):
        if key not in _KEPT:
            batch.delete(key, meta_handle)
    if restoring:
        batch.put(keys.META_RESTORING, b"", meta_handle)
    return batch


def family_handle(db: Rdict, name: str, cf_options: object) -> object:
    """The handle of column family ``name``, created (the same on every replica) when it is not there yet."""
    try:
        return db.get_column_family_handle(name)
    except Exception:  # not there yet: created, the same on every replica
        created = db.create_column_family(name, cf_options)
        del created
        return db.get_column_family_handle(name)
