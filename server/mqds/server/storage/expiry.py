"""What ends in a shard: retained messages and sessions, each found through an index by the time it ends.

A retained message with ``message_expiry_s`` (MQTT 5's Message Expiry
Interval) ends that long after it was retained; the session of a client
(its state, proxy subscriptions and read positions) ends ``session_expiry_s``
after the client disconnected (MQTT 5's Session Expiry Interval, or the
node's default for a client that reported none; 0 at the disconnect,
:data:`NEVER` never). Each has an entry in an index ordered by that time
(``keys.expiry_key``: ``x:`` retained messages by topic, ``y:`` sessions by
clientid), written in the same batch as the change that sets the time and
removed with the change that cancels it (a new retained message, a
reconnect).

A stored message with ``message_expiry_s`` is handed out by offline
fetches and push subscriptions only until that long after it was stored
(its ``timestamp_us``), with what is left of its interval
(:func:`message_left`); replay and Spark read it as stored until it is
removed. The store writes an entry for it in its generation's index
(``keys.message_expiry_key``: ``z:`` by generation, then the time it ends);
an ``ExpireMessages`` step walks each generation's entries from their head
(:func:`due_messages`) and removes those messages (``limits.trim``, the
listed messages of a stream deleted) with their entries. A generation that
was dropped has its entries removed whole, by one range deletion.

Removal is a logged change like any other: the leader asks ``due`` now and
then and logs an ``Expire`` command with its clock and a bounded step; each
replica applies it by walking the indexes from their heads, so every replica
removes the same keys whatever its own clock says. Reads leave out what is
due but not removed yet (a few entries at the indexes' heads).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from rocksdict import WriteBatch

from mqds.protocol.limits import SESSION_NEVER_EXPIRES
from mqds.server.storage import keys
from mqds.server.storage.metadata import MetadataFamily
from mqds.server.wire import message_expiry_s, with_expiry
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

NEVER = SESSION_NEVER_EXPIRES
"""A Session Expiry Interval that never ends (MQTT 5)."""


def message_expires_us(message: pb.Message) -> int | None:
    """When a retained message ends (None: it does not)."""
    if not message.message_expiry_s:
        return None
    return message.timestamp_us + message.message_expiry_s * 1_000_000


def remaining_s(expires_us: int, now_us: int) -> int:
    """What is left at ``now_us`` of an interval ending at ``expires_us``, in whole seconds rounded up (MQTT 5
    forwards a positive whole number of seconds); 0 once it ended."""
    left = expires_us - now_us
    return 0 if left <= 0 else -(-left // 1_000_000)


def message_left(timestamp_us: int, stored: bytes, now_us: int) -> bytes | None:
    """A stored message as an offline fetch or a push hands it out at ``now_us``: as stored without a Message
    Expiry Interval; with the interval left (``message_expiry_s`` appended, last wins) while it runs; None once
    it ended (at ``timestamp_us`` + the interval, as for a retained message).

    One scan of the message's tags (``wire.message_expiry_s``) and, for the few with an interval, a
    comparison.
    """
    expiry = message_expiry_s(stored)
    if not expiry:
        return stored
    # Never more than the interval itself (a replica whose clock is behind the one that stored it).
    left = min(expiry, remaining_s(timestamp_us + expiry * 1_000_000, now_us))
    return with_expiry(stored, left) if left else None


def session_expires_us(state: spb.ClientState) -> int | None:
    """When an offline client's session ends (None: online, or it never does)."""
    if state.online or state.session_expiry_s == NEVER:
        return None
    return state.offline_at_us + state.session_expiry_s * 1_000_000


class ExpiryIndex:
    """One index of what ends when, in a shard's ``default`` family: entries by time, then name."""

    def __init__(self, metadata: MetadataFamily, prefix: bytes) -> None:
        self._meta = metadata
        self.prefix = prefix

    def put(self, batch: WriteBatch, at_us: int, name: str) -> None:
        batch.put(keys.expiry_key(self.prefix, at_us, name), b"", self._meta.handle)

    def delete(self, batch: WriteBatch, at_us: int, name: str) -> None:
        batch.delete(keys.expiry_key(self.prefix, at_us, name), self._meta.handle)

    def due(self, now_us: int, limit: int | None = None) -> list[tuple[bytes, str]]:
        """The entries due at ``now_us`` (at most ``limit``), earliest first: (key, name)."""
        out: list[tuple[bytes, str]] = []
        for key, _ in self._meta.scan(self.prefix):
            at_us, name = keys.read_expiry_key(self.prefix, key)
            if at_us > now_us or (limit is not None and len(out) >= limit):
                break
            out.append((key, name))
        return out

    def any_due(self, now_us: int) -> bool:
        return bool(self.due(now_us, 1))


class ExpiredMessages(NamedTuple):
    """Stored messages of one stream of one generation whose interval ended, by timestamp (what ``limits.trim``
    deletes)."""

    generation: int
    stream: int
    timestamps: list[int]


def due_messages(
    meta: MetadataFamily, live: Collection[int], now_us: int, max_count: int, batch: WriteBatch | None = None
) -> tuple[list[ExpiredMessages], int]:
    """The stored messages whose interval ended at ``now_us``, each generation's earliest first, and how many
    index entries go with them: at most ``max_count`` entries, the entries of a generation not in ``live``
    (dropped with its messages) counting as one, since they go whole, as one range deletion.

    With ``batch``, the entries' deletions are put in it (the caller deletes the messages). Reads the index
    only, a seek per generation that holds entries; without ``batch``, a count above 0 says a step has
    something to do.
    """
    found: dict[tuple[int, int], list[int]] = {}
    removed = 0
    taken = 0
    start: bytes | None = None
    while taken + removed < max_count:
        head = next(iter(meta.scan(keys.MESSAGE_EXPIRY_PREFIX, start)), None)
        if head is None:
            break
        generation = keys.read_message_expiry_key(head[0])[0]
        prefix = keys.message_expiry_prefix(generation)
        following = keys.message_expiry_prefix(generation + 1)
        start = following
        if generation not in live:  # dropped with its messages: its entries go, as one range
            removed += 1
            if batch is not None:
                batch.delete_range(prefix, following, meta.handle)
            continue
        for key, _ in meta.scan(prefix):
            _, expires_us, stream, ts = keys.read_message_expiry_key(key)
            if expires_us > now_us or taken + removed >= max_count:
                break
            found.setdefault((generation, stream), []).append(ts)
            taken += 1
            if batch is not None:
                batch.delete(key, meta.handle)
    expired = [ExpiredMessages(g, stream, stamps) for (g, stream), stamps in found.items()]
    return expired, taken + removed
