"""Exactly-once storing: the (producer, sequence) pairs a shard remembers, and their expiry.

A store call may carry ``dedup=(producer, sequence)``. The shard records the
pair with the first timestamp and the message count it got, in the same write
batch as the messages, so a retried call finds it and gets the same answer
instead of storing the messages again. Records are forgotten after
``DEDUP_WINDOW_US`` of the leader's clock: an expiry index (``e:`` keys,
ordered by the time stored) lets a store delete the expired ones, at most once
per ``DEDUP_PRUNE_PERIOD_US``. Every input is a logged argument (``now_us``,
the pair), so every replica remembers, answers and prunes the same.
"""

from __future__ import annotations

from rocksdict import Rdict, WriteBatch

from mqds.server.storage import keys
from mqds.server.storage.engine import scan

DEDUP_WINDOW_US = 600_000_000
"""How long a shard remembers a (producer, sequence) batch it stored: 10 minutes
of the leader's clock, far longer than any client retries one call."""
DEDUP_PRUNE_PERIOD_US = 60_000_000
"""Forgotten records are deleted at most once per period (of logged time)."""


def seen(db: Rdict, dedup_key: bytes, now_us: int) -> keys.DedupRecord | None:
    """The record of a batch stored under ``dedup_key`` within the window before ``now_us``, if any."""
    raw = db.get(dedup_key)
    if raw is None:
        return None
    record = keys.DedupRecord.decode(raw)
    # Expired records count as absent whether or not pruned yet, so the
    # answer never depends on when a replica last pruned.
    return record if now_us - record.stored_at_us <= DEDUP_WINDOW_US else None


def remember(batch: WriteBatch, meta: object, dedup_key: bytes, first_ts: int, count: int, now_us: int) -> None:
    """Record in ``batch`` that ``count`` messages from ``first_ts`` were stored under ``dedup_key`` at ``now_us``."""
    batch.put(dedup_key, keys.DedupRecord(first_ts, count, now_us).encode(), meta)
    batch.put(keys.dedup_expiry_key(now_us, dedup_key), b"", meta)


def prune(db: Rdict, batch: WriteBatch, meta: object, now_us: int, pruned: int) -> int:
    """Delete expired records in ``batch``, once per prune period; the period pruned last, now.

    ``pruned`` is the period pruned last (``m:dedup_pruned``); when ``now_us``
    is in a later one, the expired records and their expiry keys are deleted
    and the new period is recorded in the same batch.
    """
    period = now_us // DEDUP_PRUNE_PERIOD_US
    if period <= pruned:
        return pruned
    bound = keys.dedup_expiry_key(max(0, now_us - DEDUP_WINDOW_US), keys.DEDUP_PREFIX)
    start = len(keys.DEDUP_EXPIRY_PREFIX) + 8
    for key, _ in scan(db, keys.DEDUP_EXPIRY_PREFIX):
        if key >= bound:
            break
        batch.delete(key, meta)
        batch.delete(keys.DEDUP_PREFIX + key[start:], meta)
    batch.put(keys.META_DEDUP_PRUNED, keys.u64(period), meta)
    return period
