"""Redelivery for queue readers and share groups: a consumer's deliveries, kept in the shard of their messages.

A consumer (a clientid, or a share group's ``$share/<group>``, with a topic
filter) takes messages with delivery steps (``Sessions.Deliver``), each a
logged command of the message's shard with the leader's clock. In that shard
the consumer has a delivered cursor (``o:``: every message up to it was
offered) and one ``w:`` key per message delivered and not acknowledged: how
many times it was delivered and when it is due again (the step's ``now_us``
plus the policy's wait for that delivery). A step, applied alike on every
replica, takes

1. the deliveries that are due, oldest first: each is delivered again (its
   count goes up) or, past the policy's last delivery, stored on the
   dead-letter topic and ended, in the same write as the rest of the step;
2. then messages after the cursor, up to the policy's ``max_unacked`` in
   flight, and moves the cursor past what it scanned.

An acknowledgement (``ack``) deletes the ``w:`` key; the consumer is done with
a message once the cursor passed it and it has no ``w:`` key. Everything a
step reads is replicated state (the shard's messages, its ``w:``, ``o:`` and
queue keys), and every time is the command's, so each replica writes the same
keys, and a leader change neither loses nor doubles a count: the new leader
applied the same steps.

Bounds: a step reads at most ``max_unacked`` (<= 10,000) ``w:`` keys and
:data:`SCAN_STEPS` messages after the cursor; its answer holds at most
``max_count`` messages within ``max_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rocksdict import WriteBatch

from mqds.protocol import delivery
from mqds.protocol.delivery import Policy
from mqds.server.storage import keys
from mqds.server.storage.expiry import message_left
from mqds.server.storage.metadata import MetadataFamily
from mqds.v1 import storage_pb2 as pb

_U64_MAX = (1 << 64) - 1
SCAN_STEPS = 10_000
"""Messages after the cursor one step looks at most (those it skips, QoS 0 or queue-acknowledged, count too)."""

ReadOrdered = Callable[[str, int, int | None], Iterator[tuple[int, bytes]]]
"""A shard's messages matching a filter from a time on, up to a fence (``ordered.ordered`` over the shard)."""
StoreDead = Callable[[list[bytes], int, Callable[[WriteBatch], None], int | None], int]
"""Stores messages (encoded) at ``now_us`` with the step's other changes in the same write; the first timestamp."""


@dataclass(frozen=True)
class DeliverStep:
    """One consumer's delivery step in one shard, as logged."""

    clientid: str
    topic_filter: str
    policy: Policy
    max_count: int
    max_bytes: int | None
    queue: bool
    """Skip messages a queue reader acknowledged; a dead letter is queue-acknowledged."""
    include_qos0: bool
    start_after_us: int
    """Where a consumer without a cursor in this shard starts (messages after it)."""
    strict_bytes: bool = False
    """Even the first message must fit ``max_bytes`` (otherwise one always does)."""


@dataclass
class Delivered:
    """What a step delivered: (timestamp, stored bytes, deliveries so far) each, redeliveries first."""

    messages: list[tuple[int, bytes, int]] = field(default_factory=list)
    dead_lettered: int = 0
    """Messages past their last delivery this step ended (stored on the dead-letter topic when there is one)."""
    unacked: int = 0
    """The consumer's deliveries waiting for an ack in this shard after the step."""
    dead_letters: list[bytes] = field(default_factory=list)
    """The dead-letter messages the step stored, encoded (for the shard's feed)."""
    dead_first_ts: int = 0
    """The timestamp of the first of them (0: none)."""


class _Changes:
    """A step's puts and deletes of metadata keys, written on their own or with the dead letters' store."""

    def __init__(self, handle: object) -> None:
        self._handle = handle
        self._ops: list[tuple[bytes, bytes | None]] = []

    def put(self, key: bytes, value: bytes) -> None:
        self._ops.append((key, value))

    def delete(self, key: bytes) -> None:
        self._ops.append((key, None))

    def into(self, batch: WriteBatch) -> None:
        for key, value in self._ops:
            if value is None:
                batch.delete(key, self._handle)
            else:
                batch.put(key, value, self._handle)


def _record(count: int, due_us: int, topic: str) -> bytes:
    return keys.u32(count) + keys.u64(due_us) + topic.encode("utf-8")


def _read_record(value: bytes) -> tuple[int, int, str]:
    return keys.read_u32(value[:4]), keys.read_u64(value[4:12]), value[12:].decode("utf-8")


class Deliveries:
    """The deliveries of the consumers whose messages are in one shard (its metadata family)."""

    def __init__(self, metadata: MetadataFamily, read_ordered: ReadOrdered, store_dead: StoreDead) -> None:
        self._meta = metadata
        self._read_ordered = read_ordered
        self._store_dead = store_dead

    def key(self, clientid: str, topic_filter: str, timestamp_us: int) -> bytes:
        """The ``w:`` key of a delivery of the message at ``timestamp_us`` to the consumer."""
        return keys.deliveries_prefix(keys.consumer_id(clientid, topic_filter)) + keys.u64(timestamp_us)

    def ack(self, clientid: str, topic_filter: str, timestamp_us: int, *, applied_index: int | None) -> bool:
        """End the consumer's delivery of the message at ``timestamp_us``; whether it was waiting for its ack."""
        key = self.key(clientid, topic_filter, timestamp_us)
        existed = self._meta.get(key) is not None
        batch = WriteBatch(raw_mode=True)
        if existed:
            batch.delete(key, self._meta.handle)
        self._meta.write(batch, applied_index)
        return existed

    def nack(
        self,
        clientid: str,
        topic_filter: str,
        timestamp_us: int,
        now_us: int,
        *,
        applied_index: int | None,
        uncount: bool = False,
    ) -> bool:
        """Make the consumer's delivery of the message at ``timestamp_us`` due at ``now_us``, its count kept, or
        with ``uncount`` one less (that delivery never reached the consumer); whether it was waiting for its ack."""
        key = self.key(clientid, topic_filter, timestamp_us)
        value = self._meta.get(key)
        batch = WriteBatch(raw_mode=True)
        if value is not None:
            count, due, topic = _read_record(value)
            kept = max(count - 1, 0) if uncount else count
            batch.put(key, _record(kept, min(due, now_us), topic), self._meta.handle)
        self._meta.write(batch, applied_index)
        return value is not None

    def unacked(self, clientid: str, topic_filter: str) -> list[tuple[int, int, int]]:
        """The consumer's deliveries waiting for an ack here: (timestamp, deliveries, due at), oldest first."""
        prefix = keys.deliveries_prefix(keys.consumer_id(clientid, topic_filter))
        out = []
        for key, value in self._meta.scan(prefix):
            count, due, _ = _read_record(value)
            out.append((keys.read_u64(key[len(prefix) :]), count, due))
        return out

    def deliver(self, step: DeliverStep, now_us: int, *, applied_index: int | None) -> Delivered:
        """Apply one delivery step at ``now_us`` (the logged clock): see the module's documentation."""
        meta = self._meta
        policy = step.policy
        consumer = keys.consumer_id(step.clientid, step.topic_filter)
        prefix = keys.deliveries_prefix(consumer)
        changes = _Changes(meta.handle)
        result = Delivered()
        out = result.messages
        dead: list[bytes] = []
        size = 0
        full = False

        def fits(stored: bytes) -> bool:
            nonlocal size, full
            if full or len(out) >= step.max_count:
                return False
            if step.max_bytes is not None and (out or step.strict_bytes) and size + len(stored) > step.max_bytes:
                full = True
                return False
            size += len(stored)
            return True

        in_flight = 0
        for key, value in meta.scan(prefix):
            in_flight += 1
            count, due, topic = _read_record(value)
            if due > now_us or full or len(out) >= step.max_count:
                continue
            ts = keys.read_u64(key[len(prefix) :])
            stored = self._message(topic, ts)
            if stored is not None:
                stored = message_left(ts, stored, now_us)
            if stored is None or (step.queue and meta.get(keys.queue_ack_key(ts)) is not None):
                # Deleted, dropped by retention or past its Message Expiry Interval meanwhile, or another
                # queue reader acknowledged it: the delivery ends without a dead letter.
                changes.delete(key)
                in_flight -= 1
                continue
            if count >= policy.max_deliveries:
                changes.delete(key)
                in_flight -= 1
                if step.queue:
                    changes.put(keys.queue_ack_key(ts), b"")
                result.dead_lettered += 1
                if policy.dead_letter_topic:
                    dead.append(_dead_letter(stored, policy.dead_letter_topic, count, step))
                continue
            if not fits(stored):
                continue
            count += 1
            changes.put(key, _record(count, now_us + policy.wait_us(count), topic))
            out.append((ts, stored, count))

        cursor_key = keys.delivered_key(consumer)
        raw = meta.get(cursor_key)
        cursor = step.start_after_us if raw is None else keys.read_u64(raw)
        moved = cursor
        room = min(step.max_count - len(out), policy.max_unacked - in_flight)
        if room > 0 and not full and cursor < _U64_MAX:
            start = cursor
            if step.queue:
                floor = meta.get(keys.queue_floor_key(step.topic_filter))
                start = max(start, 0 if floor is None else keys.read_u64(floor))
            start = min(start, _U64_MAX - 1)  # no timestamp comes after the largest
            taken = 0
            for steps, (ts, stored) in enumerate(self._read_ordered(step.topic_filter, start + 1, None)):
                if steps == SCAN_STEPS:
                    break
                message = pb.Message.FromString(stored)
                left = message_left(ts, stored, now_us)  # None: its Message Expiry Interval ended
                skip = (
                    left is None
                    or (not step.include_qos0 and message.qos == 0)
                    or (step.queue and meta.get(keys.queue_ack_key(ts)) is not None)
                )
                if left is not None and not skip:
                    if not fits(left):
                        break
                    changes.put(prefix + keys.u64(ts), _record(1, now_us + policy.wait_us(1), message.topic))
                    out.append((ts, left, 1))
                    in_flight += 1
                    taken += 1
                moved = ts
                if taken == room:
                    break
        if raw is None or moved != cursor:
            changes.put(cursor_key, keys.u64(moved))
        result.unacked = in_flight
        if dead:
            result.dead_first_ts = self._store_dead(dead, now_us, changes.into, applied_index)
            result.dead_letters = dead
        else:
            batch = WriteBatch(raw_mode=True)
            changes.into(batch)
            meta.write(batch, applied_index)
        return result

    def _message(self, topic: str, timestamp_us: int) -> bytes | None:
        """The stored message at ``timestamp_us`` (its topic read as a filter: one stream), None once gone."""
        for ts, stored in self._read_ordered(topic, timestamp_us, timestamp_us):
            return stored if ts == timestamp_us else None
        return None


def _dead_letter(stored: bytes, topic: str, deliveries: int, step: DeliverStep) -> bytes:
    """The dead letter of a stored message: on ``topic``, same sender (so the same shard), payload, qos and
    properties, plus where it came from."""
    message = pb.Message.FromString(stored)
    original = message.topic
    message.topic = topic
    message.retain = False
    message.properties.add(key=delivery.DEAD_LETTER_TOPIC, value=original)
    message.properties.add(key=delivery.DEAD_LETTER_DELIVERIES, value=str(deliveries))
    message.properties.add(key=delivery.DEAD_LETTER_CONSUMER, value=f"{step.clientid} {step.topic_filter}")
    return message.SerializeToString()
