"""Push subscriptions and the MQTT 5 Message Expiry Interval, without a cluster: the replica's feed and the shared
catch-up reads keep each message's answer part, and hand out a message with an interval with what is left of it,
or not at all once it ended, at each read's clock; a subscriber reading page by page gets exactly that, however
the pages fall (``cluster/expiring.py``). The cluster tests are in test_message_expiry.py."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from storage_support import msg

from mqds.server.cluster.catchup import CatchUp
from mqds.server.cluster.feed import ShardFeed
from mqds.server.wire import FOLLOW_RESPONSE_MESSAGES_TAG
from mqds.v1 import storage_pb2 as pb

SHARD = 3
S = 1_000_000
TOPICS = ("a/x", "a/y", "b/x")
FILTER, LEVELS = "a/+", ["a", "+"]

# A message: its topic and its interval (mostly none, some short, some long).
messages = st.tuples(st.sampled_from(TOPICS), st.sampled_from([0, 0, 0, 1, 2, 5]))


def stored_message(ts: int, topic: str, expiry_s: int) -> bytes:
    m = msg(topic, f"{ts}".encode())
    m.message_expiry_s = expiry_s
    return m.SerializeToString()


def expected(stored: dict[int, tuple[str, int]], position: int, now_us: int) -> list[tuple[int, int]]:
    """The model: every matching message after ``position`` whose interval has not ended, with what is left of
    it rounded up (never more than the interval): (timestamp, interval sent)."""
    out = []
    for ts, (topic, expiry_s) in sorted(stored.items()):
        if ts <= position or not topic.startswith("a/"):
            continue
        if not expiry_s:
            out.append((ts, 0))
            continue
        left_us = ts + expiry_s * S - now_us
        if left_us > 0:
            out.append((ts, min(expiry_s, math.ceil(left_us / S))))
    return out


def decoded(pieces: list[bytes]) -> list[tuple[int, int]]:
    got = pb.FollowResponse.FromString(b"".join(pieces)).messages
    assert all(m.shard == SHARD and int(m.payload) == m.timestamp_us for m in got)
    return [(m.timestamp_us, m.message_expiry_s) for m in got]


@settings(max_examples=200, deadline=None)
@given(
    batches=st.lists(st.lists(messages, min_size=1, max_size=6), min_size=1, max_size=6),
    gap_us=st.integers(1, 3 * S),
    now_us=st.integers(0, 7 * S),
    limit=st.integers(1, 7),
    position=st.integers(0, 4),
)
def test_the_feed_hands_out_what_is_left_of_each_interval_and_nothing_expired(
    batches: list[list[tuple[str, int]]], gap_us: int, now_us: int, limit: int, position: int
) -> None:
    feed = ShardFeed(SHARD, 1 << 20)
    feed.listen(lambda: None, lambda: 0)
    stored: dict[int, tuple[str, int]] = {}
    first = 1
    for batch in batches:
        encoded = [stored_message(first + i, topic, expiry_s) for i, (topic, expiry_s) in enumerate(batch)]
        feed.append(first, [pb.Message.FromString(e) for e in encoded], encoded)
        stored.update({first + i: m for i, m in enumerate(batch)})
        first += len(batch) + gap_us  # stores far apart in time: some of a read's messages expired, some not
    got: list[tuple[int, int]] = []
    start = position
    for _ in range(len(stored) + 1):  # page by page, each from the position the last one reached
        answer = feed.read_after(position, FILTER, LEVELS, limit, None, now_us=now_us)
        assert answer is not None
        pieces, reached = answer
        assert len(pieces) <= limit and reached >= position
        got += decoded(pieces)
        if reached == position:
            break
        position = reached
    assert got == expected(stored, start, now_us)


@settings(max_examples=200, deadline=None)
@given(
    spread=st.lists(st.tuples(st.sampled_from(["a/x", "a/y"]), st.sampled_from([0, 0, 1, 3])), min_size=1, max_size=30),
    now_us=st.integers(0, 5 * S),
    limit=st.integers(1, 9),
    chunk=st.integers(1, 12),
)
def test_the_catch_up_reads_hand_out_what_is_left_of_each_interval_and_nothing_expired(
    spread: list[tuple[str, int]], now_us: int, limit: int, chunk: int
) -> None:
    stored = {(i + 1) * S // 4: m for i, m in enumerate(spread)}  # a message every quarter of a second
    on_disk = {ts: stored_message(ts, topic, expiry_s) for ts, (topic, expiry_s) in stored.items()}
    last = max(stored)

    def load(after_us: int, count: int) -> tuple[list[tuple[int, bytes]], int]:
        found = [(ts, value) for ts, value in sorted(on_disk.items()) if ts > after_us][:count]
        return found, found[-1][0] if len(found) == count else last

    catchup = CatchUp(SHARD, 1 << 20, FOLLOW_RESPONSE_MESSAGES_TAG)
    for reader in range(2):  # the second reader is served from the segments the first one's reads left
        got: list[tuple[int, int]] = []
        position = 0
        while position < last:
            pieces, reached = catchup.read(FILTER, position, limit, None, load, chunk, now_us=now_us + reader)
            assert len(pieces) <= limit and reached > position
            got += decoded(pieces)
            position = reached
        assert got == expected(stored, 0, now_us + reader)


def test_a_kept_part_read_within_a_second_of_its_store_is_served_as_kept() -> None:
    """A real-time subscriber takes a message right after it was stored: what is left of its interval is all of
    it, and the feed joins the bytes it kept, as for a message without one (no part made again)."""
    feed = ShardFeed(SHARD, 1 << 20)
    feed.listen(lambda: None, lambda: 0)
    first = 10 * S
    encoded = [stored_message(first, "a/x", 30), stored_message(first + 1, "a/y", 0)]
    feed.append(first, [pb.Message.FromString(e) for e in encoded], encoded)
    one = feed.read_after(0, FILTER, LEVELS, 10, None, now_us=first + S // 2)
    again = feed.read_after(0, FILTER, LEVELS, 10, None, now_us=first + S // 2)
    assert one is not None and again is not None
    assert decoded(one[0]) == [(first, 30), (first + 1, 0)]
    assert all(a is b for a, b in zip(one[0], again[0], strict=True)), "the kept parts themselves"
    later = feed.read_after(0, FILTER, LEVELS, 10, None, now_us=first + 12 * S)
    assert later is not None and decoded(later[0]) == [(first, 18), (first + 1, 0)]
    gone = feed.read_after(0, FILTER, LEVELS, 10, None, now_us=first + 30 * S)
    assert gone is not None and decoded(gone[0]) == [(first + 1, 0)] and gone[1] == first + 1
