"""A shard's content as a backup holds it: read from a checkpoint, cut at a fence.

A backup (``mqds backup``) copies every key of a shard, so that what names
generations, streams and timestamps (iterators, read positions, follow
positions) is valid on the cluster restored from it. The keys are read from
a RocksDB checkpoint of the replica (``ShardStorage.checkpoint``): one
consistent view of all its column families, taken while the replica's reader
guard is held, and read afterwards without holding anything, while the
replica goes on applying.

What is exported is the shard as it stood at the fence (the last timestamp
it had assigned when the backup pinned it):

- every message stored at or before the fence, and its index keys (a
  batch is applied whole, so its index keys are all at or before the fence
  or all after it);
- the generations that had started by the fence, with the interval they had
  then: one closed after the fence is exported open, one started after it
  is left out with its presence keys;
- the metadata family as it is, except the Raft state (``m:applied``,
  ``m:applied_part``: the restored cluster's log is its own), ``m:last_ts``
  (the fence) and the deduplication records of batches stored after the
  fence (a producer resending one must have it stored);
- broker state (client state, subscriptions, retained messages, read
  positions, share groups) as of the checkpoint, taken moments after the
  fence: broker state has no timestamps to cut at.

A closed generation the caller already holds (same number, interval,
creation time and change count, ``keys.changes_key``) is announced but not
read: closed generations take no new messages, and every delete or
retention step that removes some of their keys counts a change.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from rocksdict import AccessType, Options, Rdict

from mqds.server.storage import keys

DEFAULT_CF = "default"
_LEFT_OUT = frozenset({keys.META_APPLIED, keys.META_APPLIED_PART, keys.META_RESTORING})


@dataclass(frozen=True)
class ExportedGeneration:
    """A generation as exported: its interval at the fence and its change count."""

    number: int
    since_us: int
    until_us: int | None
    created_at_us: int
    changes: int

    @property
    def closed(self) -> bool:
        return self.until_us is not None


@dataclass(frozen=True)
class Section:
    """One column family's part of an export: its records, or none when the generation was skipped."""

    column_family: str
    generation: ExportedGeneration | None
    skipped: bool
    records: Iterator[tuple[bytes, bytes]]


class CheckpointExport:
    """The export of one shard from a checkpoint directory (read-only; the caller removes the directory)."""

    def __init__(self, path: str, fence_us: int | None, skip: dict[int, ExportedGeneration]) -> None:
        self.path = path
        names = Rdict.list_cf(path)
        opts = Options(raw_mode=True)
        self._db = Rdict(
            path,
            opts,
            column_families={name: Options(raw_mode=True) for name in names if name != DEFAULT_CF} or None,
            access_type=AccessType.read_only(),
        )
        raw = self._db.get(keys.META_LAST_TS)
        self.last_ts = keys.read_u64(raw) if raw is not None else 0
        """The checkpoint's last assigned timestamp."""
        raw = self._db.get(keys.META_APPLIED)
        self.applied_index = keys.read_u64(raw) if raw is not None else 0
        self.fence_us = self.last_ts if fence_us is None else fence_us
        self._skip = skip
        self.generations = self._generations_at_fence()
        """The generations that had started by the fence, oldest first."""
        self._left_out = {
            keys.read_u32(key[len(keys.GENERATION_PREFIX) :]) for key, _ in _prefixed(self._db, keys.GENERATION_PREFIX)
        } - {g.number for g in self.generations}

    def close(self) -> None:
        self._db.close()

    def _generations_at_fence(self) -> list[ExportedGeneration]:
        fence = self.fence_us
        out = []
        for key, value in _prefixed(self._db, keys.GENERATION_PREFIX):
            number = keys.read_u32(key[len(keys.GENERATION_PREFIX) :])
            record = keys.GenerationRecord.decode(value)
            # A rotation sets the last timestamp to since - 1: a generation
            # with since <= fence + 1 had started when the fence was pinned.
            if record.since_us > fence + 1:
                continue
            until = record.until_us if record.until_us is not None and record.until_us <= fence + 1 else None
            raw = self._db.get(keys.changes_key(number))
            changes = keys.read_u64(raw) if raw is not None else 0
            out.append(ExportedGeneration(number, record.since_us, until, record.created_at_us, changes))
        return out

    def sections(self) -> Iterator[Section]:
        """The metadata family, then each generation's, in order."""
        yield Section(DEFAULT_CF, None, False, self._metadata())
        for gen in self.generations:
            skipped = gen.closed and self._skip.get(gen.number) == gen
            name = keys.generation_cf(gen.number)
            yield Section(name, gen, skipped, iter(()) if skipped else self._generation_records(name))

    def _metadata(self) -> Iterator[tuple[bytes, bytes]]:
        fence = self.fence_us
        by_number = {g.number: g for g in self.generations}
        left_out = self._left_out
        late_dedup: set[bytes] = set()
        last_ts_seen = False
        for key, value in self._db.items():
            if key in _LEFT_OUT:
                continue
            if key == keys.META_LAST_TS:
                value = keys.u64(fence)
                last_ts_seen = True
            elif key.startswith(keys.GENERATION_PREFIX):
                number = keys.read_u32(key[len(keys.GENERATION_PREFIX) :])
                if number in left_out:
                    continue
                # As it stood at the fence: open if it closed after it; the
                # rest (its version, what was stored before it) as it is.
                value = replace(keys.GenerationRecord.decode(value), until_us=by_number[number].until_us).encode()
            elif key.startswith(keys.CHANGES_PREFIX) or key.startswith(keys.PRESENCE_PREFIX):
                if keys.read_u32(key[2:6]) in left_out:
                    continue
            elif key.startswith(keys.DEDUP_PREFIX):
                if keys.DedupRecord.decode(value).first_ts > fence:
                    late_dedup.add(key[len(keys.DEDUP_PREFIX) :])
                    continue
            elif key.startswith(keys.DEDUP_EXPIRY_PREFIX):
                if key[len(keys.DEDUP_EXPIRY_PREFIX) + 8 :] in late_dedup:
                    continue
            elif key.startswith(keys.QUEUE_ACK_PREFIX) and keys.read_u64(key[len(keys.QUEUE_ACK_PREFIX) :]) > fence:
                continue
            elif key.startswith(keys.DELIVERY_PREFIX) and keys.read_u64(key[-8:]) > fence:
                continue  # a delivery of a message stored after the fence (deliveries.py)
            elif key.startswith(keys.DELIVERED_PREFIX) and keys.read_u64(value) > fence:
                # A consumer offered messages after the fence: in the backup, offered up to it, so what the
                # restored cluster stores after its fence is the consumer's.
                value = keys.u64(fence)
            elif key.startswith(keys.MESSAGE_EXPIRY_PREFIX):
                # A message's expiry entry goes with the message: its generation exported, its timestamp not past
                # the fence.
                generation, _, _, ts = keys.read_message_expiry_key(key)
                if generation in left_out or ts > fence:
                    continue
            yield key, value
        if not last_ts_seen and fence:
            yield keys.META_LAST_TS, keys.u64(fence)

    def _generation_records(self, name: str) -> Iterator[tuple[bytes, bytes]]:
        fence = self.fence_us
        cf = self._db.get_column_family(name)
        for key, value in cf.items():
            # D: u32 stream, u64 timestamp; I: ..., u64 timestamp of the batch's first such message.
            ts = keys.data_key_ts(key) if key[:1] == keys.DATA_TAG else keys.read_u64(key[-8:])
            if ts <= fence:
                yield key, value


def _prefixed(db: Rdict, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    for key, value in db.items(from_key=prefix):
        if not key.startswith(prefix):
            return
        yield key, value
