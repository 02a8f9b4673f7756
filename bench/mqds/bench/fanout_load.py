"""The subscriber side of ``mqds bench --subscribers``: processes of push subscribers that count what they get.

Each process holds its share of the subscribers on raw ``Storage.Follow``
calls (one per node, more when a call would carry over ``per_call``
subscriptions), each subscriber following ``bench/#`` on every shard from
the run's start (a call's subscriptions of one shard started by one request,
``FollowStart.also``), served by the shard's replicas in turn (``stale_ok``). It
counts the messages it is sent without decoding them into objects (the
benchmark measures the nodes, not the client's decoding), grants the credit
back (gathered: one request for the subscriptions a shared answer was for,
about twice a second), and samples each answer's delivery: the time it
arrived, its shard, the timestamps of its first and last message, and the
subscriptions it was for. :func:`delivery_latencies` turns the samples into
each message's latency, two ways: from the publisher's acknowledgement of the
store call that held it (what a subscriber waits once the publisher has been
told its message is stored), and from the timestamp its shard's leader gave
it (taken before the commit, so it adds the commit's own latency).
"""

from __future__ import annotations

import bisect
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from mqds.bench.load import TOPIC_PREFIX
from mqds.client.connection import ConnectionSettings
from mqds.client.core.follow import FOLLOW_METHOD
from mqds.v1 import storage_pb2 as pb

TOPIC_FILTER = f"{TOPIC_PREFIX}/#"
Sample = tuple[float, int, int, int, int, int]
"""An answer as received: time.time() it arrived, shard, first and last timestamp_us, messages, subscriptions."""
_MAX_SAMPLES = 200_000
WINDOW = 10_000
"""Each subscription's credit, in messages."""
GRANT_AT = WINDOW // 4
GRANT_EVERY_S = 0.5


@dataclass
class SubscriberSpec:
    """One subscriber process: which subscribers it holds, and where each shard is served."""

    first: int
    count: int
    replicas: dict[int, list[str]]
    """Shard -> the addresses of its replicas (subscriber i reads shard s from replica i % len)."""
    start_us: int
    window: int
    per_call: int
    settings: ConnectionSettings | None
    shared_answers: bool = True
    """Whether the subscriptions take shared answers (``FollowStart.shared_answers``)."""


class _FollowCall:
    def __init__(self, channel: grpc.Channel, metadata: Any, counter: _Counter) -> None:
        self.requests: queue.SimpleQueue[pb.FollowRequest | None] = queue.SimpleQueue()
        method = channel.stream_stream(
            FOLLOW_METHOD,
            request_serializer=pb.FollowRequest.SerializeToString,
            response_deserializer=pb.FollowResponse.FromString,
        )
        self.call = method(self._requests(), metadata=metadata)
        self.counter = counter
        self.pending: dict[tuple[int, ...], int] = {}
        """Credit not yet granted back, by the subscriptions an answer was for."""
        self.granted_at = time.monotonic()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _requests(self) -> Any:
        while (request := self.requests.get()) is not None:
            yield request

    def _read(self) -> None:
        try:
            for answer in self.call:
                n = len(answer.messages)
                if answer.HasField("failure"):
                    self.counter.failures += 1
                    continue
                if not n:
                    continue
                # A shared answer is each of its subscriptions' (``also``): each is counted, and granted again.
                messages = answer.messages
                self.counter.add(
                    n, answer.id, messages[0].timestamp_us, messages[n - 1].timestamp_us, 1 + len(answer.also)
                )
                self._grant((answer.id, *answer.also), n)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                self.counter.failures += 1

    def _grant(self, ids: tuple[int, ...], messages: int) -> None:
        """Grant ``messages`` again to each of ``ids``: gathered, and sent for all every ``GRANT_EVERY_S`` or when
        one set's reaches ``GRANT_AT`` (a node counts each subscription's credit, so granting each answer back
        at once would cost it as much as the answers saved). A subscription is owed at most a quarter of its
        window, or what came in half a second.
        """
        pending = self.pending
        pending[ids] = pending.get(ids, 0) + messages
        now = time.monotonic()
        if pending[ids] < GRANT_AT and now - self.granted_at < GRANT_EVERY_S:
            return
        self.granted_at = now
        for owed, count in pending.items():
            credit = pb.FollowCredit(id=owed[0], messages=count, also=owed[1:])
            self.requests.put(pb.FollowRequest(credit=credit))
        pending.clear()

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.delivered = 0
        self.answers = 0
        """Answers with messages received while counting (a shared one once)."""
        self.samples: list[Sample] = []
        """One per answer (see ``Sample``)."""
        self.shards: dict[int, int] = {}
        """Subscription id -> its shard."""
        self.failures = 0
        self.counting = False
        self.last_at = 0.0
        self.shared: Any = None
        """The counts every subscriber process adds to, which the parent watches (``delivered``, ``warm``)."""

    def add(self, n: int, subscription: int, first_us: int, last_us: int, subscriptions: int = 1) -> None:
        """``n`` messages of ``subscription``'s shard (timestamps ``first_us`` to ``last_us``) each delivered to
        ``subscriptions``."""
        arrived = time.time()
        with self.lock:
            if not self.counting:  # before the load: the message each subscription gets once it has started
                if self.shared is not None:
                    with self.shared.warm.get_lock():
                        self.shared.warm.value += n * subscriptions
                return
            self.delivered += n * subscriptions
            self.answers += 1
            self.last_at = arrived
            if len(self.samples) < _MAX_SAMPLES:
                self.samples.append((arrived, self.shards[subscription], first_us, last_us, n, subscriptions))
        if self.shared is not None:
            with self.shared.delivered.get_lock():
                self.shared.delivered.value += n * subscriptions


def subscribe(args: tuple[SubscriberSpec, Any]) -> None:
    """One subscriber process: follow until told to stop, then report (delivered, samples, failures)."""
    spec, shared = args
    settings = spec.settings or ConnectionSettings()
    counter = _Counter()
    counter.shared = shared
    channels: dict[str, grpc.Channel] = {}
    calls: dict[str, list[tuple[_FollowCall, int]]] = {}
    metadata = settings.call_metadata()
    ids = itertools.count(1)
    starting: dict[tuple[_FollowCall, int], list[int]] = {}
    """The subscription ids each call starts on each shard."""
    for subscriber in range(spec.first, spec.first + spec.count):
        for shard, replicas in sorted(spec.replicas.items()):
            address = replicas[subscriber % len(replicas)]
            if address not in channels:
                channels[address] = settings.open_channel(address, settings.channel_credentials(), [])
            mine = calls.setdefault(address, [])
            if not mine or mine[-1][1] >= spec.per_call:
                mine.append((_FollowCall(channels[address], metadata, counter), 0))
            call, carried = mine[-1]
            mine[-1] = (call, carried + 1)
            sid = next(ids)
            counter.shards[sid] = shard
            starting.setdefault((call, shard), []).append(sid)
    # One request starts a call's subscriptions of a shard (``FollowStart.also``), not one request each.
    for (call, shard), sids in starting.items():
        start = pb.FollowStart(
            id=sids[0],
            also=sids[1:],
            topic_filter=TOPIC_FILTER,
            shard=shard,
            start_time_us=spec.start_us,
            credit=spec.window,
            stale_ok=True,
            shared_answers=spec.shared_answers,
        )
        call.requests.put(pb.FollowRequest(start=start))
    shared.ready.put(1)
    shared.go.wait(120)
    with counter.lock:
        counter.counting = True
    cpu_before = time.process_time()
    shared.stop.wait(3600)
    with counter.lock:
        counter.counting = False
        delivered, samples, failures, answers = counter.delivered, counter.samples, counter.failures, counter.answers
        last_at = counter.last_at
    cpu_s = time.process_time() - cpu_before
    for mine in calls.values():
        for call, _ in mine:
            call.close()
    for channel in channels.values():
        channel.close()
    shared.results.put(
        {
            "delivered": delivered,
            "answers": answers,
            "samples": samples,
            "failures": failures,
            "cpu_s": cpu_s,
            "last_at": last_at,
        }
    )


def delivery_latencies(
    samples: list[Sample], acks: list[tuple[int, int, int, float]]
) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """Each sampled message's latency, as sorted ``(seconds, deliveries)``: from the acknowledgement of the store
    call that held it (``acks``: shard, first and last timestamp_us, acknowledged at), and from its timestamp.

    An answer's messages are the shard's from its first to its last
    timestamp (every message the benchmark stores matches its filter; a
    store call's messages have consecutive timestamps), so the messages it
    took from each call are known without listing them. A message no
    acknowledged call holds (one of a call retried after a failure) has only
    the latency from its timestamp. A latency from the acknowledgement may be
    below zero: the subscriber can have the message before the publisher has
    its answer.
    """
    calls: dict[int, tuple[list[int], list[tuple[int, float]]]] = {}
    for shard, first, last, acked_at in sorted(acks):
        lasts, rest = calls.setdefault(shard, ([], []))
        lasts.append(last)
        rest.append((first, acked_at))
    from_ack: list[tuple[float, int]] = []
    from_stored: list[tuple[float, int]] = []
    for arrived, shard, first_us, last_us, n, subscriptions in samples:
        lasts, rest = calls.get(shard, ([], []))
        covered = 0
        i = bisect.bisect_left(lasts, first_us)
        while i < len(lasts) and rest[i][0] <= last_us and covered < n:
            lo = max(rest[i][0], first_us)
            took = min(min(lasts[i], last_us) - lo + 1, n - covered)
            from_ack.append((arrived - rest[i][1], took * subscriptions))
            from_stored.append((arrived - lo / 1e6, took * subscriptions))
            covered += took
            i += 1
        if covered < n:
            from_stored.append((arrived - first_us / 1e6, (n - covered) * subscriptions))
    return sorted(from_ack), sorted(from_stored)
