"""What a broker keeps in a shard besides messages: client state, subscriptions, retained messages, read positions.

All of it lives in the shard's ``default`` column family (``keys.py`` has the
layout), so it is part of every checkpoint and snapshot and of the applied
index's write batch, exactly like the messages. Every change takes the
logged clock (``now_us``) and is deterministic, so replicas agree byte for
byte. Every change is idempotent but for the recorded times, so a client can
retry any of them without a deduplication record.

Where each thing lives is the caller's business (``mqds.server.api``): client
state, subscriptions and read positions in the clientid's shard, a retained
message in its topic's shard, a queue acknowledgement in the shard of the
message it removes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rocksdict import WriteBatch

from mqds.protocol.topics import matches_levels
from mqds.server.storage import keys
from mqds.server.storage.ordered import ordered
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

if TYPE_CHECKING:
    from mqds.server.storage.shard import ShardStorage

# How far one queue acknowledgement moves its filter's floor at most.
_FLOOR_STEPS = 10_000


@dataclass(frozen=True)
class FetchFilter:
    """Which stored messages an offline fetch returns."""

    topic_filter: str
    after_us: int
    """Only messages with a later timestamp (the read position; 0 for all)."""
    since_us: int
    """Only messages at or after this time (the time range; 0 for all)."""
    max_count: int
    include_qos0: bool
    skip_acked: bool
    """Skip messages a queue reader acknowledged."""
    max_bytes: int | None = None
    """Stop before the message that would take the stored bytes found past this (one message at least)."""


class SessionState:
    """The broker state of one shard, on top of its ``ShardStorage``."""

    def __init__(self, storage: ShardStorage) -> None:
        self._storage = storage

    # -- writes -----------------------------------------------------------------

    def _commit(self, batch: WriteBatch, applied_index: int | None) -> None:
        self._storage.write_meta(batch, applied_index)

    def _get(self, key: bytes) -> bytes | None:
        return self._storage.meta_get(key)

    def client_connected(
        self, clientid: str, node: str, now_us: int, *, applied_index: int | None = None
    ) -> spb.ClientState:
        batch = WriteBatch(raw_mode=True)
        old = self.client_state(clientid)
        if old is not None and old.online:
            batch.delete(keys.node_clients_prefix(old.node) + clientid.encode("utf-8"), self._storage.meta_handle)
        state = spb.ClientState(online=True, node=node, online_at_us=now_us)
        batch.put(keys.client_key(clientid), state.SerializeToString(), self._storage.meta_handle)
        batch.put(keys.node_clients_prefix(node) + clientid.encode("utf-8"), b"", self._storage.meta_handle)
        self._commit(batch, applied_index)
        state.clientid = clientid
        return state

    def client_disconnected(
        self, clientid: str, node: str, now_us: int, *, applied_index: int | None = None
    ) -> spb.ClientState | None:
        """Mark a client offline; None (and no change) if unknown, or ``node`` is given and is not its node."""
        batch = WriteBatch(raw_mode=True)
        old = self.client_state(clientid)
        if old is None or (node and old.node != node):
            self._commit(batch, applied_index)
            return None
        if old.online:
            batch.delete(keys.node_clients_prefix(old.node) + clientid.encode("utf-8"), self._storage.meta_handle)
            old.online = False
            old.offline_at_us = now_us
            old.ClearField("clientid")
            batch.put(keys.client_key(clientid), old.SerializeToString(), self._storage.meta_handle)
        self._commit(batch, applied_index)
        old.clientid = clientid
        return old

    def subscribe(self, clientid: str, topic_filter: str, qos: int, *, applied_index: int | None = None) -> None:
        batch = WriteBatch(raw_mode=True)
        key = keys.subscriptions_prefix(clientid) + topic_filter.encode("utf-8")
        batch.put(key, bytes((qos,)), self._storage.meta_handle)
        self._commit(batch, applied_index)

    def unsubscribe(self, clientid: str, topic_filter: str, *, applied_index: int | None = None) -> bool:
        key = keys.subscriptions_prefix(clientid) + topic_filter.encode("utf-8")
        existed = self._get(key) is not None
        batch = WriteBatch(raw_mode=True)
        if existed:
            batch.delete(key, self._storage.meta_handle)
        self._commit(batch, applied_index)
        return existed

    def retain(self, message: pb.Message, now_us: int, *, applied_index: int | None = None) -> pb.Message | None:
        """Keep ``message`` as its topic's retained message (stamped ``now_us``); an empty payload deletes it."""
        key = keys.retained_key(message.topic)
        batch = WriteBatch(raw_mode=True)
        if not message.payload:
            batch.delete(key, self._storage.meta_handle)
            self._commit(batch, applied_index)
            return None
        stored = pb.Message()
        stored.CopyFrom(message)
        stored.retain = True
        stored.timestamp_us = now_us
        stored.shard = self._storage.shard
        batch.put(key, stored.SerializeToString(), self._storage.meta_handle)
        self._commit(batch, applied_index)
        return stored

    def ack_pubsub(
        self, clientid: str, topic_filter: str, shard: int, timestamp_us: int, *, applied_index: int | None = None
    ) -> None:
        """Move the (clientid, filter) read position in ``shard`` up to ``timestamp_us`` (never back)."""
        key = keys.position_key(clientid, topic_filter)
        position = self.read_position(clientid, topic_filter) or spb.ReadPosition()
        batch = WriteBatch(raw_mode=True)
        if position.acked_us.get(shard, 0) < timestamp_us:
            position.acked_us[shard] = timestamp_us
            # Deterministic: map entries in key order, the same bytes everywhere.
            batch.put(key, position.SerializeToString(deterministic=True), self._storage.meta_handle)
        self._commit(batch, applied_index)

    def ack_queue(self, timestamp_us: int, topic_filter: str, *, applied_index: int | None = None) -> None:
        """Remove the message stored in this shard at ``timestamp_us`` for every queue reader.

        Also moves the filter's queue floor over the acknowledged messages at
        the head of the queue (at most ``_FLOOR_STEPS`` per call): reads of
        this replica's own state, the same on every replica at this log index.
        """
        batch = WriteBatch(raw_mode=True)
        batch.put(keys.queue_ack_key(timestamp_us), b"", self._storage.meta_handle)
        floor = self.queue_floor(topic_filter)
        if timestamp_us > floor:
            moved = floor
            for steps, (ts, _) in enumerate(self._ordered(topic_filter, floor + 1)):
                if steps == _FLOOR_STEPS or (ts != timestamp_us and self._get(keys.queue_ack_key(ts)) is None):
                    break
                moved = ts
            if moved != floor:
                batch.put(keys.queue_floor_key(topic_filter), keys.u64(moved), self._storage.meta_handle)
        self._commit(batch, applied_index)

    def forget_position(self, clientid: str, topic_filter: str, *, applied_index: int | None = None) -> bool:
        key = keys.position_key(clientid, topic_filter)
        existed = self._get(key) is not None
        batch = WriteBatch(raw_mode=True)
        if existed:
            batch.delete(key, self._storage.meta_handle)
        self._commit(batch, applied_index)
        return existed

    def start_position(
        self, clientid: str, topic_filter: str, now_us: int, *, applied_index: int | None = None
    ) -> tuple[bool, spb.ReadPosition]:
        """Start the (clientid, filter) read position at ``now_us`` unless it has one: (started, the position)."""
        batch = WriteBatch(raw_mode=True)
        position = self.read_position(clientid, topic_filter)
        started = position is None
        if position is None:
            position = spb.ReadPosition(start_us=now_us)
            batch.put(
                keys.position_key(clientid, topic_filter),
                position.SerializeToString(deterministic=True),
                self._storage.meta_handle,
            )
        self._commit(batch, applied_index)
        return started, position

    def forget_session(self, clientid: str, *, applied_index: int | None = None) -> tuple[int, int]:
        """Delete a client's subscriptions and read positions: (subscriptions, read positions) deleted."""
        batch = WriteBatch(raw_mode=True)
        counts = []
        for prefix in (keys.subscriptions_prefix(clientid), keys.positions_prefix(clientid)):
            found = [key for key, _ in self._storage.meta_scan(prefix)]
            for key in found:
                batch.delete(key, self._storage.meta_handle)
            counts.append(len(found))
        self._commit(batch, applied_index)
        return counts[0], counts[1]

    # -- reads ------------------------------------------------------------------

    def client_state(self, clientid: str) -> spb.ClientState | None:
        raw = self._get(keys.client_key(clientid))
        if raw is None:
            return None
        state = spb.ClientState.FromString(raw)
        state.clientid = clientid
        return state

    def clients_on_node(self, node: str) -> list[str]:
        prefix = keys.node_clients_prefix(node)
        return [key[len(prefix) :].decode("utf-8") for key, _ in self._storage.meta_scan(prefix)]

    def subscriptions(self, clientid: str) -> list[tuple[str, int]]:
        prefix = keys.subscriptions_prefix(clientid)
        return [(key[len(prefix) :].decode("utf-8"), value[0]) for key, value in self._storage.meta_scan(prefix)]

    def retained(self, filter_levels: list[str]) -> list[bytes]:
        """The retained messages (serialised ``mqds.v1.Message``) whose topics match, by topic."""
        literal: list[str] = []
        for level in filter_levels:
            if level in ("+", "#"):
                break
            literal.append(level)
        # "a/b/#" also matches "a/b" itself: scan from the literal levels
        # without a trailing separator and check every candidate.
        prefix = keys.retained_key("/".join(literal))
        start = len(keys.RETAINED_PREFIX)
        return [
            value
            for key, value in self._storage.meta_scan(prefix)
            if matches_levels(filter_levels, key[start:].decode("utf-8").split("/"))
        ]

    def read_position(self, clientid: str, topic_filter: str) -> spb.ReadPosition | None:
        raw = self._get(keys.position_key(clientid, topic_filter))
        return None if raw is None else spb.ReadPosition.FromString(raw)

    def queue_floor(self, topic_filter: str) -> int:
        """The timestamp up to which every message of this shard matching ``topic_filter`` was queue-acknowledged."""
        raw = self._get(keys.queue_floor_key(topic_filter))
        return 0 if raw is None else keys.read_u64(raw)

    def fetch(self, wanted: FetchFilter) -> list[tuple[int, bytes]]:
        """Up to ``max_count`` stored messages (and ``max_bytes``) that pass ``wanted``, oldest first.

        Each is (timestamp, stored bytes). A queue fetch starts after the filter's queue floor, so acknowledged
        messages at the head of a queue are not scanned again and again.
        """
        after = wanted.after_us
        if wanted.skip_acked:
            after = max(after, self.queue_floor(wanted.topic_filter))
        found: list[tuple[int, bytes]] = []
        size = 0
        for ts, stored in self._ordered(wanted.topic_filter, max(after + 1, wanted.since_us)):
            if not wanted.include_qos0 and _qos(stored) == 0:
                continue
            if wanted.skip_acked and self._get(keys.queue_ack_key(ts)) is not None:
                continue
            size += len(stored)
            if wanted.max_bytes is not None and found and size > wanted.max_bytes:
                break
            found.append((ts, stored))
            if len(found) == wanted.max_count:
                break
        return found

    def _ordered(self, topic_filter: str, start_us: int) -> Iterator[tuple[int, bytes]]:
        return ordered(self._storage, topic_filter, start_us)


_parse: Callable[[bytes], pb.Message] = pb.Message.FromString


def _qos(stored: bytes) -> int:
    return int(_parse(stored).qos)
