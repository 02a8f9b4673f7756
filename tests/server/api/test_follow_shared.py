"""Shared answers on Storage.Follow: a call's subscriptions at one place take one answer (``also``), each its own.

Against a real one-node cluster on raw Follow calls, so what goes on the
wire is what is checked: each subscription gets every message exactly once,
in order, never more than its credit, and a call carrying many of them is
sent one answer per batch rather than one per subscription.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from mqds.client import Client, Message
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import storage_pb2 as pb

pytestmark = pytest.mark.integration

N_SHARDS = 2
SHARD = 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("shared") / "c", 1, n_shards=N_SHARDS) as c:
        c.start()
        c.wait_leaders_settled()
        yield c


class RawCall:
    """A Follow call driven by hand: requests go out as sent, answers are queued as they come."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.out: queue.SimpleQueue[pb.FollowRequest | None] = queue.SimpleQueue()
        self.answers: queue.SimpleQueue[pb.FollowResponse] = queue.SimpleQueue()
        self.channel = grpc.insecure_channel(cluster.addresses[0])
        method = self.channel.stream_stream(
            "/mqds.v1.Storage/Follow",
            request_serializer=pb.FollowRequest.SerializeToString,
            response_deserializer=pb.FollowResponse.FromString,
        )
        self.call = method(self._requests(), timeout=60)
        threading.Thread(target=self._read, daemon=True).start()

    def _requests(self) -> Iterator[pb.FollowRequest]:
        while (request := self.out.get()) is not None:
            yield request

    def _read(self) -> None:
        try:
            for answer in self.call:
                self.answers.put(answer)
        except grpc.RpcError:
            pass

    def start(
        self, id_: int, topic_filter: str, credit: int, shared: bool = True, also: list[int] | None = None
    ) -> None:
        start = pb.FollowStart(
            id=id_,
            topic_filter=topic_filter,
            shard=SHARD,
            credit=credit,
            shared_answers=shared,
            stale_ok=True,
            also=also or [],
        )
        self.out.put(pb.FollowRequest(start=start))

    def credit(self, ids: list[int], messages: int) -> None:
        self.out.put(pb.FollowRequest(credit=pb.FollowCredit(id=ids[0], messages=messages, also=ids[1:])))

    def collect(
        self, want: dict[int, int], timeout_s: float = 30, grant: bool = False
    ) -> tuple[dict[int, list[bytes]], list[pb.FollowResponse]]:
        """Answers until each id in ``want`` has that many messages (granting back what came when ``grant``)."""
        got: dict[int, list[bytes]] = {i: [] for i in want}
        answers = []
        deadline = time.monotonic() + timeout_s
        while any(len(got[i]) < n for i, n in want.items()):
            left = deadline - time.monotonic()
            short = {i: len(got[i]) for i, n in want.items() if len(got[i]) < n}
            assert left > 0, f"{len(short)} of {len(want)} still waiting; got: {dict(list(short.items())[:10])}"
            try:
                answer = self.answers.get(timeout=left)
            except queue.Empty:
                continue
            assert not answer.HasField("failure"), answer.failure
            answers.append(answer)
            ids = [answer.id, *answer.also]
            for i in ids:
                got.setdefault(i, []).extend(m.payload for m in answer.messages)
            if grant and answer.messages:
                self.credit(ids, len(answer.messages))
        return got, answers

    def close(self) -> None:
        self.out.put(None)
        self.call.cancel()
        self.channel.close()


def sender_on_shard(prefix: str) -> str:
    return next(f"{prefix}-{i}" for i in range(1000) if shard_of(f"{prefix}-{i}", N_SHARDS) == SHARD)


def store(cluster: LocalCluster, topic: str, sender: str, numbers: range) -> None:
    with Client(cluster.addresses, timeout_s=30) as client:
        for first in range(numbers.start, numbers.stop, 50):
            last = min(first + 50, numbers.stop)
            client.store_batch([Message(topic, str(i).encode(), sender, 1) for i in range(first, last)])


def test_subscriptions_at_one_place_share_answers_and_each_gets_everything_once(cluster: LocalCluster) -> None:
    sender = sender_on_shard("share")
    call = RawCall(cluster)
    try:
        ids = list(range(1, 51))
        for i in ids:  # a window smaller than what comes: the grouped credit keeps them going
            call.start(i, "share/#", credit=120)
        store(cluster, "share/warm", sender, range(1))
        call.collect(dict.fromkeys(ids, 1), grant=True)
        store(cluster, "share/t", sender, range(1, 501))
        got, answers = call.collect(dict.fromkeys(ids, 500), grant=True)
    finally:
        call.close()
    expected = [str(i).encode() for i in range(1, 501)]
    assert all(got[i] == expected for i in ids), "each subscription: every message once, in the order stored"
    assert all(len(answer.messages) <= 120 for answer in answers)
    sent = sum(len(answer.messages) for answer in answers)
    assert sent * 10 <= 50 * 500, f"{sent:,} messages on the wire for 50 x 500 deliveries: answers not shared"


def test_one_short_of_credit_is_served_on_its_own_within_it(cluster: LocalCluster) -> None:
    sender = sender_on_shard("short")
    call = RawCall(cluster)
    try:
        store(cluster, "short/warm", sender, range(1))
        for i in (1, 2, 3):
            call.start(i, "short/#", credit=1000)
        call.start(4, "short/#", credit=4)
        call.collect({1: 1, 2: 1, 3: 1, 4: 1})
        store(cluster, "short/t", sender, range(1, 11))
        got, answers = call.collect({1: 10, 2: 10, 3: 10, 4: 3})
        assert got[4] == [b"1", b"2", b"3"], "never more than its credit"
        assert any(len(a.also) == 2 for a in answers if a.messages), "the three with credit shared an answer"
        call.credit([4], 100)
        more, _ = call.collect({4: 7})
        assert more[4] == [str(i).encode() for i in range(4, 11)], "then the rest, from where it stood"
        store(cluster, "short/t", sender, range(11, 16))
        after, answers = call.collect({1: 5, 2: 5, 3: 5, 4: 5})
        assert all(after[i] == [str(n).encode() for n in range(11, 16)] for i in (1, 2, 3, 4))
        assert {len(a.also) for a in answers if a.messages} == {3}, "caught up, it shares the others' answers again"
    finally:
        call.close()
    assert all(got[i] == [str(n).encode() for n in range(1, 11)] for i in (1, 2, 3))


def test_subscriptions_that_did_not_ask_get_answers_of_their_own(cluster: LocalCluster) -> None:
    sender = sender_on_shard("own")
    call = RawCall(cluster)
    try:
        for i in (1, 2, 3):
            call.start(i, "own/#", credit=1000, shared=False)
        store(cluster, "own/t", sender, range(20))
        got, answers = call.collect(dict.fromkeys((1, 2, 3), 20))
    finally:
        call.close()
    assert not any(answer.also for answer in answers)
    assert all(got[i] == [str(n).encode() for n in range(20)] for i in (1, 2, 3))


def test_one_start_naming_many_subscriptions_starts_each_of_them(cluster: LocalCluster) -> None:
    """``FollowStart.also``: 200 subscriptions in one request, each served as if started alone."""
    sender = sender_on_shard("many")
    call = RawCall(cluster)
    try:
        ids = list(range(1, 201))
        call.start(ids[0], "many/#", credit=120, also=ids[1:])
        call.start(500, "many/#", credit=1000, shared=False, also=[501, 502])
        store(cluster, "many/t", sender, range(300))
        got, answers = call.collect(dict.fromkeys([*ids, 500, 501, 502], 300), grant=True)
    finally:
        call.close()
    expected = [str(i).encode() for i in range(300)]
    assert all(got[i] == expected for i in [*ids, 500, 501, 502]), "each: every message once, in order"
    shared = [a for a in answers if a.messages and a.id in ids]
    assert shared and all(sorted([a.id, *a.also]) == ids for a in shared), "the 200 began as one and stayed one"
    assert all(len(a.messages) <= 120 for a in shared), "never past their credit"
    own = [a for a in answers if a.id in (500, 501, 502)]
    assert own and not any(a.also for a in own), "without shared answers, each its own"


_IDS = st.integers(0, 12)
_FAR_US = 2**62
_STARTS = st.builds(
    pb.FollowStart,
    id=_IDS,
    also=st.lists(_IDS, max_size=4),
    topic_filter=st.sampled_from(["odd/#", "odd/+/x", "#", "", "a/#/b", "+/+", "odd/\x00"]),
    shard=st.integers(0, N_SHARDS + 1),
    after_us=st.sampled_from([0, 1, _FAR_US]),
    credit=st.integers(0, 3),
    stale_ok=st.booleans(),
    shared_answers=st.booleans(),
)
_GOOD_STARTS = st.builds(
    pb.FollowStart,
    id=_IDS,
    also=st.lists(_IDS, max_size=3, unique=True),
    topic_filter=st.just("odd/#"),
    shard=st.just(SHARD),
    credit=st.integers(1, 3),
    stale_ok=st.just(True),
    shared_answers=st.booleans(),
)
_REQUESTS: SearchStrategy[pb.FollowRequest] = st.one_of(
    st.builds(pb.FollowRequest, start=_STARTS),
    st.builds(pb.FollowRequest, start=_GOOD_STARTS),
    st.builds(pb.FollowRequest, start=_GOOD_STARTS),
    st.builds(
        pb.FollowRequest,
        credit=st.builds(pb.FollowCredit, id=_IDS, messages=st.integers(0, 3), also=st.lists(_IDS, max_size=4)),
    ),
    st.builds(pb.FollowRequest, cancel=_IDS),
    st.just(pb.FollowRequest()),
)


def test_odd_request_sequences_end_clearly_and_the_node_goes_on_serving(cluster: LocalCluster) -> None:
    """Any sequence of starts (with ``also``), credits and cancels: the call ends with OK or INVALID_ARGUMENT
    saying why once its requests end, every failure answer names its reason, and the node still serves."""
    store(cluster, "odd/a/x", sender_on_shard("odd"), range(5))
    channel = grpc.insecure_channel(cluster.addresses[0])
    method = channel.stream_stream(
        "/mqds.v1.Storage/Follow",
        request_serializer=pb.FollowRequest.SerializeToString,
        response_deserializer=pb.FollowResponse.FromString,
    )
    reasons = {"INVALID_TOPIC_FILTER", "INVALID_REQUEST", "UNKNOWN_SHARD", "NOT_LEADER"}
    seen = {"messages": 0, "failures": 0, "refused": 0}

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(_REQUESTS, min_size=1, max_size=8))
    def one_call(requests: list[pb.FollowRequest]) -> None:
        def sent() -> Iterator[pb.FollowRequest]:
            yield from requests
            time.sleep(0.1)  # a moment to serve what started, then the requests end

        call = method(sent(), timeout=15)
        try:
            for answer in call:
                if answer.HasField("failure"):
                    assert answer.failure.reason in reasons, answer.failure
                    assert answer.failure.message
                    seen["failures"] += 1
                seen["messages"] += len(answer.messages)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
            assert err.details()
            seen["refused"] += 1

    try:
        one_call()
    finally:
        channel.close()
    assert all(seen.values()), f"the sequences did not reach every outcome: {seen}"
    call = RawCall(cluster)
    try:
        call.start(1, "odd/#", credit=100)
        got, _ = call.collect({1: 5})
    finally:
        call.close()
    assert got[1] == [str(i).encode() for i in range(5)]
