"""A shard's generations: the time intervals it is cut into, one column family each.

Writes go to the current generation only; ``add_generation`` closes it and
opens the next one, and retention drops closed ones whole (their column
family), so disk usage is bounded without per-message deletes. The records
(``g:`` keys) and the presence keys (``p:``, which streams hold data in which
generation) are in the metadata family; a change of generations is one synced
write batch, written through the ``write`` callback the shard gives, which also
records the applied log index. ``Generations`` is the in-memory view of them;
the shard holds its lock around every call.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from rocksdict import Rdict, WriteBatch

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.storage import keys
from mqds.server.storage.engine import Engine, scan
from mqds.server.storage.trie import TopicTrie

log = logging.getLogger(__name__)

Write = Callable[[WriteBatch], None]
"""Writes a batch of the shard's changes (see ``ShardStorage._write``)."""


@dataclass(frozen=True)
class GenerationInfo:
    """A generation of a shard, the time interval it covers, and the last message stored before it.

    ``last_before_us`` tells a dropped generation before this one from one
    that held nothing a reader lacks (``ordered.dropped_after``): None where
    the record predates it (version 1).
    """

    shard: int
    generation: int
    since_us: int
    until_us: int | None
    created_at_us: int
    last_before_us: int | None = None

    @property
    def current(self) -> bool:
        return self.until_us is None


@dataclass
class Generation:
    """An open generation: its record, its column family and the streams that hold data in it."""

    number: int
    record: keys.GenerationRecord
    cf: Rdict
    handle: object
    present: set[int] = field(default_factory=set)


class Generations:
    """The generations of one shard, by number, and which one is current."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.by_number: dict[int, Generation] = {}
        self.current = 0

    # -- opening -------------------------------------------------------------

    def load(self, db: Rdict, engine: Engine, cf_names: list[str]) -> None:
        """Open the generations recorded in ``db``; drop column families that no record names."""
        records = {
            keys.read_u32(key[len(keys.GENERATION_PREFIX) :]): keys.GenerationRecord.decode(value)
            for key, value in scan(db, keys.GENERATION_PREFIX)
        }
        for name in cf_names:
            number = keys.parse_generation_cf(name)
            if number is not None and number not in records:
                # Created by a rotation that crashed before its metadata was
                # written, or left by a drop that crashed after it: not part of
                # the shard's state either way.
                log.warning("shard %d: dropping orphan column family %s", self.shard, name)
                db.drop_column_family(name)
        for number, record in sorted(records.items()):
            self.open(db, engine, number, record)
        for key, _ in scan(db, keys.PRESENCE_PREFIX):
            generation, stream = keys.parse_presence_key(key)
            if generation in self.by_number:
                self.by_number[generation].present.add(stream)
        if self.by_number:
            self.current = max(self.by_number)

    def open(self, db: Rdict, engine: Engine, number: int, record: keys.GenerationRecord) -> Generation:
        name = keys.generation_cf(number)
        try:
            cf = db.get_column_family(name)
        except Exception:  # a record without its column family: created now
            cf = db.create_column_family(name, engine.cf_options())
        gen = Generation(number, record, cf, db.get_column_family_handle(name))
        self.by_number[number] = gen
        return gen

    # -- changes ---------------------------------------------------------------

    def create_first(self, db: Rdict, engine: Engine, meta: object, now_us: int, last_ts: int, write: Write) -> None:
        """Create generation 1, which covers all time until a second one is added."""
        record = keys.GenerationRecord(since_us=0, until_us=None, created_at_us=now_us, last_before_us=last_ts)
        name = keys.generation_cf(1)
        db.create_column_family(name, engine.cf_options())
        batch = WriteBatch(raw_mode=True)
        batch.put(keys.generation_key(1), record.encode(), meta)
        try:
            write(batch)
        except BaseException:
            db.drop_column_family(name)
            raise
        self.open(db, engine, 1, record)
        self.current = 1

    def add(self, db: Rdict, engine: Engine, meta: object, now_us: int, last_ts: int, write: Write) -> int:
        """Close the current generation and open the next, starting after ``last_ts``; the new last timestamp.

        The new record keeps the last message stored before it: ``last_ts``,
        unless the closing generation stored nothing (``last_ts`` is then the
        ``since - 1`` its own opening set, and is no message's), in which case
        the closing generation's own ``last_before_us`` carries on. So a shard
        that rotates while idle still tells, after the drops, that nothing its
        readers lack was dropped.
        """
        old = self.by_number[self.current]
        since = max(now_us, last_ts + 1, old.record.since_us + 1)
        number = self.current + 1
        closed = dataclasses.replace(old.record, until_us=since)
        stored_in_old = last_ts >= old.record.since_us
        last_before = last_ts if stored_in_old or old.record.last_before_us is None else old.record.last_before_us
        record = keys.GenerationRecord(since_us=since, until_us=None, created_at_us=now_us, last_before_us=last_before)
        name = keys.generation_cf(number)
        db.create_column_family(name, engine.cf_options())
        batch = WriteBatch(raw_mode=True)
        batch.put(keys.generation_key(old.number), closed.encode(), meta)
        batch.put(keys.generation_key(number), record.encode(), meta)
        batch.put(keys.META_LAST_TS, keys.u64(since - 1), meta)
        try:
            write(batch)
        except BaseException:
            # Without its record the column family is an orphan: drop it
            # now so a retry can create it again.
            db.drop_column_family(name)
            raise
        old.record = closed
        self.open(db, engine, number, record)
        self.current = number
        return since - 1

    def drop(
        self, db: Rdict, meta: object, number: int, trie: TopicTrie, write: Write, forget_routes: Callable[[], None]
    ) -> GenerationInfo:
        """Drop a closed generation: its metadata and the trie's streams left empty, then its column family.

        ``forget_routes`` is called once the trie lost streams, before the
        column family goes: routes cached from the trie may name them.
        """
        gen = self.get(number)
        if number == self.current:
            raise errors.error(
                Reason.CURRENT_GENERATION,
                f"generation {number} is the current generation of shard {self.shard}; "
                "add a generation first, then drop this one",
            )
        info = self.info(gen)
        batch = WriteBatch(raw_mode=True)
        batch.delete(keys.generation_key(number), meta)
        batch.delete(keys.changes_key(number), meta)
        batch.delete_range(keys.presence_key(number, 0), keys.presence_key(number + 1, 0), meta)
        # Queue acknowledgements of the generation's messages go with them.
        until = gen.record.until_us or 0
        batch.delete_range(keys.queue_ack_key(gen.record.since_us), keys.queue_ack_key(until), meta)
        # The trie is the shard's, shared by its generations: the streams
        # that hold data in no generation left go, with the edges that
        # lead only to them (also those left by drops before this was
        # done). Every replica prunes the same trie at the same log index.
        live: set[int] = set()
        for other in self.by_number.values():
            if other.number != number:
                live.update(other.present)
        pruned = trie.prune(live)
        for parent, token, _ in pruned:
            batch.delete(keys.trie_edge_key(parent, token), meta)
        if pruned:
            # Opening derives next_node from the edges when the key is
            # missing: keep it, so removed ids are never handed out again.
            batch.put(keys.META_NEXT_NODE, keys.u32(trie.next_node), meta)
        try:
            write(batch)
        except BaseException:
            for parent, token, child in pruned:
                trie.restore_edge(parent, token, child)
            raise
        if pruned:
            forget_routes()
        del self.by_number[number]
        # Readers holding the column family keep reading it until they
        # let go; RocksDB deletes the files after that.
        db.drop_column_family(keys.generation_cf(number))
        return info

    # -- lookups ---------------------------------------------------------------

    def info(self, gen: Generation) -> GenerationInfo:
        r = gen.record
        return GenerationInfo(self.shard, gen.number, r.since_us, r.until_us, r.created_at_us, r.last_before_us)

    def in_order(self) -> list[Generation]:
        """The open generations, oldest first."""
        return [self.by_number[n] for n in sorted(self.by_number)]

    def infos(self) -> list[GenerationInfo]:
        return [self.info(gen) for gen in self.in_order()]

    def get(self, number: int) -> Generation:
        """The generation ``number``; GENERATION_DROPPED or UNKNOWN_GENERATION if there is none."""
        gen = self.by_number.get(number)
        if gen is not None:
            return gen
        if 0 < number < self.current:
            raise errors.error(
                Reason.GENERATION_DROPPED,
                f"generation {number} of shard {self.shard} was dropped; call GetStreams again for current streams",
            )
        raise errors.error(
            Reason.UNKNOWN_GENERATION,
            f"shard {self.shard} has no generation {number} (current is {self.current})",
        )

    def expired(self, now_us: int, retention_us: int) -> list[int]:
        """Closed generations whose interval ended before ``now_us - retention_us``."""
        horizon = now_us - retention_us
        return [
            n
            for n, gen in sorted(self.by_number.items())
            if gen.record.until_us is not None and gen.record.until_us <= horizon
        ]
