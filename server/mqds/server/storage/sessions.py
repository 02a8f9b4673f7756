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

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from rocksdict import WriteBatch

from mqds.protocol.topics import matches_levels
from mqds.server.storage import keys
from mqds.server.storage.expiry import NEVER, ExpiryIndex, message_expires_us, message_left, session_expires_us
from mqds.server.storage.metadata import MetadataFamily
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

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


@dataclass(frozen=True)
class SharedScan:
    """What one scan of a topic filter found for several fetches (``SessionState.fetch_shared``)."""

    found: list[tuple[int, bytes]]
    """Every message some fetch takes, once, oldest first: (timestamp, stored bytes)."""
    taken: list[list[int]]
    """Per fetch, in the order given: the indexes in ``found`` of its messages, oldest first."""
    cut: bool
    """The scan stopped at its byte budget, with some fetch short of its ``max_count``: the fetches that are
    short may have more messages after ``found[-1]``."""


class SessionState:
    """The broker state of one shard, in its metadata family; the shard's messages read through ``read_ordered``.

    ``ShardStorage`` builds it with what it needs of the shard: the family
    (``metadata.py``), the shard's number, its messages matching a filter in
    timestamp order from a time on (``ordered.ordered`` over the shard), and
    what to tell the shard of the keys an expiry step deleted
    (``ShardStorage.metadata_deleted``).
    """

    def __init__(
        self,
        metadata: MetadataFamily,
        shard: int,
        read_ordered: Callable[[str, int], Iterator[tuple[int, bytes]]],
        deleted: Callable[[int], None],
    ) -> None:
        self._meta = metadata
        self._shard = shard
        self._read_ordered = read_ordered
        self._deleted = deleted
        self._retained_expiry = ExpiryIndex(metadata, keys.RETAINED_EXPIRY_PREFIX)
        self._session_expiry = ExpiryIndex(metadata, keys.SESSION_EXPIRY_PREFIX)
        self._counted = threading.Lock()
        self.fetch_scans = 0
        """Scans offline fetches made of this shard since it was opened (one per filter per shared fetch)."""
        self.fetch_scanned = 0
        """Stored messages those scans read (matching the filter, before the other conditions)."""

    # -- writes -----------------------------------------------------------------

    def _commit(self, batch: WriteBatch, applied_index: int | None) -> None:
        self._meta.write(batch, applied_index)

    def _get(self, key: bytes) -> bytes | None:
        return self._meta.get(key)

    def client_connected(
        self,
        clientid: str,
        node: str,
        now_us: int,
        session_expiry_s: int = NEVER,
        *,
        applied_index: int | None = None,
    ) -> spb.ClientState:
        """Mark a client online on ``node`` with the session expiry interval it connected with.

        A session that was waiting to expire does not any more; one that
        ended before ``now_us`` but was not removed yet starts afresh (its
        subscriptions and read positions go), as if it had been.
        """
        batch = WriteBatch(raw_mode=True)
        old = self.client_state(clientid)
        if old is not None:
            if old.online:
                batch.delete(keys.node_clients_prefix(old.node) + clientid.encode("utf-8"), self._meta.handle)
            expires = session_expires_us(old)
            if expires is not None:
                self._session_expiry.delete(batch, expires, clientid)
                if expires <= now_us:  # it ended before this connect (not removed yet): a new session
                    self._delete_session_keys(batch, clientid)
        state = spb.ClientState(online=True, node=node, online_at_us=now_us, session_expiry_s=session_expiry_s)
        batch.put(keys.client_key(clientid), state.SerializeToString(), self._meta.handle)
        batch.put(keys.node_clients_prefix(node) + clientid.encode("utf-8"), b"", self._meta.handle)
        self._commit(batch, applied_index)
        state.clientid = clientid
        return state

    def client_disconnected(
        self,
        clientid: str,
        node: str,
        now_us: int,
        session_expiry_s: int | None = None,
        *,
        applied_index: int | None = None,
    ) -> spb.ClientState | None:
        """Mark a client offline; None (and no change) if unknown, or ``node`` is given and is not its node.

        ``session_expiry_s`` (MQTT 5's DISCONNECT may send one) replaces the
        interval it connected with; the session then waits to expire in the
        expiry index (not with :data:`NEVER`).
        """
        batch = WriteBatch(raw_mode=True)
        old = self.client_state(clientid)
        if old is None or (node and old.node != node):
            self._commit(batch, applied_index)
            return None
        if old.online:
            batch.delete(keys.node_clients_prefix(old.node) + clientid.encode("utf-8"), self._meta.handle)
            old.online = False
            old.offline_at_us = now_us
        else:
            expires = session_expires_us(old)
            if expires is not None:
                self._session_expiry.delete(batch, expires, clientid)
        if session_expiry_s is not None:
            old.session_expiry_s = session_expiry_s
        expires = session_expires_us(old)
        old.expires_at_us = expires or 0
        if expires is not None:
            self._session_expiry.put(batch, expires, clientid)
        old.ClearField("clientid")
        batch.put(keys.client_key(clientid), old.SerializeToString(), self._meta.handle)
        self._commit(batch, applied_index)
        old.clientid = clientid
        return old

    def subscribe(self, clientid: str, topic_filter: str, qos: int, *, applied_index: int | None = None) -> None:
        batch = WriteBatch(raw_mode=True)
        key = keys.subscriptions_prefix(clientid) + topic_filter.encode("utf-8")
        batch.put(key, bytes((qos,)), self._meta.handle)
        self._commit(batch, applied_index)

    def unsubscribe(self, clientid: str, topic_filter: str, *, applied_index: int | None = None) -> bool:
        key = keys.subscriptions_prefix(clientid) + topic_filter.encode("utf-8")
        existed = self._get(key) is not None
        batch = WriteBatch(raw_mode=True)
        if existed:
            batch.delete(key, self._meta.handle)
        self._commit(batch, applied_index)
        return existed

    def retain(self, message: pb.Message, now_us: int, *, applied_index: int | None = None) -> pb.Message | None:
        """Keep ``message`` as its topic's retained message (stamped ``now_us``); an empty payload deletes it.

        A message with ``message_expiry_s`` gets an entry in the expiry index
        (``x:``, by expiry time); the one of the message it replaces goes.
        """
        key = keys.retained_key(message.topic)
        meta = self._meta.handle
        batch = WriteBatch(raw_mode=True)
        old = self._get(key)
        if old is not None:
            expires = message_expires_us(pb.Message.FromString(old))
            if expires is not None:
                self._retained_expiry.delete(batch, expires, message.topic)
        if not message.payload:
            batch.delete(key, meta)
            self._commit(batch, applied_index)
            return None
        stored = pb.Message()
        stored.CopyFrom(message)
        stored.retain = True
        stored.timestamp_us = now_us
        stored.shard = self._shard
        batch.put(key, stored.SerializeToString(), meta)
        expires = message_expires_us(stored)
        if expires is not None:
            self._retained_expiry.put(batch, expires, message.topic)
        self._commit(batch, applied_index)
        return stored

    def expiry_due(self, now_us: int) -> bool:
        """Whether a retained message or a session ended at or before ``now_us`` (the leader then logs ``expire``)."""
        return self._retained_expiry.any_due(now_us) or self._session_expiry.any_due(now_us)

    def expire(self, now_us: int, max_count: int, *, applied_index: int | None = None) -> tuple[int, int]:
        """Remove what ended at or before ``now_us``, earliest first, at most ``max_count`` of each kind.

        Retained messages whose expiry ran out, and the sessions (state,
        proxy subscriptions, read positions) of clients offline for longer
        than their session expiry interval. Applied from the log with the
        leader's ``now_us``, so every replica removes the same ones. Returns
        (retained messages, sessions) removed.
        """
        meta = self._meta.handle
        batch = WriteBatch(raw_mode=True)
        retained = self._retained_expiry.due(now_us, max_count)
        for index_key, topic in retained:
            batch.delete(index_key, meta)
            batch.delete(keys.retained_key(topic), meta)
        sessions = self._session_expiry.due(now_us, max_count)
        for index_key, clientid in sessions:
            batch.delete(index_key, meta)
            batch.delete(keys.client_key(clientid), meta)
            self._delete_session_keys(batch, clientid)
        deleted = batch.len()
        self._commit(batch, applied_index)
        if deleted:
            self._deleted(deleted)
        return len(retained), len(sessions)

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
            batch.put(key, position.SerializeToString(deterministic=True), self._meta.handle)
        self._commit(batch, applied_index)

    def ack_queue(
        self,
        timestamp_us: int,
        topic_filter: str,
        *,
        applied_index: int | None = None,
        delivery_key: bytes | None = None,
    ) -> None:
        """Remove the message stored in this shard at ``timestamp_us`` for every queue reader.

        Also moves the filter's queue floor over the acknowledged messages at
        the head of the queue (at most ``_FLOOR_STEPS`` per call): reads of
        this replica's own state, the same on every replica at this log index.
        ``delivery_key``: the acknowledging reader's delivery of the message
        (``deliveries.py``), ended in the same write.
        """
        batch = WriteBatch(raw_mode=True)
        batch.put(keys.queue_ack_key(timestamp_us), b"", self._meta.handle)
        if delivery_key is not None:
            batch.delete(delivery_key, self._meta.handle)
        floor = self.queue_floor(topic_filter)
        if timestamp_us > floor:
            moved = floor
            for steps, (ts, _) in enumerate(self._ordered(topic_filter, floor + 1)):
                if steps == _FLOOR_STEPS or (ts != timestamp_us and self._get(keys.queue_ack_key(ts)) is None):
                    break
                moved = ts
            if moved != floor:
                batch.put(keys.queue_floor_key(topic_filter), keys.u64(moved), self._meta.handle)
        self._commit(batch, applied_index)

    def forget_position(self, clientid: str, topic_filter: str, *, applied_index: int | None = None) -> bool:
        key = keys.position_key(clientid, topic_filter)
        existed = self._get(key) is not None
        batch = WriteBatch(raw_mode=True)
        if existed:
            batch.delete(key, self._meta.handle)
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
                self._meta.handle,
            )
        self._commit(batch, applied_index)
        return started, position

    def forget_session(self, clientid: str, *, applied_index: int | None = None) -> tuple[int, int]:
        """Delete a client's subscriptions and read positions: (subscriptions, read positions) deleted."""
        batch = WriteBatch(raw_mode=True)
        counts = self._delete_session_keys(batch, clientid)
        self._commit(batch, applied_index)
        return counts

    def _delete_session_keys(self, batch: WriteBatch, clientid: str) -> tuple[int, int]:
        counts = []
        for prefix in (keys.subscriptions_prefix(clientid), keys.positions_prefix(clientid)):
            found = [key for key, _ in self._meta.scan(prefix)]
            for key in found:
                batch.delete(key, self._meta.handle)
            counts.append(len(found))
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
        return [key[len(prefix) :].decode("utf-8") for key, _ in self._meta.scan(prefix)]

    def subscriptions(self, clientid: str) -> list[tuple[str, int]]:
        prefix = keys.subscriptions_prefix(clientid)
        return [(key[len(prefix) :].decode("utf-8"), value[0]) for key, value in self._meta.scan(prefix)]

    def retained(self, filter_levels: list[str], now_us: int) -> list[bytes]:
        """The retained messages (serialised ``mqds.v1.Message``) whose topics match, by topic.

        One whose expiry (``message_expiry_s`` after it was retained) is at
        or before ``now_us`` is left out, removed or not yet.
        """
        literal: list[str] = []
        for level in filter_levels:
            if level in ("+", "#"):
                break
            literal.append(level)
        # "a/b/#" also matches "a/b" itself: scan from the literal levels
        # without a trailing separator and check every candidate.
        prefix = keys.retained_key("/".join(literal))
        start = len(keys.RETAINED_PREFIX)
        expired = self._expired_topics(now_us)
        out = []
        for key, value in self._meta.scan(prefix):
            topic = key[start:].decode("utf-8")
            if topic not in expired and matches_levels(filter_levels, topic.split("/")):
                out.append(value)
        return out

    def _expired_topics(self, now_us: int) -> set[str]:
        """Topics whose retained message expired at or before ``now_us`` and is not removed yet (a few at most:
        the leader removes them each maintenance round)."""
        return {topic for _, topic in self._retained_expiry.due(now_us)}

    def read_position(self, clientid: str, topic_filter: str) -> spb.ReadPosition | None:
        raw = self._get(keys.position_key(clientid, topic_filter))
        return None if raw is None else spb.ReadPosition.FromString(raw)

    def queue_floor(self, topic_filter: str) -> int:
        """The timestamp up to which every message of this shard matching ``topic_filter`` was queue-acknowledged."""
        raw = self._get(keys.queue_floor_key(topic_filter))
        return 0 if raw is None else keys.read_u64(raw)

    def fetch(self, wanted: FetchFilter, *, now_us: int = 0) -> list[tuple[int, bytes]]:
        """Up to ``max_count`` stored messages (and ``max_bytes``) that pass ``wanted``, oldest first.

        Each is (timestamp, stored bytes). A queue fetch starts after the filter's queue floor, so acknowledged
        messages at the head of a queue are not scanned again and again. With ``now_us``, a message whose
        Message Expiry Interval ended by then is left out and one whose interval runs has what is left of it
        (``expiry.message_left``); 0: every message as stored.
        """
        return self.fetch_shared([wanted], wanted.max_bytes, now_us=now_us).found

    def fetch_shared(
        self, wanted: Sequence[FetchFilter], max_bytes: int | None = None, *, ref_bytes: int = 0, now_us: int = 0
    ) -> SharedScan:
        """``fetch`` for several fetches of one topic filter at once, in one scan of the shard.

        The scan starts at the lowest position (``after_us``, ``since_us``, the queue floor for queue fetches)
        and each message goes to every fetch it passes that is not full yet, so fetch *i* gets exactly what
        ``fetch(wanted[i])`` returns without a byte budget. It stops when every fetch has its ``max_count``,
        at the end of the data, or before the message that would take the bytes found past ``max_bytes``
        (one message at least): each message counts its stored bytes plus ``ref_bytes`` per fetch that takes
        it (what an answer spends to say whose it is). ``max_bytes`` of the fetches themselves is not used.
        ``now_us`` as for ``fetch``: an expired message is passed over like an acknowledged one.
        """
        if not wanted:
            return SharedScan([], [], False)
        topic_filter = wanted[0].topic_filter
        if any(w.topic_filter != topic_filter for w in wanted):
            raise ValueError("a shared fetch reads one topic filter")
        floor = self.queue_floor(topic_filter) if any(w.skip_acked for w in wanted) else 0
        starts = sorted(
            (max((max(w.after_us, floor) if w.skip_acked else w.after_us) + 1, w.since_us), i)
            for i, w in enumerate(wanted)
            if w.max_count > 0
        )
        taken: list[list[int]] = [[] for _ in wanted]
        found: list[tuple[int, bytes]] = []
        if not starts:
            return SharedScan(found, taken, False)
        cut = False
        scanned = 0
        # The fetches that started and are not full, by kind (include_qos0, skip_acked): a message's QoS and
        # queue mark are looked at once, whatever the number of fetches it goes to.
        by_kind: dict[tuple[bool, bool], list[int]] = {}
        kinds: list[tuple[bool, bool, list[int]]] = []
        following = 0  # starts[following:] have not begun
        open_fetches = len(starts)
        size = 0
        for ts, stored in self._ordered(topic_filter, starts[0][0]):
            scanned += 1
            while following < len(starts) and starts[following][0] <= ts:
                index = starts[following][1]
                kind = (wanted[index].include_qos0, wanted[index].skip_acked)
                members = by_kind.get(kind)
                if members is None:
                    members = by_kind[kind] = []
                    kinds.append((*kind, members))
                members.append(index)
                following += 1
            takers: list[list[int]] = []
            qos0: bool | None = None
            acked: bool | None = None
            for include_qos0, skip_acked, members in kinds:
                if not members:
                    continue
                if not include_qos0:
                    if qos0 is None:
                        qos0 = _qos(stored) == 0
                    if qos0:
                        continue
                if skip_acked:
                    if acked is None:
                        acked = self._get(keys.queue_ack_key(ts)) is not None
                    if acked:
                        continue
                takers.append(members)
            if not takers:
                continue
            if now_us:
                left = message_left(ts, stored, now_us)
                if left is None:
                    continue
                stored = left
            size += len(stored) + ref_bytes * sum(len(members) for members in takers)
            if max_bytes is not None and found and size > max_bytes:
                cut = True
                break
            position = len(found)
            found.append((ts, stored))
            for members in takers:
                full = False
                for index in members:
                    mine = taken[index]
                    mine.append(position)
                    if len(mine) == wanted[index].max_count:
                        full = True
                        open_fetches -= 1
                if full:
                    members[:] = [i for i in members if len(taken[i]) < wanted[i].max_count]
            if open_fetches == 0:
                break
        with self._counted:
            self.fetch_scans += 1
            self.fetch_scanned += scanned
        return SharedScan(found, taken, cut)

    def _ordered(self, topic_filter: str, start_us: int) -> Iterator[tuple[int, bytes]]:
        return self._read_ordered(topic_filter, start_us)


_parse: Callable[[bytes], pb.Message] = pb.Message.FromString


def _qos(stored: bytes) -> int:
    return int(_parse(stored).qos)
