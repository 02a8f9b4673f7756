"""Storage.Follow: push subscriptions, many on one call, each a topic filter on one shard from a position.

A reader thread takes the client's requests (start, credit, cancel) off the
call; the call's own thread serves the call's cohorts (``follow_cohort.py``)
in turn, one answer per cohort and pass, and sleeps when none has anything
to send until a replica stores something (the shard's feed wakes it), a
request comes, or a second passes. An answer holds what the cohort's credit
allows (and ``follow_max_batch``, and ``max_answer_bytes``): its messages in
timestamp order and the position they reach. The position is the shard's
timestamp read up to, so a subscription started again from it, here or on
another replica, continues exactly: nothing lost, nothing repeated.

Shared answers. Subscriptions that started with ``shared_answers`` and stand
at the same position of the same filter and shard (real-time subscribers of
a topic do, once they reach the head) are one cohort: one read, one answer,
whose ``also`` lists the other subscriptions it is for, each taking the
messages from its own credit. So a call carrying a thousand such
subscribers costs the node one answer per new batch, not a thousand. One
whose credit is short of an answer splits off and is served on its own from
its position; when it reaches the cohort's position again it rejoins.

Where the messages come from: the replica's feed (``cluster/feed.py``) when
the position is within what the feed holds, else RocksDB (``storage/ordered.py``)
up to the shard's last timestamp, after which the feed takes over. Disk reads
go through the replica's shared catch-up reads (``cluster/catchup.py``), so
subscribers of one filter at nearby positions share one read. A
subscription without credit is skipped and holds nothing; when credit comes
it goes on from its position, from disk if the feed moved past it.

A start may name more subscriptions (``FollowStart.also``): each id is a
subscription with the start's other fields, and with shared answers they
begin as one cohort, so starting ten thousand subscribers of a shard costs one
request, not ten thousand (``follow_start.py``).

Errors. A request that breaks the protocol (a frame that does not parse, an
id in use or named twice in one start, zero credit, more than
``follow_max_subscriptions``) ends the call with INVALID_ARGUMENT; credit for
or a cancel of an id the call does not carry (one that just ended) is not an
error. A subscription that cannot be served (a bad topic filter, a position
in the future, a shard this node does not host or, without ``stale_ok``, does
not lead, a position whose messages were dropped) is answered with
``failure`` and ends; the call goes on.
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
from mqds.server.api import follow_start
from mqds.server.api.follow_cohort import Cohort, FollowSub
from mqds.server.api.follow_registry import FollowCalls
from mqds.server.api.request_bounds import check_parsed
from mqds.server.storage.ordered import dropped_after, ordered
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

_PROGRESS_S = 1.0
"""How often a subscription whose position moved without a matching message is told so, at most."""
_IDLE_WAKE_S = 1.0
"""How long the call sleeps without news before it looks again (a leader that lost its shard, progress)."""


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


class _Read(NamedTuple):
    """What one read for a cohort found."""

    pieces: list[bytes]
    """The messages, each encoded as an answer carries it."""
    position: int
    feed: Any
    """The replica's feed (its counters count what was sent)."""
    from_feed: bool
    more: bool
    """Whether there may be more to read at once (else the feed wakes the call when there is)."""


_Answer = tuple[bytes, "Cohort | None"]
"""An answer, and the cohort to serve again at once (it may have more to read), if any."""


class _Call:
    """The state of one Follow call, shared by its reader thread and the thread answering."""

    def __init__(self, shards: _Shards, limits: FollowLimits, max_answer_bytes: int | None, clock: Any) -> None:
        self.shards = shards
        self.limits = limits
        self.max_answer_bytes = max_answer_bytes
        self.clock = clock
        self.lock = threading.Lock()
        self.news = threading.Event()
        self.subs: dict[int, FollowSub] = {}
        self.new: list[list[FollowSub]] = []
        """The subscriptions of each start since the last pass (one start may name many)."""
        self.gone: list[FollowSub] = []
        self.ended: MqdsError | None = None
        self.closed = False
        self.stopped = threading.Event()
        self.cohorts: set[Cohort] = set()
        """Every cohort with members (the serving thread's)."""
        self.at: dict[tuple[Any, int], Cohort] = {}
        """Cohorts taking shared answers by (key, position), to merge those that meet (the serving thread's)."""
        self.by_feed: dict[Any, set[Cohort]] = {}
        """The feeds this call listens to, with its cohorts that read each (the serving thread's)."""
        self.dirty: set[Any] = set()
        """Feeds that stored something since the last pass (under ``lock``)."""
        self.touched: set[Cohort] = set()
        """Cohorts with news of their own: just started, credit came, more to read (under ``lock``)."""
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
            group = follow_start.take(request.start, self.subs, self.limits.max_subscriptions)
            for sub in group:
                self.subs[sub.id] = sub
            self.new.append(group)
        elif kind == "credit":
            credit = request.credit
            if credit.messages < 1:
                raise errors.error(
                    Reason.INVALID_REQUEST, f"credit of {credit.messages} for subscription {credit.id}: at least 1"
                )
            subs, touched, messages = self.subs, self.touched, credit.messages
            if credit.also and self._grant_cohort(credit):
                return
            for sid in (credit.id, *credit.also):
                known = subs.get(sid)
                if known is None:  # one that just ended is not an error: the client could not know
                    continue
                cohort = known.cohort
                if cohort is None:  # not begun yet
                    known.limit_at += messages
                    continue
                if known.limit_at <= cohort.sent:
                    touched.add(cohort)  # it waited for credit: serve it (one with credit is served as news comes)
                cohort.grant(known, messages)
        elif kind == "cancel":
            cancelled = self.subs.pop(request.cancel, None)
            if cancelled is not None:
                self.gone.append(cancelled)
        else:
            raise errors.error(Reason.INVALID_REQUEST, "a Follow request must start, credit or cancel a subscription")

    def _grant_cohort(self, credit: pb.FollowCredit) -> bool:
        """Credit naming every member of one cohort, each once (a client's grant for a shared answer): granted
        to the cohort at once, not member by member and then a walk for the least credit (at 10,000 subscribers
        those two walks were a fifth of the nodes' Python time). False for any other credit."""
        first = self.subs.get(credit.id)
        cohort = None if first is None else first.cohort
        if cohort is None or not cohort.names_all(credit.id, credit.also):
            return False
        if cohort.grant_all(credit.messages):
            self.touched.add(cohort)  # one of them waited for credit: serve it
        return True

    # -- answers (the call's thread) --------------------------------------------------

    def serve(self) -> Iterator[bytes]:
        full_pass_at = 0.0
        while True:
            self.news.clear()
            failures: list[bytes] = []
            emptied: list[Cohort] = []
            with self.lock:
                if self.ended is not None:
                    raise self.ended
                if self.closed:
                    return
                begun: list[Cohort] = []
                for group in self.new:
                    cohorts, failed = self._begin(group)
                    begun += cohorts
                    failures += failed
                    for sub in group if failed else ():
                        if self.subs.get(sub.id) is sub:  # not cancelled (and its id used again) meanwhile
                            del self.subs[sub.id]
                self.new.clear()
                for sub in self.gone:
                    cohort = sub.cohort
                    if cohort is not None:
                        cohort.remove(sub)
                        if not cohort.members:
                            emptied.append(cohort)
                self.gone.clear()
                now = time.monotonic()
                if now >= full_pass_at:  # every cohort now and then: progress, a lost lead
                    full_pass_at = now + _IDLE_WAKE_S
                    due = list(self.cohorts)
                else:  # those with news: their shard stored something, credit came, more to read
                    due = [cohort for feed in self.dirty for cohort in self.by_feed.get(feed, ())]
                    due += self.touched
                self.dirty.clear()
                self.touched = set()
            yield from failures
            for cohort in begun:  # those starting where others of the call stand join them at once
                self._file(cohort)
            for cohort in emptied:
                self._drop(cohort)
            sent = False
            for cohort in dict.fromkeys(due):
                if not cohort.members:  # merged into another, or ended, during this pass
                    continue
                for answer, again in self._serve_cohort(cohort):
                    sent = True
                    yield answer
                    if again is not None:
                        with self.lock:
                            self.touched.add(again)
            if not sent:
                self.news.wait(max(0.0, min(_IDLE_WAKE_S, full_pass_at - time.monotonic())))

    def _begin(self, group: list[FollowSub]) -> tuple[list[Cohort], list[bytes]]:
        """Start the subscriptions of one start (under the lock): their cohorts, or a failure answer for each."""
        cohorts, failures = follow_start.begin(group, self.shards.n_shards, self.clock())
        self.cohorts.update(cohorts)
        self.touched.update(cohorts)
        return cohorts, failures

    def _serve_cohort(self, cohort: Cohort) -> list[_Answer]:
        """The cohort's next answers: one read with the most credit a member has, one answer for those whose
        credit covers what it found; the others split off, those holding the same credit together (one answer
        each credit, not one each member), and are served within it from the same position.
        An answer holds messages, or only progress; or a failure for each member, which ends them.
        """
        with self.lock:
            least, most = cohort.credits()
        if most <= 0:  # nothing to send them: no reason to be woken by their shard
            self._unlisten(cohort)
            return []
        try:
            got = self._read(cohort, min(most, self.limits.max_batch))
        except MqdsError as err:
            return self._end(cohort, err)
        count = len(got.pieces)
        split: list[Cohort] = []
        ids: tuple[int, int, bytes] | None = None
        with self.lock:  # the reader thread grants credit
            if count > least:  # those short split off together, one cohort for each credit they hold
                by_credit: dict[int, Cohort] = {}
                for sub in cohort.short_of(count):
                    credit = cohort.remove(sub)
                    alike = by_credit.get(credit)
                    if alike is None:
                        alike = by_credit[credit] = Cohort(sub.start, cohort.levels, cohort.position, cohort.shared)
                        split.append(alike)
                    alike.add(sub, credit)
            cohort.position = max(cohort.position, got.position)
            now = time.monotonic()
            if count or (cohort.position != cohort.reported and now - cohort.reported_at >= _PROGRESS_S):
                cohort.sent += count
                cohort.reported, cohort.reported_at = cohort.position, now
                ids = cohort.ids()
        answers: list[_Answer] = []
        if ids is not None:
            members, first, also = ids
            if got.from_feed:
                got.feed.read_from_ring += count * (members - 1)
            else:
                got.feed.read_from_disk += count * members
            head = pb.FollowResponse(id=first, shard=cohort.shard, position_us=cohort.position).SerializeToString()
            answers.append((head + also + b"".join(got.pieces), cohort if got.more else None))
        self._file(cohort)
        for alike in split:  # less credit than the others had: within theirs, from where they stood
            self.cohorts.add(alike)
            answers += self._serve_cohort(alike)
        return answers

    def _file(self, cohort: Cohort) -> None:
        """File a cohort taking shared answers under its position; one that meets another there joins it."""
        if not cohort.shared:
            return
        self._unfile(cohort)
        place = (cohort.key, cohort.position)
        other = self.at.get(place)
        if other is None or not other.members:
            self.at[place] = cohort
            cohort.filed_at = cohort.position
            return
        big, small = (other, cohort) if len(other.members) >= len(cohort.members) else (cohort, other)
        with self.lock:
            for sub in list(small.members.values()):
                big.add(sub, small.remove(sub))
            self.touched.add(big)  # what the smaller one had to read next, the merged one reads
        self._drop(small)
        self.at[place] = big
        big.filed_at = cohort.position

    def _unfile(self, cohort: Cohort) -> None:
        """Take the cohort out of ``at``, where it was filed."""
        if cohort.filed_at is not None and self.at.get((cohort.key, cohort.filed_at)) is cohort:
            del self.at[(cohort.key, cohort.filed_at)]
        cohort.filed_at = None

    def _drop(self, cohort: Cohort) -> None:
        """A cohort left without members goes."""
        self._unlisten(cohort)
        self.cohorts.discard(cohort)
        self._unfile(cohort)

    def _end(self, cohort: Cohort, err: MqdsError) -> list[_Answer]:
        """The cohort cannot be served: each member is told why, and ends."""
        with self.lock:
            members = list(cohort.members.values())
            for sub in members:
                cohort.remove(sub)
                self.subs.pop(sub.id, None)
        self._drop(cohort)
        return [(follow_start.failure(sub.id, cohort.shard, cohort.position, err), None) for sub in members]

    def _read(self, cohort: Cohort, limit: int) -> _Read:
        """Up to ``limit`` messages after the cohort's position, from the feed, else from disk; the cohort
        listens to the replica's feed afterwards.
        """
        vnode = self.shards.vnode(cohort.shard)
        if not cohort.stale_ok and not vnode.group.is_leader:
            err = vnode.group.not_leader_error()
            err.metadata["shard"] = str(cohort.shard)
            raise err
        replica = vnode.replica
        with replica.reading() as storage:
            feed = replica.feed
            if cohort.listening is not feed:
                self._unlisten(cohort)
                self._listen(cohort, feed, storage)
            got = feed.read_after(
                cohort.position, cohort.topic_filter, cohort.levels, limit, self.max_answer_bytes, now_us=self.clock()
            )
            if got is not None:
                # Read up to the feed's head: nothing more until it stores again (and then it wakes the call).
                return _Read(got[0], got[1], feed, True, got[1] < feed.head)
            pieces, position = self._from_disk(cohort, storage, replica.catchup, limit)
            return _Read(pieces, position, feed, False, True)

    def _from_disk(self, cohort: Cohort, storage: Any, catchup: Any, limit: int) -> tuple[list[bytes], int]:
        """Up to ``limit`` messages after the cohort's position from disk, encoded; the position reached.

        Through the replica's shared catch-up reads (``cluster/catchup.py``):
        subscribers of the filter at nearby positions share one read.
        """
        position = cohort.position
        if position > 0:
            dropped = dropped_after(storage, position)
            if dropped is not None:
                raise errors.error(
                    Reason.GENERATION_DROPPED,
                    f"shard {cohort.shard}: the messages stored between {dropped[0]} and {dropped[1]} (after this "
                    f"subscription's position {position}) were dropped by retention; start again from a time",
                    shard=str(cohort.shard),
                )
        fence = storage.last_ts
        if fence <= position:
            return [], position
        after = max(position, cohort.start_us - 1)
        if after >= fence:
            return [], fence
        budget = self.max_answer_bytes
        topic_filter = cohort.topic_filter

        def load(after_us: int, count: int) -> tuple[list[tuple[int, bytes]], int]:
            found: list[tuple[int, bytes]] = []
            size = 0
            for ts, stored in ordered(storage, topic_filter, after_us + 1, fence):
                if found and budget is not None and size + len(stored) > budget:
                    return found, found[-1][0]
                found.append((ts, stored))
                size += len(stored)
                if len(found) >= count:
                    return found, ts
            return found, fence

        return catchup.read(topic_filter, after, limit, budget, load, self.limits.max_batch, now_us=self.clock())

    def _listen(self, cohort: Cohort, feed: Any, storage: Any) -> None:
        """Have ``feed`` wake this call (once for all its cohorts on that feed), marking the feed dirty."""
        readers = self.by_feed.get(feed)
        if readers is None:
            readers = self.by_feed[feed] = set()

            def wake(feed: Any = feed) -> None:
                with self.lock:
                    self.dirty.add(feed)
                self.news.set()

            self._wakers[feed] = wake
            feed.listen(wake, lambda: storage.last_ts)
        readers.add(cohort)
        cohort.listening = feed

    def _unlisten(self, cohort: Cohort) -> None:
        feed = cohort.listening
        if feed is None:
            return
        cohort.listening = None
        readers = self.by_feed.get(feed)
        if readers is None:
            return
        readers.discard(cohort)
        if not readers:
            del self.by_feed[feed]
            feed.unlisten(self._wakers.pop(feed))

    def stop(self) -> None:
        self.stopped.set()
        with self.lock:
            self.subs.clear()
        for cohort in list(self.cohorts):
            self._unlisten(cohort)
        self.cohorts.clear()


def serve(
    shards: _Shards,
    requests: Iterator[Any],
    limits: FollowLimits,
    max_answer_bytes: int | None,
    clock: Any,
    registry: tuple[FollowCalls, str] | None = None,
) -> Iterator[bytes]:
    """Answer a Follow call: yields encoded FollowResponses until the client ends it (or breaks the protocol).

    ``registry``: the node's open calls and the caller's address; the call is listed there while it lasts.
    """
    call = _Call(shards, limits, max_answer_bytes, clock)
    number = registry[0].add(call, registry[1]) if registry is not None else None
    reader = threading.Thread(target=call.read, args=(requests,), name="follow-reader", daemon=True)
    reader.start()
    try:
        yield from call.serve()
    finally:
        call.stop()
        if registry is not None and number is not None:
            registry[0].remove(number)
