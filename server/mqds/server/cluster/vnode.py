"""A vnode replica's state machine: Raft log entries in, RocksDB storage out.

``apply`` is the only way data changes, and it is deterministic: every input
(the leader's clock, the messages, the generation numbers) is in the logged
command, so every replica builds byte-identical RocksDB content, and the
applied log index is written in the same write batch as the change. Entries
at or below the applied index are skipped, which makes replaying the journal
after a restart (or after installing a snapshot) idempotent.

A follower too far behind installs a snapshot: a RocksDB checkpoint fetched
from a replica that has applied at least up to the manifest's index, written
beside the shard, then swapped in while no reader holds the old database.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from mqds.protocol import errors
from mqds.protocol.delivery import Policy
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.cluster.catchup import CatchUp
from mqds.server.cluster.feed import ShardFeed
from mqds.server.cluster.proposed_stores import ProposedStores
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.raft.journal import fsync_dir
from mqds.server.storage import Engine, GenerationInfo, ShardStorage, StorePart
from mqds.server.storage.deletes import Cursor, DeleteSpec, StepResult
from mqds.server.storage.deliveries import Delivered, DeliverStep
from mqds.server.storage.expiry import NEVER
from mqds.server.storage.retention import policy_of
from mqds.server.storage.share_groups import MAX_MEMBERS
from mqds.server.wire import FOLLOW_RESPONSE_MESSAGES_TAG
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

if TYPE_CHECKING:
    from mqds.server.raft.group import RaftGroup

log = logging.getLogger(__name__)

# fetch(node_id, shard, min_index, dest_dir) -> applied index of the copy
SnapshotFetcher = Callable[[str, int, int, str], int]


class VnodeReplica:
    """One shard's storage on this node, fed by its Raft group."""

    def __init__(
        self,
        shard: int,
        path: str,
        engine: Engine,
        *,
        node_id: str,
        fetch_snapshot: SnapshotFetcher,
        lts_threshold_top: int,
        lts_threshold: int,
        feed_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self.shard = shard
        self.path = path
        self.node_id = node_id
        self._engine = engine
        self._fetch = fetch_snapshot
        self._lts = (lts_threshold_top, lts_threshold)
        self._cond = threading.Condition()
        self._readers = 0
        self._swapping = False
        self.stopping = threading.Event()
        self.storage = self._open()
        self.feed = ShardFeed(shard, feed_bytes)
        """What this replica just stored, for push subscriptions (``feed.py``)."""
        self.catchup = CatchUp(shard, feed_bytes, FOLLOW_RESPONSE_MESSAGES_TAG)
        """Push subscribers' recent disk reads, shared by those at nearby positions (``catchup.py``)."""
        # For the metrics, counted per applied batch (never per message) by
        # the group's cycle, the only place that applies: plain ints suffice.
        self.stored_messages = 0
        """Messages this replica stored since it was opened (a retry the dedup memory recognised stores none)."""
        self.stored_bytes = 0
        """Bytes of the store commands behind ``stored_messages``, as logged (messages encoded in protobuf)."""
        self.proposed = ProposedStores()
        """Store commands proposed here, as their proposer parsed them (``proposed_stores.py``)."""

    def _open(self) -> ShardStorage:
        return ShardStorage(
            self.path, self.shard, self._engine, lts_threshold_top=self._lts[0], lts_threshold=self._lts[1]
        )

    def close(self) -> None:
        self.stopping.set()
        with self._cond:
            self._swapping = True
            while self._readers:
                self._cond.wait()
            self.storage.close()

    @contextlib.contextmanager
    def reading(self) -> Iterator[ShardStorage]:
        """The storage, guaranteed open (not being swapped or closed) while the block runs."""
        with self._cond:
            while self._swapping:
                if self.stopping.is_set():
                    raise errors.error(Reason.SHUTTING_DOWN, f"replica of shard {self.shard} is closing")
                self._cond.wait(1.0)
            self._readers += 1
            storage = self.storage
        try:
            yield storage
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @property
    def swap_waiting(self) -> bool:
        """A snapshot is being swapped in, or the replica closed: it waits for the readers to let go."""
        return self._swapping

    # -- the state machine -----------------------------------------------------

    @property
    def applied_index(self) -> int:
        return self.storage.applied_index

    def expect_store(self, body: bytes, part: StorePart) -> None:
        """``body``, a store command about to be proposed to this replica's group, parses as ``part``: applying it
        here takes that instead of parsing it again (``proposed_stores.py``)."""
        self.proposed.remember(body, part)

    def unexpect_store(self, body: bytes) -> None:
        """``body`` was refused before it was logged."""
        self.proposed.forget(body)

    def apply(self, command: bytes, index: int) -> Any:
        if index <= self.storage.applied_index:
            return None
        part = self.proposed.take(command)
        if part is not None:
            (result,) = self._apply_stores([part], [command], index)
            return result
        return self._apply_one(cpb.VnodeCommand.FromString(command), command, index)

    def apply_batch(self, bodies: list[bytes], index: int) -> list[Any]:
        """Apply the commands of a group-committed entry in order; each one's result (or MqdsError).

        Consecutive stores are written as one RocksDB write batch; any other
        command is a write of its own (a session change reads what the ones
        before it wrote). An entry of several writes records each written
        part (``ShardStorage.begin_part``) and the applied index with its
        last, so replaying it after a crash applies each part once.
        """
        storage = self.storage
        if index <= storage.applied_index:
            return [None] * len(bodies)
        commands = [self._command(body) for body in bodies]
        parts: list[list[int]] = []
        for i, cmd in enumerate(commands):
            if parts and _is_store(cmd) and _is_store(commands[parts[-1][-1]]):
                parts[-1].append(i)
            else:
                parts.append([i])
        done = storage.applied_part(index) if len(parts) > 1 else -1
        results: list[Any] = [None] * len(bodies)
        for k, part in enumerate(parts):
            if k <= done:
                continue  # written before a crash
            last = k == len(parts) - 1
            storage.begin_part(index, None if last else k)
            applied = index if last else None
            try:
                first = commands[part[0]]
                if first is None:
                    raise ValueError("not a VnodeCommand")
                if _is_store(first):
                    # A run of stores holds parsed commands only (``_is_store``).
                    stores = cast("list[cpb.VnodeCommand | StorePart]", [commands[i] for i in part])
                    stored = self._apply_stores(stores, [bodies[i] for i in part], applied)
                    for i, result in zip(part, stored, strict=True):
                        results[i] = result
                else:
                    assert isinstance(first, cpb.VnodeCommand)  # a store is a StorePart or a VnodeCommand
                    results[part[0]] = self._apply_one(first, bodies[part[0]], applied)
            except MqdsError as err:
                if err.reason is Reason.STORAGE_ERROR:
                    raise
                for i in part:
                    results[i] = err
            except (OSError, MemoryError):
                raise
            except Exception as err:  # this command's own failure, the same on every replica
                log.error("shard %d: command %d of log entry %d failed", self.shard, part[0], index, exc_info=err)
                failure = errors.error(Reason.INTERNAL, f"shard {self.shard}: log entry {index} could not be applied")
                for i in part:
                    results[i] = failure
            finally:
                storage.begin_part(index, None)
        if index > storage.applied_index:  # the last part wrote nothing (it failed, or changed nothing)
            storage.record_applied(index)
        return results

    def _command(self, body: bytes) -> cpb.VnodeCommand | StorePart | None:
        """A command of a batch entry: a store proposed here as its proposer parsed it, or parsed (None: not one)."""
        part = self.proposed.take(body)
        return part if part is not None else _parse(body)

    def _apply_stores(
        self, commands: list[cpb.VnodeCommand | StorePart], bodies: list[bytes], applied: int | None
    ) -> list[Any]:
        """Store the messages of several store commands in one write; each one's first timestamp or refusal."""
        storage = self.storage
        if storage.restoring:
            if applied is not None:
                storage.record_applied(applied)
            return [self._restoring()] * len(commands)
        if not storage.initialized:
            first = commands[0]
            storage.initialize(first.now_us if isinstance(first, StorePart) else first.store.now_us)
        parts = [
            cmd if isinstance(cmd, StorePart) else _store_part(cmd, body)
            for cmd, body in zip(commands, bodies, strict=True)
        ]
        before = storage.last_ts
        results = storage.store_many(parts, applied_index=applied)
        counted: set[int] = set()
        for part, body, result in zip(parts, bodies, results, strict=True):
            # Stored now, not a retry answered from the dedup memory (an
            # earlier entry's positions, or an earlier part's of this one).
            if isinstance(result, int) and result > before and result not in counted:
                counted.add(result)
                self.stored_messages += len(part.messages)
                self.stored_bytes += len(body)
                assert part.encoded is not None
                self.feed.append(result, part.messages, part.encoded)
        return list(results)

    def _apply_one(self, cmd: cpb.VnodeCommand, command: bytes, index: int | None) -> Any:
        """Apply one command; ``index`` is recorded as applied with its write (None: a part of an entry)."""
        storage = self.storage
        kind = cmd.WhichOneof("kind")
        if storage.restoring and kind not in ("import_shard", "store"):
            if index is not None:
                storage.record_applied(index)
            return self._restoring()
        if kind == "store":
            (result,) = self._apply_stores([cmd], [command], index)
            return result  # a reused sequence number is refused alike everywhere
        if kind == "add_generation":
            add = cmd.add_generation
            if not storage.initialized:
                return storage.initialize(add.now_us, applied_index=index)
            if add.if_current != storage.current_generation:
                # Logged against another generation (a duplicate, or a second
                # initialisation): the rotation already happened.
                return storage.generations()[-1]
            return storage.add_generation(add.now_us, applied_index=index)
        if kind == "drop_generation":
            try:
                dropped = storage.drop_generation(cmd.drop_generation.generation, applied_index=index)
                self.catchup.reset()
                return dropped
            except MqdsError as err:
                if err.reason is Reason.STORAGE_ERROR:
                    raise
                # A refusal (current generation, already dropped) is the same
                # on every replica and changes nothing: the proposer gets it.
                return err
        if kind == "session":
            return self._apply_session(cmd.session, index)
        if kind == "delete_messages":
            return self._apply_delete(cmd.delete_messages, index)
        if kind == "apply_retention":
            return self._apply_retention(cmd.apply_retention, index)
        if kind == "import_shard":
            return self._apply_import(cmd.import_shard, index)
        if kind == "trim_messages":
            return self._apply_trim(cmd.trim_messages, index)
        if kind == "expire_messages":
            return self._apply_expire_messages(cmd.expire_messages, index)
        raise errors.error(Reason.INTERNAL, f"shard {self.shard}: a log entry holds an unknown command")

    def _restoring(self) -> MqdsError:
        """The refusal of a command while a restore runs (the same on every replica: the mark is in the log)."""
        return errors.error(
            Reason.SHARD_RESTORING,
            f"shard {self.shard} is being restored from a backup and takes no other write; retry once the "
            "restore has finished or been abandoned",
        )

    def _apply_import(self, cmd: pb.ImportShardRequest, index: int | None) -> Any:
        """A step of a restore (``storage/restore.py``), checked by the leader that logged it.

        Whether the step is taken depends on the shard's restore mode, which
        is in its database: every replica decides alike. Push subscribers and
        shared catch-up reads start again from what the shard holds after a
        ``begin``, ``finish`` or ``abandon`` that was taken.
        """
        storage = self.storage
        step = cmd.WhichOneof("kind")
        if step == "records":
            r = cmd.records
            return storage.restore_records(r.column_family, r.keys, r.values, applied_index=index)
        if step == "begin":
            result: Any = storage.restore_begin(applied_index=index)
        elif step == "finish":
            result = storage.restore_finish(cmd.finish.last_ts, applied_index=index)
        elif step == "abandon":
            result = storage.restore_abandon(applied_index=index)
        else:
            raise errors.error(Reason.INVALID_REQUEST, f"shard {self.shard}: an import step of no known kind")
        if not isinstance(result, MqdsError):
            self.feed.reset(storage.last_ts)
            self.catchup.reset()
        return result

    def _apply_retention(self, cmd: cpb.ApplyRetention, index: int | None) -> StepResult:
        """One step of a retention pass, with the policy the leader logged."""
        policy = policy_of(cmd.policy)
        return self._apply_deletes(
            cmd.cursor if cmd.HasField("cursor") else None,
            cmd.now_us,
            lambda storage, cursor: storage.apply_retention(
                policy, cmd.now_us, cmd.after_us, cursor, max(1, cmd.max_keys), applied_index=index
            ),
            index,
        )

    def _apply_trim(self, cmd: cpb.TrimMessages, index: int | None) -> StepResult:
        """Messages the leader found over a retention rule's limits (``storage/limits.py``): those still here go."""
        return self._apply_deletes(
            None, 0, lambda storage, _: storage.trim_messages(cmd.streams, applied_index=index), index
        )

    def _apply_expire_messages(self, cmd: cpb.ExpireMessages, index: int | None) -> StepResult:
        """Stored messages whose Message Expiry Interval ended by the leader's clock (``storage/expiry.py``)."""
        return self._apply_deletes(
            None,
            0,
            lambda storage, _: storage.expire_messages(cmd.now_us, max(1, cmd.max_count), applied_index=index),
            index,
        )

    def _apply_delete(self, cmd: cpb.DeleteMessages, index: int | None) -> StepResult:
        """One step of a delete."""
        spec = DeleteSpec(cmd.topic_filter, cmd.sender, cmd.since_us, cmd.until_us)
        return self._apply_deletes(
            cmd.cursor if cmd.HasField("cursor") else None,
            cmd.until_us,
            lambda storage, cursor: storage.delete_messages(spec, cursor, max(1, cmd.max_keys), applied_index=index),
            index,
        )

    def _apply_deletes(
        self,
        cursor: pb.DeleteCursor | None,
        until_us: int,
        step: Callable[[ShardStorage, Cursor | None], StepResult],
        index: int | None,
    ) -> StepResult:
        """A delete, retention or trim step from the command's cursor; push subscribers and shared catch-up reads
        see its messages gone at once (the feed's ring and the catch-up segments may hold them)."""
        storage = self.storage
        if not storage.initialized:
            if index is not None:
                storage.record_applied(index)
            return StepResult(until_us=until_us)
        result = step(storage, None if cursor is None else Cursor.of(cursor))
        if result.messages:
            self.feed.reset(storage.last_ts)
            self.catchup.reset()
        return result

    def skip(self, index: int) -> None:
        """An entry that changed nothing in this shard: its index is recorded all the same."""
        self.storage.record_applied(index)

    def _apply_session(self, cmd: cpb.SessionCommand, index: int | None) -> Any:
        """A broker-state change (the leader checked its fields); its result goes to the proposer."""
        sessions = self.storage.sessions
        now = cmd.now_us
        kind = cmd.WhichOneof("kind")
        if kind == "connected":
            c = cmd.connected
            # The leader logs the interval (its default for a client that reported none); an entry logged
            # before sessions could expire has none: such a session never expires, as then.
            expiry = c.session_expiry_s if c.HasField("session_expiry_s") else NEVER
            return sessions.client_connected(c.clientid, c.node, now, expiry, applied_index=index)
        if kind == "disconnected":
            d = cmd.disconnected
            new_expiry = d.session_expiry_s if d.HasField("session_expiry_s") else None
            return sessions.client_disconnected(d.clientid, d.node, now, new_expiry, applied_index=index)
        if kind == "subscribe":
            sub = cmd.subscribe
            return sessions.subscribe(sub.clientid, sub.topic_filter, sub.qos, applied_index=index)
        if kind == "unsubscribe":
            return sessions.unsubscribe(cmd.unsubscribe.clientid, cmd.unsubscribe.topic_filter, applied_index=index)
        if kind == "retain":
            return sessions.retain(cmd.retain, now, applied_index=index)
        if kind == "ack":
            ack = cmd.ack
            deliveries = self.storage.deliveries
            if ack.mode == spb.QUEUE:
                delivery = deliveries.key(ack.clientid, ack.topic_filter, ack.timestamp_us)
                return sessions.ack_queue(
                    ack.timestamp_us, ack.topic_filter, applied_index=index, delivery_key=delivery
                )
            if ack.mode == spb.DELIVERY:
                return deliveries.ack(ack.clientid, ack.topic_filter, ack.timestamp_us, applied_index=index)
            if ack.mode in (spb.NACK, spb.RELEASE):
                return deliveries.nack(
                    ack.clientid,
                    ack.topic_filter,
                    ack.timestamp_us,
                    now,
                    applied_index=index,
                    uncount=ack.mode == spb.RELEASE,
                )
            return sessions.ack_pubsub(ack.clientid, ack.topic_filter, ack.shard, ack.timestamp_us, applied_index=index)
        if kind == "forget_position":
            f = cmd.forget_position
            return sessions.forget_position(f.clientid, f.topic_filter, applied_index=index)
        if kind == "start_position":
            start = cmd.start_position
            return sessions.start_position(start.clientid, start.topic_filter, now, applied_index=index)
        if kind == "forget_session":
            return sessions.forget_session(cmd.forget_session.clientid, applied_index=index)
        if kind == "expire":
            return sessions.expire(now, cmd.expire.max_count, applied_index=index)
        if kind == "share_join":
            j = cmd.share_join
            groups = self.storage.share_groups
            members = groups.join(j.group, j.topic_filter, j.member, j.lease_s, now, applied_index=index)
            if members is None:
                return errors.error(
                    Reason.INVALID_REQUEST,
                    f"share group {j.group!r} of {j.topic_filter!r} has {MAX_MEMBERS} members, the most it may have",
                )
            return members
        if kind == "share_leave":
            lv = cmd.share_leave
            return self.storage.share_groups.leave(lv.group, lv.topic_filter, lv.member, now, applied_index=index)
        if kind == "deliver":
            return self._apply_deliver(cmd.deliver, now, index)
        raise errors.error(Reason.INTERNAL, f"shard {self.shard}: a log entry holds an unknown session command")

    def _apply_deliver(self, cmd: cpb.Deliver, now_us: int, index: int | None) -> Delivered:
        """A consumer's delivery step (``storage/deliveries.py``); the dead letters it stored go to the feed."""
        r, p = cmd.request, cmd.request.policy
        policy = Policy(p.ack_wait_ms, p.max_deliveries, tuple(p.backoff_ms), p.max_unacked, p.dead_letter_topic)
        step = DeliverStep(
            r.clientid,
            r.topic_filter,
            policy,
            r.max_count,
            cmd.max_bytes or None,
            r.queue,
            r.include_qos0,
            r.start_after_us,
            cmd.strict_bytes,
        )
        result = self.storage.deliveries.deliver(step, now_us, applied_index=index)
        if result.dead_letters:
            parsed = [pb.Message.FromString(m) for m in result.dead_letters]
            self.stored_messages += len(parsed)
            self.feed.append(result.dead_first_ts, parsed, result.dead_letters)
        return result

    def snapshot(self) -> bytes:
        self.storage.sync_wal()
        return b""

    def install(self, payload: bytes, index: int, source: str, members: list[str]) -> None:
        candidates = [source] + [m for m in members if m not in (source, self.node_id)]
        incoming = self.path + ".incoming"
        backoff = 0.2
        while not self.stopping.is_set():
            for node in candidates:
                if node == self.node_id or self.stopping.is_set():
                    continue
                shutil.rmtree(incoming, ignore_errors=True)
                try:
                    started = time.monotonic()
                    applied = self._fetch(node, self.shard, index, incoming)
                except Exception as err:
                    log.warning("shard %d: snapshot from %s failed: %s", self.shard, node, err)
                    continue
                self._swap(incoming)
                log.info(
                    "shard %d: installed snapshot from %s at index %d in %.1fs",
                    self.shard,
                    node,
                    applied,
                    time.monotonic() - started,
                )
                return
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
        raise errors.error(Reason.SHUTTING_DOWN, f"shard {self.shard}: stopped while installing a snapshot")

    def _swap(self, incoming: str) -> None:
        old = self.path + ".old"
        with self._cond:
            self._swapping = True
            while self._readers:
                self._cond.wait()
            try:
                self.storage.close()
                shutil.rmtree(old, ignore_errors=True)
                os.replace(self.path, old)
                os.replace(incoming, self.path)
                fsync_dir(os.path.dirname(self.path))
                self.storage = self._open()
                self.feed.reset(self.storage.last_ts)
                self.catchup.reset()
            finally:
                self._swapping = False
                self._cond.notify_all()
        shutil.rmtree(old, ignore_errors=True)

    # -- reads used by the node ------------------------------------------------

    def generations(self) -> list[GenerationInfo]:
        with self.reading() as storage:
            return storage.generations()


def _parse(body: bytes) -> cpb.VnodeCommand | None:
    """A command of a batch entry, or None when its bytes are not one (that command alone fails)."""
    try:
        return cpb.VnodeCommand.FromString(body)
    except Exception:  # DecodeError, or a RuntimeError from upb
        return None


def _is_store(cmd: cpb.VnodeCommand | StorePart | None) -> bool:
    return isinstance(cmd, StorePart) or (cmd is not None and cmd.HasField("store"))


def _store_part(cmd: cpb.VnodeCommand, body: bytes) -> StorePart:
    """A parsed store command as the storage takes it; its messages' bytes as logged, parsed from ``body`` again."""
    store = cmd.store
    return StorePart(
        store.messages,
        store.now_us,
        (store.producer_id.encode(), store.sequence) if store.producer_id else None,
        cpb.VnodeCommandEncoded.FromString(body).store.messages,
    )


@dataclass
class Vnode:
    """A vnode replica hosted on a node: its storage and its Raft group."""

    shard: int
    replica: VnodeReplica
    group: RaftGroup
