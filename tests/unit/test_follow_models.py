"""What the node keeps between push answers, against plain models: the feed's reads (a whole batch taken at
once when it fits) and a cohort's least and most credit (kept, not walked for every answer)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from storage_support import msg

from mqds.server.api.follow_cohort import Cohort, FollowSub
from mqds.server.cluster.feed import FeedPart, ShardFeed
from mqds.v1 import storage_pb2 as pb

TOPICS = ("a/x", "a/y", "b/x")
FILTER, LEVELS = "a/+", ["a", "+"]


def reference_read(parts: list[FeedPart], position: int, limit: int, budget: int | None) -> tuple[list[bytes], int]:
    """A message at a time, as the feed read before it took whole batches."""
    found: list[bytes] = []
    size, reached = 0, position
    for part in parts:
        if part.last <= position:
            continue
        indexes, pieces, _ = part.matching(FILTER, LEVELS, 3)
        for index, piece in zip(indexes, pieces, strict=True):
            ts = part.first + index
            if ts <= position:
                continue
            if found and budget is not None and size + len(piece) > budget:
                return found, reached
            found.append(piece)
            size += len(piece)
            reached = ts
            if len(found) >= limit:
                return found, ts
        reached = max(reached, part.last)
    return found, reached


@settings(max_examples=300, deadline=None)
@given(
    batches=st.lists(st.lists(st.sampled_from(TOPICS), min_size=1, max_size=6), min_size=1, max_size=6),
    data=st.data(),
)
def test_the_feed_reads_as_a_message_at_a_time_would(batches: list[list[str]], data: st.DataObject) -> None:
    feed = ShardFeed(3, 1 << 20)
    feed.listen(lambda: None, lambda: 0)
    first = 1
    for topics in batches:
        messages = [msg(t, f"{first + i}".encode()) for i, t in enumerate(topics)]
        feed.append(first, messages, [m.SerializeToString() for m in messages])
        first += len(topics) + data.draw(st.integers(0, 2))  # timestamps may skip between stores
    position = data.draw(st.integers(0, first))
    limit = data.draw(st.integers(1, 12))
    budget = data.draw(st.none() | st.integers(1, 400))
    got = feed.read_after(position, FILTER, LEVELS, limit, budget)
    assert got == reference_read(list(feed._parts), position, limit, budget)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 50)),
        st.tuples(st.just("remove"), st.integers(0, 100)),
        st.tuples(st.just("grant"), st.integers(0, 100), st.integers(1, 30)),
        st.tuples(st.just("send"), st.integers(1, 20)),
    ),
    max_size=60,
)


@given(OPS)
def test_a_cohorts_least_and_most_credit_are_its_members(ops: list[tuple[int | str, ...]]) -> None:
    start = pb.FollowStart(topic_filter=FILTER, shard=3, credit=1, shared_answers=True)
    cohort = Cohort(start, LEVELS, 0, True)
    ids = iter(range(1, 1_000))
    for op in ops:
        members = list(cohort.members.values())
        if op[0] == "add":
            cohort.add(FollowSub(pb.FollowStart(id=next(ids), credit=1)), int(op[1]))
        elif op[0] == "remove" and members:
            cohort.remove(members[int(op[1]) % len(members)])
        elif op[0] == "grant" and members:
            cohort.grant(members[int(op[1]) % len(members)], int(op[2]))
        elif op[0] == "send":
            cohort.sent += int(op[1])
        if cohort.members:
            credits = [sub.limit_at - cohort.sent for sub in cohort.members.values()]
            assert cohort.credits() == (min(credits), max(credits))
