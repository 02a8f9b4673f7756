"""What the node keeps between push answers, against plain models: the feed's reads (a whole batch taken at
once when it fits), a cohort's least and most credit (kept, not walked for every answer), and credit granted
to a whole cohort at once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis import given, settings
from hypothesis import strategies as st
from storage_support import msg

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.api.follow import FollowLimits, _Call
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
        indexes, pieces, _, _ = part.matching(FILTER, LEVELS, 3)
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
        st.tuples(st.just("grant_all"), st.integers(1, 30)),
        st.tuples(st.just("send"), st.integers(1, 20)),
    ),
    max_size=60,
)


@given(OPS)
def test_a_cohorts_credits_are_what_was_granted_and_sent(ops: list[tuple[int | str, ...]]) -> None:
    """Each member's credit, and the cohort's least and most, against a plain count per member: what it came
    with, plus its grants and the cohort's grants to all, less what the cohort sent."""
    start = pb.FollowStart(topic_filter=FILTER, shard=3, credit=1, shared_answers=True)
    cohort = Cohort(start, LEVELS, 0, True)
    model: dict[int, int] = {}
    ids = iter(range(1, 1_000))
    for op in ops:
        members = list(cohort.members.values())
        if op[0] == "add":
            sub = FollowSub(pb.FollowStart(id=(sub_id := next(ids)), credit=1), sub_id)
            cohort.add(sub, int(op[1]))
            model[sub.id] = int(op[1])
        elif op[0] == "remove" and members:
            sub = members[int(op[1]) % len(members)]
            assert cohort.remove(sub) == model.pop(sub.id)
        elif op[0] == "grant" and members:
            sub = members[int(op[1]) % len(members)]
            cohort.grant(sub, int(op[2]))
            model[sub.id] += int(op[2])
        elif op[0] == "grant_all" and members:
            waited = cohort.grant_all(int(op[1]))
            assert waited == (min(model.values()) <= 0)
            model = {sid: credit + int(op[1]) for sid, credit in model.items()}
        elif op[0] == "send":
            cohort.sent += int(op[1])
            model = {sid: credit - int(op[1]) for sid, credit in model.items()}
        assert {sub.id: sub.limit_at - cohort.sent for sub in cohort.members.values()} == model
        if model:
            assert cohort.credits() == (min(model.values()), max(model.values()))
            named = list(model)  # in the order they joined, as an answer names them
            assert cohort.names_all(named[0], named[1:])
            assert cohort.names_all(named[-1], named[-2::-1])  # in any order
            assert not cohort.names_all(named[0], [*named[1:], named[0]])  # one named twice
            if len(named) > 1:
                assert not cohort.names_all(named[0], [*named[1:-1], named[0]])  # one twice, one left out
                assert not cohort.names_all(named[0], [*named[1:-1], 10**6])  # one unknown


@st.composite
def credit_requests(draw: st.DrawFn) -> tuple[list[list[int]], list[int], list[int], int]:
    """Cohorts' members' credits, subscriptions not begun yet, the ids a credit request names, its messages."""
    cohorts = draw(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=3))
    waiting = draw(st.lists(st.integers(1, 5), max_size=3))
    n_members = sum(map(len, cohorts))
    known = list(range(1, n_members + len(waiting) + 1))
    first_cohort = list(range(1, len(cohorts[0]) + 1))
    ids = draw(
        st.permutations(first_cohort)  # what a client sends back for a shared answer: the cohort, in any order
        | st.lists(st.sampled_from([*known, 900]), min_size=1, max_size=12)  # any mix, repeats, an unknown id
    )
    return cohorts, waiting, ids, draw(st.integers(1, 20))


@given(credit_requests())
def test_a_credit_request_grants_each_id_it_names_whether_it_names_a_whole_cohort_or_not(
    case: tuple[list[list[int]], list[int], list[int], int],
) -> None:
    """``_Call._take`` grants a request naming a whole cohort to the cohort at once: the credits, and which
    cohorts are served again (one of whose named members had none left), as granting each id in turn."""
    cohorts, waiting, ids, messages = case
    call = _Call(None, FollowLimits(), None, None)  # type: ignore[arg-type]  # credit needs no shards
    sid = iter(range(1, 1_000))
    made: list[Cohort] = []
    for credits in cohorts:
        cohort = Cohort(pb.FollowStart(topic_filter=FILTER, shard=3, credit=1, shared_answers=True), LEVELS, 0, True)
        cohort.sent = 7
        for credit in credits:
            sub = call.subs[sub_id] = FollowSub(pb.FollowStart(id=(sub_id := next(sid)), credit=1), sub_id)
            cohort.add(sub, credit)
        made.append(cohort)
    for credit in waiting:
        call.subs[sub_id] = FollowSub(pb.FollowStart(id=(sub_id := next(sid)), credit=credit), sub_id)

    def credit_of(sub: FollowSub) -> int:
        return sub.limit_at if sub.cohort is None else sub.limit_at - sub.cohort.sent

    expected = {i: credit_of(sub) for i, sub in call.subs.items()}
    touched = set()
    for i in ids:  # the reference: each id in turn
        if i in expected:
            sub = call.subs[i]
            if sub.cohort is not None and expected[i] <= 0:
                touched.add(id(sub.cohort))
            expected[i] += messages
    call._take(pb.FollowRequest(credit=pb.FollowCredit(id=ids[0], also=ids[1:], messages=messages)))
    assert {i: credit_of(sub) for i, sub in call.subs.items()} == expected
    assert {id(c) for c in call.touched} == touched
    for cohort in made:
        credits = [credit_of(sub) for sub in cohort.members.values()]
        assert cohort.credits() == (min(credits), max(credits))


class _NoShards:
    n_shards = 4


@given(
    st.lists(st.integers(1, 30), max_size=6, unique=True),
    st.lists(st.integers(1, 30), min_size=1, max_size=12),
    st.booleans(),
    st.integers(1, 9),
)
def test_a_start_naming_many_subscriptions_starts_each_or_none(
    in_use: list[int], ids: list[int], shared: bool, credit: int
) -> None:
    """``FollowStart.also``: every id named becomes a subscription with the start's credit, in one cohort when
    they share answers (else one each); an id named twice or already in use, or too many for the call, and
    the call ends with INVALID_REQUEST having started none of them."""
    limits = FollowLimits(max_subscriptions=15)
    call = _Call(_NoShards(), limits, None, lambda: 0)  # type: ignore[arg-type]
    for i in in_use:
        call._take(pb.FollowRequest(start=pb.FollowStart(id=i, topic_filter=FILTER, credit=1)))
    before = dict(call.subs)
    start = pb.FollowStart(id=ids[0], also=ids[1:], topic_filter=FILTER, shard=2, credit=credit, shared_answers=shared)
    refused = len(set(ids)) < len(ids) or bool(set(ids) & set(in_use)) or len(in_use) + len(ids) > 15
    try:
        call._take(pb.FollowRequest(start=start))
    except MqdsError as err:
        assert refused and err.reason == Reason.INVALID_REQUEST
        assert call.subs == before
        return
    assert not refused
    assert list(call.subs) == [*in_use, *ids]
    group = call.new[-1]
    assert [sub.id for sub in group] == ids
    cohorts, failures = call._begin(group)
    assert not failures
    assert len(cohorts) == (1 if shared else len(ids))
    assert sorted(i for c in cohorts for i in c.members) == sorted(ids)
    assert all(c.credits() == (credit, credit) and c.shard == 2 for c in cohorts)


def test_a_start_naming_many_that_cannot_be_served_fails_for_each() -> None:
    call = _Call(_NoShards(), FollowLimits(), None, lambda: 0)  # type: ignore[arg-type]
    call._take(pb.FollowRequest(start=pb.FollowStart(id=5, also=[6, 7], topic_filter="a/#/b", credit=1)))
    cohorts, failures = call._begin(call.new[-1])
    answers = [pb.FollowResponse.FromString(f) for f in failures]
    assert not cohorts
    assert [(a.id, a.failure.reason) for a in answers] == [(i, "INVALID_TOPIC_FILTER") for i in (5, 6, 7)]


class _OneFeed:
    """One shard's replica with a live feed, as the call reads it: a leader, its feed, its last timestamp."""

    n_shards = 4

    def __init__(self) -> None:
        self.feed = ShardFeed(3, 1 << 20)
        self.last_ts = 0
        self.replica = self
        self.group = self
        self.is_leader = True

    def vnode(self, shard: int) -> _OneFeed:
        return self

    @contextmanager
    def reading(self) -> Iterator[_OneFeed]:
        yield self  # as storage: only last_ts is read while the feed has what is asked

    def store(self, count: int) -> None:
        messages = [msg("a/x", f"{self.last_ts + 1 + i}".encode()) for i in range(count)]
        self.feed.append(self.last_ts + 1, messages, [m.SerializeToString() for m in messages])
        self.last_ts += count


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=40), st.integers(1, 10))
def test_members_short_of_an_answer_split_off_in_one_cohort_for_each_credit(credits: list[int], stored: int) -> None:
    """A read that some members' credit does not cover: each member gets what its credit allows, in order,
    and the answers are one for each credit held (the members whose credit covers the read, and one for each
    smaller credit), never one for each member short of it; granted enough, they meet again where the feed
    ends and are one cohort. (With one answer for each member short of credit, a grant in flight for 50
    members of one call cost 5x the messages on the wire.)"""
    shards = _OneFeed()
    call = _Call(shards, FollowLimits(), None, lambda: 0)  # type: ignore[arg-type]
    start = pb.FollowStart(topic_filter=FILTER, shard=3, credit=1, shared_answers=True, stale_ok=True)
    cohort = Cohort(start, LEVELS, 0, True)
    for sid, credit in enumerate(credits, 1):
        cohort.add(FollowSub(start, sid), credit)
        call.subs[sid] = cohort.members[sid]
    call.cohorts.add(cohort)
    assert call._serve_cohort(cohort) == []  # nothing stored yet: it listens to the feed
    shards.store(stored)
    answers = [pb.FollowResponse.FromString(answer) for answer, _ in call._serve_cohort(cohort)]
    got: dict[int, list[bytes]] = {sid: [] for sid in call.subs}
    for answer in answers:
        for sid in (answer.id, *answer.also):
            got[sid] += [m.payload for m in answer.messages]
    assert got == {sid: [f"{i}".encode() for i in range(1, min(c, stored) + 1)] for sid, c in enumerate(credits, 1)}
    assert len(answers) == len({min(c, stored) for c in credits})
    for sid in call.subs:
        call._take(pb.FollowRequest(credit=pb.FollowCredit(id=sid, messages=stored)))
    for each in list(call.cohorts):
        if each.members:
            call._serve_cohort(each)
    assert len([c for c in call.cohorts if c.members]) == 1
    assert all(sub.cohort is not None and sub.cohort.position == stored for sub in call.subs.values())
