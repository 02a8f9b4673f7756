"""Push subscriptions' pieces without a cluster: the replica's feed, ordered reads and drops, saved positions,
the client's routing of shared answers and merging of credits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rocksdict import Rdict
from storage_support import msg

from mqds.client import FollowPosition
from mqds.client import errors as E
from mqds.client.core.follow import FollowRoutes, ShardPart, merge_credits
from mqds.server.cluster.feed import ShardFeed
from mqds.server.storage import keys
from mqds.server.storage.ordered import dropped_after, ordered
from mqds.server.storage.shard import Engine, ShardStorage
from mqds.v1 import storage_pb2 as pb


def part(first: int, *topics: str) -> tuple[int, list, list[bytes]]:
    messages = [msg(t, f"{first + i}".encode()) for i, t in enumerate(topics)]
    return first, messages, [m.SerializeToString() for m in messages]


def read(
    feed: ShardFeed, after: int, topic_filter: str = "#", limit: int = 100, budget: int | None = None
) -> tuple[list[tuple[int, bytes]], int] | None:
    """What the feed answers, as (timestamp, payload) pairs read back from the encoded answer, and the position."""
    got = feed.read_after(after, topic_filter, topic_filter.split("/"), limit, budget)
    if got is None:
        return None
    pieces, reached = got
    messages = pb.FollowResponse.FromString(b"".join(pieces)).messages
    assert all(m.shard == feed.shard for m in messages)
    return [(m.timestamp_us, m.payload) for m in messages], reached


def test_an_idle_feed_keeps_nothing_and_starts_when_someone_listens() -> None:
    feed = ShardFeed(3, 1 << 20)
    feed.append(*part(10, "a", "b"))
    assert feed.size_bytes == 0 and read(feed, 0) is None
    woken: list[int] = []
    feed.listen(lambda: woken.append(1), lambda: 11)
    assert read(feed, 10) is None  # before the feed started: from disk
    assert read(feed, 11) == ([], 11)
    feed.append(*part(12, "a", "b", "c"))
    assert woken == [1]
    entries, reached = read(feed, 11)
    assert [ts for ts, _ in entries] == [12, 13, 14] and reached == 14


def test_the_feed_serves_only_matches_after_a_position_within_credit_and_bytes() -> None:
    feed = ShardFeed(3, 1 << 20)
    feed.listen(lambda: None, lambda: 0)
    feed.append(*part(1, "s/1/t", "s/2/t", "x", "s/3/t"))
    feed.append(*part(10, "x", "x"))
    entries, reached = read(feed, 0, "s/+/t")
    assert [ts for ts, _ in entries] == [1, 2, 4] and reached == 11  # the later non-matching ones are read past
    entries, reached = read(feed, 1, "s/+/t", limit=1)
    assert [ts for ts, _ in entries] == [2] and reached == 2
    one = len(feed.read_after(0, "s/+/t", ["s", "+", "t"], 1, None)[0][0])  # type: ignore[index]
    entries, reached = read(feed, 0, "s/+/t", budget=one + 1)
    assert [ts for ts, _ in entries] == [1] and reached == 1  # one at least, then the budget stops it


def test_a_feed_over_its_bytes_drops_its_oldest_and_sends_those_readers_to_disk() -> None:
    parts = [part(first, *["a"] * 10) for first in (11, 21, 31)]
    size = max(sum(len(b) for b in p[2]) + 64 for p in parts)
    feed = ShardFeed(3, size * 2)
    feed.listen(lambda: None, lambda: 10)
    for p in parts:
        feed.append(*p)
    assert feed.size_bytes <= size * 2 and feed.covers_after == 20
    assert read(feed, 15) is None
    entries, _ = read(feed, 20)
    assert entries[0][0] == 21


def test_a_reset_feed_starts_again_after_the_new_data() -> None:
    feed = ShardFeed(3, 1 << 20)
    woken: list[int] = []
    feed.listen(lambda: woken.append(1), lambda: 0)
    feed.append(*part(1, "a"))
    feed.reset(500)
    assert feed.covers_after == 500 and read(feed, 1) is None and read(feed, 500) == ([], 500)
    assert woken == [1, 1]


def test_matches_are_found_once_per_batch_and_filter() -> None:
    feed = ShardFeed(3, 1 << 20)
    feed.listen(lambda: None, lambda: 0)

    class Counting:
        def __init__(self, topic: str) -> None:
            self.reads = 0
            self._topic = topic

        @property
        def topic(self) -> str:
            self.reads += 1
            return self._topic

    messages = [Counting("s/1"), Counting("s/2")]
    feed.append(1, messages, [msg("s/1").SerializeToString(), msg("s/2").SerializeToString()])
    for _ in range(50):  # fifty subscribers of one filter
        assert [ts for ts, _ in read(feed, 0, "s/+")[0]] == [1, 2]
    read(feed, 0, "s/1")
    assert [m.reads for m in messages] == [1, 1]
    # ... and encoded once: every subscriber's answer joins the same bytes.
    first, second = (feed.read_after(0, "s/+", ["s", "+"], 10, None) for _ in range(2))
    assert first is not None and second is not None
    assert len(first[0]) == 2 and all(a is b for a, b in zip(first[0], second[0], strict=True))


def test_the_last_listener_gone_drops_the_ring() -> None:
    feed = ShardFeed(3, 1 << 20)
    a, b = (lambda: None), (lambda: None)
    feed.listen(a, lambda: 0)
    feed.listen(b, lambda: 0)
    feed.append(*part(1, "a"))
    feed.unlisten(a)
    assert feed.size_bytes > 0
    feed.unlisten(b)
    assert feed.size_bytes == 0 and feed.covers_after is None


def test_ordered_reads_merge_streams_and_stop_at_the_fence(shard: ShardStorage) -> None:
    shard.store([msg("a/1"), msg("b/x/y"), msg("a/2")], 100)
    shard.add_generation(200)
    shard.store([msg("b/x/y"), msg("a/3")], 300)
    all_ts = [ts for ts, _ in ordered(shard, "#", 0)]
    assert all_ts == sorted(all_ts) and len(all_ts) == 5
    assert [ts for ts, _ in ordered(shard, "a/+", 0)] == [all_ts[0], all_ts[2], all_ts[4]]
    assert [ts for ts, _ in ordered(shard, "#", all_ts[1] + 1, fence_us=all_ts[3])] == all_ts[2:4]


def test_dropped_generations_are_told_to_positions_before_them_only(shard: ShardStorage) -> None:
    shard.store([msg("a")], 100)
    first = shard.generations()[0]
    shard.add_generation(1_000)
    shard.store([msg("a")], 1_100)
    shard.add_generation(2_000)
    assert dropped_after(shard, 50) is None
    shard.drop_generation(first.generation)
    assert dropped_after(shard, 50) == (0, 1_000)
    assert dropped_after(shard, 100) is None  # its last message was read: nothing after it went
    assert dropped_after(shard, 999) is None  # everything after it is still there
    shard.drop_generation(shard.generations()[0].generation)
    assert dropped_after(shard, 1_050) == (0, 2_000)  # both dropped generations' time, before the third
    assert dropped_after(shard, 1_100) is None


def test_a_reader_at_the_last_message_of_a_dropped_generation_lost_nothing(shard: ShardStorage) -> None:
    first = shard.store([msg("a/1"), msg("a/2"), msg("b")], 1_000)
    last = first + 2
    # The rotation comes at its own clock time, long after the last message.
    opened = shard.add_generation(1_000_000)
    assert opened.since_us == 1_000_000 and shard.last_ts == 999_999
    shard.drop_generation(1)
    assert dropped_after(shard, last) is None
    assert dropped_after(shard, 500_000) is None
    assert dropped_after(shard, last - 1) == (0, 1_000_000)
    assert dropped_after(shard, 0) == (0, 1_000_000)
    assert shard.generations()[0].last_before_us == last  # kept by the record of the generation after it


def test_generations_that_stored_nothing_carry_the_last_message_on_and_their_drop_loses_nothing(
    shard: ShardStorage,
) -> None:
    last = shard.store([msg("a")], 100)
    shard.add_generation(1_000)
    shard.add_generation(2_000)  # an idle shard rotates all the same
    shard.add_generation(3_000)
    assert [g.last_before_us for g in shard.generations()] == [0, last, last, last]
    shard.drop_generation(2)  # the first one is still there: what went held nothing
    assert dropped_after(shard, 0) is None
    shard.drop_generation(1)
    shard.drop_generation(3)
    assert dropped_after(shard, last) is None
    assert dropped_after(shard, last - 1) == (0, 3_000)


def test_a_shard_whose_generation_records_predate_the_last_message_counts_their_whole_interval(
    tmp_path: Path, engine: Engine
) -> None:
    path = str(tmp_path / "s")
    storage = ShardStorage(path, 0, engine)
    storage.initialize(1)
    storage.store([msg("a")], 100)
    storage.add_generation(1_000)
    storage.add_generation(2_000)
    storage.close()
    # As the code before wrote them: version 1, without the last message before them.
    names = Rdict.list_cf(path)
    db = Rdict(path, engine.db_options(), column_families={n: engine.cf_options() for n in names if n != "default"})
    for number in (1, 2, 3):
        record = keys.GenerationRecord.decode(db[keys.generation_key(number)])
        db[keys.generation_key(number)] = keys.GenerationRecord(
            record.since_us, record.until_us, record.created_at_us
        ).encode()
    db.close()
    storage = ShardStorage(path, 0, engine)
    try:
        assert [g.last_before_us for g in storage.generations()] == [None, None, None]
        storage.drop_generation(1)
        assert dropped_after(storage, 100) == (0, 1_000)  # as before: up to the next generation's start
        assert dropped_after(storage, 999) is None
        # Records written from now on keep it, on top of the old ones.
        storage.store([msg("a")], 2_100)
        storage.add_generation(5_000)
        assert storage.meta_get(keys.generation_key(3))[0] == 1  # closed, still as written
        assert storage.meta_get(keys.generation_key(4))[0] == 2
        storage.drop_generation(2)
        storage.drop_generation(3)
        assert dropped_after(storage, 2_100) is None
        assert dropped_after(storage, 2_099) == (0, 5_000)
    finally:
        storage.close()


positions = st.builds(
    lambda cid, flt, after: FollowPosition.of(cid, flt, after),
    st.text(max_size=20),
    st.text(min_size=1, max_size=30),
    st.dictionaries(st.integers(0, 2**16), st.integers(0, 2**64 - 1), max_size=20),
)


@given(positions)
def test_a_saved_position_reads_back_the_same(position: FollowPosition) -> None:
    assert FollowPosition.from_bytes(position.to_bytes()) == position


@given(positions, st.data())
def test_a_damaged_position_is_refused(position: FollowPosition, data: st.DataObject) -> None:
    raw = bytearray(position.to_bytes())
    how = data.draw(st.sampled_from(["flip", "cut", "grow"]))
    if how == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "cut":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        raw += b"\x00"
    with pytest.raises(E.InvalidArgumentError, match="not a follow position"):
        FollowPosition.from_bytes(bytes(raw))


def test_a_position_of_another_cluster_filter_or_shard_count_is_refused() -> None:
    position = FollowPosition.of("c1", "a/#", {0: 5, 3: 9})
    position.check("c1", "a/#", 4)
    for cid, flt, n, what in (("c2", "a/#", 4, "cluster"), ("c1", "b/#", 4, "topic filter"), ("c1", "a/#", 2, "shard")):
        with pytest.raises(E.InvalidArgumentError, match=what) as err:
            position.check(cid, flt, n)
        assert err.value.reason.value == "INVALID_POSITION"


requests = st.lists(
    st.one_of(
        st.builds(lambda i: pb.FollowRequest(start=pb.FollowStart(id=i, credit=1)), st.integers(1, 6)),
        st.builds(
            lambda i, n: pb.FollowRequest(credit=pb.FollowCredit(id=i, messages=n)),
            st.integers(1, 6),
            st.integers(1, 3),
        ),
        st.builds(lambda i: pb.FollowRequest(cancel=i), st.integers(1, 6)),
    ),
    max_size=30,
)


def replay_credit(sequence: list[pb.FollowRequest]) -> list[dict[int, int]]:
    """The credit each id holds after each start or cancel (what a node applying the requests in order sees)."""
    credit: dict[int, int] = {}
    seen = []
    for request in sequence:
        kind = request.WhichOneof("kind")
        if kind == "start":
            credit[request.start.id] = 0
        elif kind == "cancel":
            credit.pop(request.cancel, None)
        else:
            for sid in (request.credit.id, *request.credit.also):
                if sid in credit:
                    credit[sid] += request.credit.messages
            continue
        seen.append(dict(credit))
    seen.append(dict(credit))
    return seen


@given(requests)
def test_merged_credits_grant_what_the_requests_did_and_never_pass_a_start_or_cancel(
    sequence: list[pb.FollowRequest],
) -> None:
    originals = [pb.FollowRequest.FromString(r.SerializeToString()) for r in sequence]
    merged = merge_credits(sequence)
    assert replay_credit(merged) == replay_credit(originals)
    assert len(merged) <= len(originals)


def test_a_shared_answer_is_routed_to_each_subscription_it_names() -> None:
    routes: FollowRoutes[str, str] = FollowRoutes()
    parts = {name: ShardPart(0, 0) for name in "abc"}
    for name, p in parts.items():
        routes.add(name, p, "call", pb.FollowStart())
    ids = {name: p.sub_id for name, p in parts.items()}
    answer = pb.FollowResponse(id=ids["a"], also=[ids["b"], 999, ids["c"]], position_us=5)
    assert [(sid, sub) for sid, sub, _ in routes.answered(answer)] == [
        (ids["a"], "a"),
        (ids["b"], "b"),
        (ids["c"], "c"),
    ]
    failure = pb.FollowResponse(id=ids["b"], failure=pb.ShardFailure(reason="NOT_LEADER"))
    assert [sub for _, sub, _ in routes.answered(failure)] == ["b"]
    assert [sub for _, sub, _ in routes.answered(answer)] == ["a", "c"], "a failure ends its route"


def test_the_feed_head_is_its_last_message() -> None:
    feed = ShardFeed(0, 1 << 20)
    assert feed.head == 0
    feed.listen(lambda: None, lambda: 7)
    assert feed.head == 7
    feed.append(*part(10, "a", "b", "c"))
    assert feed.head == 12


def test_the_asyncio_client_merges_the_credits_waiting_on_a_call() -> None:
    """While a write is under way, what the subscriptions grant waits, and goes as one request (as in the sync
    client): a thousand subscribers freeing their windows cost the node one credit, not a thousand."""
    from types import SimpleNamespace

    from mqds.client.aio.follow import _Call

    class Stream:
        def __init__(self) -> None:
            self.written: list[pb.FollowRequest] = []
            self.gate = asyncio.Event()

        async def write(self, request: pb.FollowRequest) -> None:
            await self.gate.wait()
            self.written.append(request)

        async def read(self) -> None:
            await asyncio.Event().wait()

        def cancel(self) -> None:
            pass

    async def run() -> list[pb.FollowRequest]:
        stream = Stream()
        channel = SimpleNamespace(stream_stream=lambda *_a, **_k: lambda metadata: stream)
        call = _Call(SimpleNamespace(router=SimpleNamespace(channel=lambda _address: channel, metadata=())), "node")
        call.send(pb.FollowRequest(start=pb.FollowStart(id=1, credit=5)))
        await asyncio.sleep(0.01)  # the start is being written
        for sid in range(1, 11):
            call.send(pb.FollowRequest(credit=pb.FollowCredit(id=sid, messages=5)))
        call.send(pb.FollowRequest(cancel=3))
        call.send(pb.FollowRequest(credit=pb.FollowCredit(id=4, messages=5)))
        stream.gate.set()
        for _ in range(100):
            if len(stream.written) == 4:
                break
            await asyncio.sleep(0.01)
        call.close()
        return stream.written

    written = asyncio.run(run())
    assert [r.WhichOneof("kind") for r in written] == ["start", "credit", "cancel", "credit"]
    merged = written[1].credit
    assert (merged.id, list(merged.also), merged.messages) == (1, list(range(2, 11)), 5)
    assert written[3].credit.id == 4 and not written[3].credit.also, "a credit never overtakes a cancel"
