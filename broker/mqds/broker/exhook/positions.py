"""EMQX message id -> stored position, kept in mqds so that a restarted provider resolves acknowledgements.

EMQX reports a delivered or acknowledged message by its id (``Message.id``,
EMQX's GUID in hex), not by the position mqds stored it at, which an
acknowledgement needs. The provider learns the position when it stores the
publish; :class:`AckPositions` keeps the pair where any provider process
finds it:

- in this process, the last ``cache_size`` ids in an LRU (no call);
- in mqds, as a retained record on the reserved topic
  ``$mqds/exhook/positions/<id>`` (payload ``"<shard> <timestamp_us>"``),
  written before ``OnMessagePublish`` is answered, so every message EMQX
  routes has one. Retained messages are replicated state of the cluster,
  kept in the shard of their topic; a provider that restarted (or another
  one behind the same EMQX cluster) reads the record on an id it does not
  remember.

**Bounded.** Each record is written with a Message Expiry Interval: ``ttl_s``
(the ``--ack-positions-ttl`` of ``mqds exhook``, one day by default), or the
message's own expiry interval when shorter (EMQX does not deliver an expired
message, so no acknowledgement of it comes). mqds removes expired retained
messages in its bounded expiry steps, so the records in the cluster are at
most those of the messages stored in the last ``ttl_s``, each under 150
bytes. A topic starting with ``$`` matches no filter starting with a
wildcard (``#``, ``+/...``), so subscribers and retained lookups of ``#`` do
not see the records.

Only ids that make one topic level (letters, digits, ``-`` and ``_``, at
most :data:`MAX_ID_CHARS`; EMQX's are 32 hex digits) are written to mqds;
others are remembered in this process only (counted).
"""

from __future__ import annotations

import collections
import re

from mqds.client import aio
from mqds.client.model import Message

__all__ = ["DEFAULT_TTL_S", "MAX_ID_CHARS", "TOPIC_PREFIX", "AckPositions"]

TOPIC_PREFIX = "$mqds/exhook/positions/"
"""The reserved topic level under which the records are retained, one topic per EMQX message id."""

DEFAULT_TTL_S = 86_400
"""How long a record is kept by default: a day (EMQX keeps an offline session's messages 2 hours by default)."""

MAX_ID_CHARS = 128
_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_ID_CHARS}}}")
_SENDER = "mqds-exhook"

Position = tuple[int, int]


class AckPositions:
    """The positions of the messages the provider stored, by EMQX message id (see the module's documentation).

    ``stats`` counts ``ack_positions_recorded`` (written to mqds),
    ``ack_positions_read`` (found in mqds after a miss here),
    ``ack_positions_not_recordable`` (ids kept here only).
    """

    def __init__(self, client: aio.Client, *, cache_size: int, ttl_s: int = DEFAULT_TTL_S) -> None:
        if cache_size < 1:
            raise ValueError("cache_size must be at least 1")
        if not 1 <= ttl_s <= 0xFFFFFFFF:
            raise ValueError("ttl_s must be 1 to 4294967295 seconds")
        self.client = client
        self.cache_size = cache_size
        self.ttl_s = ttl_s
        self.stats: collections.Counter[str] = collections.Counter()
        self._cache: collections.OrderedDict[str, Position] = collections.OrderedDict()

    def remembered(self, message_id: str) -> Position | None:
        """The position this process remembers for an id, without asking mqds."""
        return self._cache.get(message_id)

    def _remember(self, message_id: str, position: Position) -> None:
        self._cache[message_id] = position
        self._cache.move_to_end(message_id)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    async def record(self, message_id: str, stored: Message) -> None:
        """Remember where ``stored`` (as ``message_publish`` returned it) is, here and in mqds."""
        if not message_id or stored.shard is None or stored.timestamp_us is None:
            return
        position = (stored.shard, stored.timestamp_us)
        self._remember(message_id, position)
        if not _ID.fullmatch(message_id):
            self.stats["ack_positions_not_recordable"] += 1
            return
        expiry = self.ttl_s if not stored.message_expiry_s else min(self.ttl_s, stored.message_expiry_s)
        record = Message(
            topic=TOPIC_PREFIX + message_id,
            payload=f"{position[0]} {position[1]}".encode(),
            sender=_SENDER,
            qos=0,
            retain=True,
            message_expiry_s=expiry,
        )
        await self.client.retain(record)
        self.stats["ack_positions_recorded"] += 1

    async def resolve(self, message_id: str) -> Position | None:
        """The position of an EMQX message id: remembered here, else read from mqds; None when neither has it."""
        if not message_id:
            return None
        position = self._cache.get(message_id)
        if position is not None:
            self._cache.move_to_end(message_id)
            return position
        if not _ID.fullmatch(message_id):
            return None
        found = await self.client.retained(TOPIC_PREFIX + message_id)
        position = next((p for p in map(_position, found) if p is not None), None)
        if position is not None:
            self.stats["ack_positions_read"] += 1
            self._remember(message_id, position)
        return position


def _position(record: Message) -> Position | None:
    """A record's position; None for a payload that is not ``"<shard> <timestamp_us>"``."""
    parts = record.payload.split()
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        return None
    return int(parts[0]), int(parts[1])
