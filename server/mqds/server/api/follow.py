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

Shared answers. Subscriptions that started with ``shared_answers`` and stand
at the same position of the same filter and shard (real-time subscribers of
a topic do, once they reach the head) are served by one read and one answer:
its ``also`` lists the other subscriptions it is for, and each of them takes
the messages from its own credit. So a call carrying a thousand such
subscribers costs the node one answer per new batch, not a thousand. One
whose credit is short of the answer is served on its own, from its position.

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
from typing import Any, NamedTuple, Protocol

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
        "shared",
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
        self.shared = start.shared_answers
        self.listening: Any = None
        """The feed this subscription is registered with (a replica's)."""


class _Read(NamedTuple):
    """What one read for a group of subscriptions found."""

    pieces: list[bytes]
    """The messages, each encoded as an answer carries it."""
    position: int
    feed: Any
    """The replica's feed (its counters count what was sent)."""
    from_feed: bool
    more: bool
    """Whether there may be more to read at once (else the feed wakes the call when there is)."""


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
            if credit.messages < 1:
                raise errors.error(
                    Reason.INVALID_REQUEST, f"credit of {credit.messages} for subscription {credit.id}: at least 1"
                )
            subs, touched, messages = self.subs, self.touched, credit.messages
            for sid in (credit.id, *credit.also):
                known = subs.get(sid)
                if known is None:  # one that just ended is not an error: the client could not know
                    continue
                if known.credit <= 0:  # it waited for credit: serve it (one with credit is served as news comes)
                    touched.add(known)
                known.credit = min(known.credit + messages, 1 << 32)
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
            groups: dict[Any, list[_Sub]] = {}
            for sub in dict.fromkeys(due):
                if sub.credit <= 0:  # nothing to send it: no reason to be woken by its shard
                    self._unlisten(sub)
                    continue
                key = (sub.shard, sub.topic_filter, sub.position, sub.start_us, sub.stale_ok) if sub.shared else sub
                groups.setdefault(key, []).append(sub)
            for group in groups.values():
                for answer, again in self._answers(group):
                    sent = True
                    yield answer
                    if again:
                        with self.lock:
                            self.touched.update(sub for sub in again if sub.credit > 0 and sub.id in self.subs)
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

    def _answers(self, group: list[_Sub]) -> list[tuple[bytes, list[_Sub]]]:
        """The next answers of subscriptions at one position of one filter and shard, each with those it is
        for that may have more to read at once (a batch's worth, or from disk).

        One read, with the most credit any of them has; those whose credit
        covers what it found share one answer (``also``), the others are
        served on their own. An answer holds messages, or only progress, or
        a subscription's end; nothing when there is no news.
        """
        lead = max(group, key=lambda sub: sub.credit) if len(group) > 1 else group[0]
        try:
            got = self._read(lead, group)
        except MqdsError as err:
            ended: list[tuple[bytes, list[_Sub]]] = []
            for sub in group:
                self._unlisten(sub)
                with self.lock:
                    self.subs.pop(sub.id, None)
                ended.append((self._failure(sub, err), []))
            return ended
        pieces, position = got.pieces, got.position
        count = len(pieces)
        now = time.monotonic()
        takers: list[_Sub] = []
        short: list[_Sub] = []
        with self.lock:  # the reader thread adds credit
            for sub in group:
                if sub.credit < count:
                    short.append(sub)
                    continue
                sub.position = max(sub.position, position)
                if not count and (sub.position == sub.reported or now - sub.reported_at < _PROGRESS_S):
                    continue
                sub.credit -= count
                sub.reported, sub.reported_at = sub.position, now
                takers.append(sub)
        answers = []
        if takers:
            first = takers[0]
            if got.from_feed:
                got.feed.read_from_ring += count * (len(takers) - 1)
            else:
                got.feed.read_from_disk += count * len(takers)
            head = pb.FollowResponse(id=first.id, shard=first.shard, position_us=first.position)
            if len(takers) > 1:
                head.also.extend(sub.id for sub in takers[1:])
            answers.append((head.SerializeToString() + b"".join(pieces), takers if got.more else []))
        for sub in short:  # less credit than the others had: from its position, within its own credit
            answers += self._answers([sub])
        return answers

    def _read(self, lead: _Sub, group: list[_Sub]) -> _Read:
        """What ``lead``'s credit allows after the group's position, from the feed, else from disk. Every
        subscription of the group listens to the replica's feed afterwards.
        """
        vnode = self.shards.vnode(lead.shard)
        if not lead.stale_ok and not vnode.group.is_leader:
            err = vnode.group.not_leader_error()
            err.metadata["shard"] = str(lead.shard)
            raise err
        replica = vnode.replica
        limit = min(lead.credit, self.limits.max_batch)
        with replica.reading() as storage:
            feed = replica.feed
            for sub in group:
                if sub.listening is not feed:
                    self._unlisten(sub)
                    self._listen(sub, feed, storage)
            got = feed.read_after(lead.position, lead.topic_filter, lead.levels, limit, self.max_answer_bytes)
            if got is not None:
                # Read up to the feed's head: nothing more until it stores again (and then it wakes the call).
                return _Read(got[0], got[1], feed, True, got[1] < feed.head)
            pieces, position = self._from_disk(lead, storage, replica.catchup, limit)
            return _Read(pieces, position, feed, False, True)

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
