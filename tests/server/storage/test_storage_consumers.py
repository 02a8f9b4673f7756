"""Listing a shard's consumers page by page, and counting how far a position is behind (``mqds consumers``)."""

from __future__ import annotations

import pytest

from mqds.server.storage import consumers as listing
from mqds.server.storage.consumers import ConsumerQuery
from mqds.server.storage.lag import measure
from mqds.server.storage.shard import ShardStorage
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb


def pages(read: object, query: ConsumerQuery) -> tuple[list[object], int]:
    """Every entry over all pages, and how many pages it took."""
    out: list[object] = []
    start = b""
    for count in range(1, 10_000):
        page = read(start, query)  # type: ignore[operator]
        assert len(page.entries) <= query.max_count
        out += page.entries
        if page.next_start is None:
            return out, count
        start = page.next_start
    raise AssertionError("the listing never ended")


def test_pages_list_sessions_and_positions_each_once_whatever_the_page_size(shard: ShardStorage) -> None:
    with_state = [f"c-{i:03d}" for i in range(40)]
    for i, clientid in enumerate(with_state):
        shard.sessions.client_connected(clientid, "node-a", 1_000 + i)
        shard.sessions.subscribe(clientid, f"t/{clientid}/#", 1)
        shard.sessions.start_position(clientid, f"t/{clientid}/#", 2_000 + i)
    subscribed_only = ["s-1", "s-2"]
    for clientid in subscribed_only:
        shard.sessions.subscribe(clientid, "t/#", 0)
        shard.sessions.subscribe(clientid, "u/#", 2)
    consumers = shard.consumers
    for size in (1, 3, 7, 1000):
        sessions, count = pages(consumers.sessions, ConsumerQuery(size))
        names = [s.clientid for s in sessions]  # type: ignore[attr-defined]
        assert names == with_state + subscribed_only and count >= len(names) // size
        assert [s.has_state for s in sessions] == [True] * 40 + [False] * 2  # type: ignore[attr-defined]
        positions, _ = pages(consumers.positions, ConsumerQuery(size))
        assert [p[0] for p in positions] == with_state  # type: ignore[index]
    last = sessions[-1]
    assert [(s.topic_filter, s.qos) for s in last.subscriptions] == [("t/#", 0), ("u/#", 2)]  # type: ignore[attr-defined]
    narrowed, _ = pages(consumers.sessions, ConsumerQuery(5, clientid_prefix="c-01"))
    assert [s.clientid for s in narrowed] == [f"c-01{i}" for i in range(10)]  # type: ignore[attr-defined]
    (one,), _ = pages(consumers.positions, ConsumerQuery(5, clientid="c-007"))
    assert one[:2] == ("c-007", "t/c-007/#") and one[2].start_us == 2_007  # type: ignore[index]


def test_a_page_stops_after_max_keys_looked_at_and_goes_on_from_there(
    shard: ShardStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(30):
        shard.sessions.ack_pubsub(f"x-{i:02d}", "f/#", 3, 10 + i)
    shard.sessions.ack_pubsub("wanted", "f/#", 3, 99)
    monkeypatch.setattr(listing, "MAX_KEYS", 4)
    found, count = pages(shard.consumers.positions, ConsumerQuery(10, clientid_prefix="wanted"))
    assert [p[0] for p in found] == ["wanted"] and count >= 30 // 4  # type: ignore[index]


def test_share_groups_list_their_live_members_and_position(shard: ShardStorage) -> None:
    now = 5_000_000
    for group in ("g1", "g2", "g3"):
        shard.share_groups.join(group, "jobs/#", "m-a", 10, now, applied_index=None)
    shard.share_groups.join("g2", "jobs/#", "m-b", 1, now - 3_000_000, applied_index=None)  # its lease ended
    shard.sessions.ack_pubsub("$share/g2", "jobs/#", 3, 77)
    groups, _ = pages(lambda start, q: shard.consumers.share_groups(start, q, now), ConsumerQuery(1))
    assert [(g.group, g.members) for g in groups] == [("g1", ["m-a"]), ("g2", ["m-a"]), ("g3", ["m-a"])]  # type: ignore[attr-defined]
    g2 = groups[1]
    assert g2.position is not None and dict(g2.position.acked_us) == {3: 77}  # type: ignore[attr-defined]
    assert groups[0].position is None  # type: ignore[attr-defined]
    assert listing.ConsumerListing.valid_start(spb.SHARE_GROUPS, b"h:x")
    assert not listing.ConsumerListing.valid_start(spb.SESSIONS, b"h:x")


def test_lag_counts_up_to_its_cap_and_gives_the_oldest_unread(shard: ShardStorage) -> None:
    shard.store([pb.Message(topic="a/b", payload=b"%d" % i, sender="s", qos=1) for i in range(5)], 100)
    shard.store([pb.Message(topic="a/c", payload=b"z", sender="s", qos=0)], 200)
    shard.store([pb.Message(topic="other", payload=b"o", sender="s", qos=1)], 300)
    now = 1_000
    everything = measure(shard, "a/#", 0, 100, now)
    assert (everything.messages, everything.at_least, everything.oldest_us) == (6, False, 100)
    assert measure(shard, "a/#", 0, 100, now, include_qos0=False).messages == 5
    capped = measure(shard, "a/#", 0, 3, now)
    assert (capped.messages, capped.at_least) == (3, True)
    after = measure(shard, "a/#", 102, 100, now)
    assert (after.messages, after.oldest_us) == (3, 103)
    assert measure(shard, "a/#", shard.last_ts, 100, now).messages == 0


def test_lag_leaves_out_messages_whose_expiry_interval_ended(shard: ShardStorage) -> None:
    """No fetch or push hands an expired message out: it is nobody's lag either."""
    shard.store([pb.Message(topic="e/1", payload=b"short", sender="s", qos=1, message_expiry_s=2)], 1_000_000)
    shard.store([pb.Message(topic="e/2", payload=b"kept", sender="s", qos=1)], 1_500_000)
    before = measure(shard, "e/#", 0, 100, 2_000_000)
    assert (before.messages, before.oldest_us) == (2, 1_000_000)
    after = measure(shard, "e/#", 0, 100, 3_000_001)
    assert (after.messages, after.oldest_us) == (1, 1_500_000)
