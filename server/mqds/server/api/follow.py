"""Storage.Follow: push subscriptions, many on one call, each a topic filter on one shard from a position.

A reader thread takes the client's requests (start, credit, cancel) off the
call; the call's own thread serves the subscriptions in turn, one answer per
subscription and pass, and sleeps when none has anything to send until a
replica stores something (the shard's feed wakes it), a request comes, or a
second passes. An answer holds what the subscription's credit allows (and
``follow_max_batch``, and ``max_answer_bytes``): its messages in timestamp
order and the position they reach. The position is the shard's timestamp
read up to, so a subscription started again from it, here or on another
replica, continues exactly: nothing lost, nothing repeated.

Where the messages come from: the replica's feed (``cluster/feed.py``) when
the position is within what the feed holds, else RocksDB (``storage/ordered.py``)
up to the shard's last timestamp, after which the feed takes over. Disk reads
go through the replica's shared catch-up reads (``cluster/catchup.py``), so
subscribers of one filter at nearby positions share one read. A
subscription without credit is skipped and holds nothing; when credit comes
it goes on from its position, from disk if the feed moved past it.

Errors. A request that breaks the protocol (a frame that does not parse, an
id in use or unknown, zero credit, more than ``follow_max_subscriptions``)
ends the call with INVALID_ARGUMENT. A subscription that cannot be served
(a bad topic filter, a position in the future, a shard this node does not
host or, without ``stale_ok``, does not lead, a position whose messages were
dropped) is answered with ``failure`` and ends; the call goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.topics import TopicError, validate_filter
from mqds.server.api.handlers import check_parsed
from mqds.server.storage.ordered import dropped_after, ordered
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

_PROGRESS_S = 1.0
"""How often a subscription whose position moved without a matching message is told so, at most."""
_IDLE_WAKE_S = 1.0
"""How long the call sleeps without news before it looks again (a leader that lost its shard, progress)."""
_AHEAD_US = 86_400 * 1_000_000
"""A position this far past the node's clock is refused (no shard's clock is a day ahead)."""


@dataclass(frozen=True)
class FollowLimits:
    max_subscriptions: int = 10_000
    max_batch: int = 1_000


class _Vnode(Protocol):
    @property
    def replica(self) -> Any: ...

    @property
    def group(self) -> Any: ...


class _Shards(Protocol):
    @property
    def n_shards(self) -> int: ...

    def vnode(self, shard: int) -> _Vnode: ...


class _Sub:
    """One subscription on a call."""

    __slots__ = (
        "credit",
        "id",
        "levels",
        "listening",
        "position",
        "reported",
        "reported_at",
        "shard",
        "stale_ok",
        "start_us",
        "topic_filter",
    )

    def __init__(self, start: pb.FollowStart, levels: list[str]) -> None:
        self.id = start.id
        self.topic_filter = start.topic_filter
        self.levels = levels
        self.shard = start.shard
        self.position = start.after_us
        self.reported = start.after_us
        self.reported_at = time.monotonic()
        self.start_us = start.start_time_us
        self.credit = start.credit
        self.stale_ok = start.stale_ok
        self.listening: Any = None
        """The feed this subscription is registered with (a replica's)."""


class _Call:
    """The state of one Follow call, shared by its reader thread and the thread answering."""

    def __init__(self, shards: _Shards, limits: FollowLimits, max_answer_bytes: int | None, clock: Any) -> None:
        self.shards = shards
        self.limits = limits
        self.max_answer_bytes = max_answer_bytes
        self.clock = clock
        self.lock = threading.Lock()
        self.news = threading.Event()
        self.subs: dict[int, _Sub] = {}
        self.new: list[_Sub] = []
        self.gone: list[_Sub] = []
        self.ended: MqdsError | None = None
        self.closed = False
        self.stopped = threading.Event()
        self.by_feed: dict[Any, set[_Sub]] = {}
        """The feeds this call listens to, with its subscriptions that read each (the serving thread's)."""
        self.dirty: set[Any] = set()
        """Feeds that stored something since the last pass (under ``lock``)."""
        self.touched: set[_Sub] = set()
        """Subscriptions with news of their own: just started, credit came, more to read (under ``lock``)."""
        self._wakers: dict[Any, Any] = {}

    # -- requests (the reader thread) -------------------------------------------------

    def read(self, requests: Iterator[Any]) -> None:
        try:
            for raw in requests:
                if self.stopped.is_set():
                    return
                request: pb.FollowRequest = check_parsed(raw).parsed
                with self.lock:
                    self._take(request)
                self.news.set()
        except MqdsError as err:
            with self.lock:
                self.ended = err
        except Exception as err:  # the call was cancelled or broke: nothing more to read
            log.debug("Follow reader ends: %s", err)
        with self.lock:
            self.closed = True
        self.news.set()

    def _take(self, request: pb.FollowRequest) -> None:
        kind = request.WhichOneof("kind")
        if kind == "start":
            start = request.start
            if start.id in self.subs:
                raise errors.error(Reason.INVALID_REQUEST, f"subscription id {start.id} is already in use on this call")
            if len(self.subs) >= self.limits.max_subscriptions:
                raise errors.error(
                    Reason.INVALID_REQUEST,
                    f"this call already carries {len(self.subs):,} subscriptions (follow_max_subscriptions); "
                    "open another call",
                )
            if start.credit < 1:
                raise errors.error(
                    Reason.INVALID_REQUEST,
                    f"subscription {start.id} starts with credit {start.credit}: grant at least 1 message",
                )
            sub = _Sub(start, [])
            self.subs[start.id] = sub
            self.new.append(sub)
        elif kind == "credit":
            credit = request.credit
            known = self.subs.get(credit.id)
            if credit.messages < 1:
                raise errors.error(
                    Reason.INVALID_REQUEST, f"credit of {credit.messages} for subscription {credit.id}: at least 1"
                )
            if known is not None:  # one that just ended is not an error: the client could not know
                known.credit = min(known.credit + credit.messages, 1 << 32)
                self.touched.add(known)
        elif kind == "cancel":
            cancelled = self.subs.pop(request.cancel, None)
            if cancelled is not None:
                self.gone.append(cancelled)
        else:
            raise errors.error(Reason.INVALID_REQUEST, "a Follow request must start, credit or cancel a subscription")

    # -- answers (the call's thread) --------------------------------------------------

    def serve(self) -> Iterator[bytes]:
        full_pass_at = 0.0
        while True:
            self.news.clear()
            failures: list[bytes] = []
            with self.lock:
                if self.ended is not None:
                    raise self.ended
                if self.closed:
                    return
                for sub in self.new:
                    failure = self._check_start(sub)
                    if failure is not None:
                        self.subs.pop(sub.id, None)
                        failures.append(failure)
                    else:
                        self.touched.add(sub)
                self.new.clear()
                gone, self.gone = self.gone, []
                now = time.monotonic()
                if now >= full_pass_at:  # every subscription now and then: progress, a lost lead
                    full_pass_at = now + _IDLE_WAKE_S
                    due = list(self.subs.values())
                    self.dirty.clear()
                else:  # those with news: their shard stored something, credit came, more to read
                    due = [sub for feed in self.dirty for sub in self.by_feed.get(feed, ())]
                    due += [sub for sub in self.touched if sub.id in self.subs]
                    self.dirty.clear()
                self.touched = set()
            yield from failures
            for sub in gone:
                self._unlisten(sub)
            sent = False
            for sub in dict.fromkeys(due):
                if sub.credit <= 0:  # nothing to send it: no reason to be woken by its shard
                    self._unlisten(sub)
                    continue
                answer = self._next(sub)
                if answer is not None:
                    sent = True
                    yield answer
                    if sub.credit > 0 and sub.id in self.subs:
                        with self.lock:
                            self.touched.add(sub)  # it may have more (a batch's worth, or from disk)
            if not sent:
                self.news.wait(max(0.0, min(_IDLE_WAKE_S, full_pass_at - time.monotonic())))

    def _check_start(self, sub: _Sub) -> bytes | None:
        """The failure answer of a subscription that cannot start, or None."""
        try:
            try:
                sub.levels = validate_filter(sub.topic_filter)
            except TopicError as err:
                raise errors.error(Reason.INVALID_TOPIC_FILTER, str(err)) from None
            n = self.shards.n_shards
            if not 0 <= sub.shard < n:
                raise errors.error(Reason.UNKNOWN_SHARD, f"shard {sub.shard} does not exist; shards are 0 to {n - 1}")
            limit = self.clock() + _AHEAD_US
            if sub.position > limit or sub.start_us > limit:
                raise errors.error(
                    Reason.INVALID_REQUEST,
                    f"subscription {sub.id}: position {max(sub.position, sub.start_us)} is more than a day after "
                    "this node's clock; start from a position an answer returned",
                )
        except MqdsError as err:
            return self._failure(sub, err)
        return None

    def _next(self, sub: _Sub) -> bytes | None:
        """The subscription's next answer (messages, progress or its end), or None when it has nothing new."""
        try:
            vnode = self.shards.vnode(sub.shard)
            if not sub.stale_ok and not vnode.group.is_leader:
                err = vnode.group.not_leader_error()
                err.metadata["shard"] = str(sub.shard)
                raise err
            replica = vnode.replica
            limit = min(sub.credit, self.limits.max_batch)
            with replica.reading() as storage:
                feed = replica.feed
                if sub.listening is not feed:
                    self._unlisten(sub)
                    self._listen(sub, feed, storage)
                got = feed.read_after(sub.position, sub.topic_filter, sub.levels, limit, self.max_answer_bytes)
                if got is None:
                    got = self._from_disk(sub, storage, replica.catchup, limit)
                    count = len(got[0])
                    feed.read_from_disk += count
                else:
                    count = len(got[0])
        except MqdsError as err:
            self._unlisten(sub)
            with self.lock:
                self.subs.pop(sub.id, None)
            return self._failure(sub, err)
        pieces, position = got
        sub.position = max(sub.position, position)
        now = time.monotonic()
        if not count and (sub.position == sub.reported or now - sub.reported_at < _PROGRESS_S):
            return None
        sub.credit -= count
        sub.reported, sub.reported_at = sub.position, now
        head = pb.FollowResponse(id=sub.id, shard=sub.shard, position_us=sub.position).SerializeToString()
        return head + b"".join(pieces)

    def _from_disk(self, sub: _Sub, storage: Any, catchup: Any, limit: int) -> tuple[list[bytes], int]:
        """Up to ``limit`` messages after the subscription's position from disk, encoded; the position reached.

        Through the replica's shared catch-up reads (``cluster/catchup.py``):
        subscribers of the filter at nearby positions share one read.
        """
        if sub.position > 0:
            dropped = dropped_after(storage, sub.position)
            if dropped is not None:
                raise errors.error(
                    Reason.GENERATION_DROPPED,
                    f"shard {sub.shard}: the messages stored between {dropped[0]} and {dropped[1]} (after this "
                    f"subscription's position {sub.position}) were dropped by retention; start again from a time",
                    shard=str(sub.shard),
                )
        fence = storage.last_ts
        if fence <= sub.position:
            return [], sub.position
        after = max(sub.position, sub.start_us - 1)
        if after >= fence:
            return [], fence
        budget = self.max_answer_bytes

        def load(after_us: int, count: int) -> tuple[list[tuple[int, bytes]], int]:
            found: list[tuple[int, bytes]] = []
            size = 0
            for ts, stored in ordered(storage, sub.topic_filter, after_us + 1, fence):
                if found and budget is not None and size + len(stored) > budget:
                    return found, found[-1][0]
                found.append((ts, stored))
                size += len(stored)
                if len(found) >= count:
                    return found, ts
            return found, fence

        return catchup.read(sub.topic_filter, after, limit, budget, load, self.limits.max_batch)

    def _failure(self, sub: _Sub, err: MqdsError) -> bytes:
        response = pb.FollowResponse(id=sub.id, shard=sub.shard, position_us=sub.position)
        response.failure.shard = sub.shard
        response.failure.reason = err.reason.value
        response.failure.message = err.message
        response.failure.metadata.update(err.metadata)
        return response.SerializeToString()

    def _listen(self, sub: _Sub, feed: Any, storage: Any) -> None:
        """Have ``feed`` wake this call (once for all its subscriptions on that feed), marking the feed dirty."""
        readers = self.by_feed.get(feed)
        if readers is None:
            readers = self.by_feed[feed] = set()

            def wake(feed: Any = feed) -> None:
                with self.lock:
                    self.dirty.add(feed)
                self.news.set()

            self._wakers[feed] = wake
            feed.listen(wake, lambda: storage.last_ts)
        readers.add(sub)
        sub.listening = feed

    def _unlisten(self, sub: _Sub) -> None:
        feed = sub.listening
        if feed is None:
            return
        sub.listening = None
        readers = self.by_feed.get(feed)
        if readers is None:
            return
        readers.discard(sub)
        if not readers:
            del self.by_feed[feed]
            feed.unlisten(self._wakers.pop(feed))

    def stop(self) -> None:
        self.stopped.set()
        with self.lock:
            subs = list(self.subs.values()) + self.gone
            self.subs.clear()
        for sub in subs:
            self._unlisten(sub)


def serve(
    shards: _Shards, requests: Iterator[Any], limits: FollowLimits, max_answer_bytes: int | None, clock: Any
) -> Iterator[bytes]:
    """Answer a Follow call: yields encoded FollowResponses until the client ends it (or breaks the protocol)."""
    call = _Call(shards, limits, max_answer_bytes, clock)
    reader = threading.Thread(target=call.read, args=(requests,), name="follow-reader", daemon=True)
    reader.start()
    try:
        yield from call.serve()
    finally:
        call.stop()
