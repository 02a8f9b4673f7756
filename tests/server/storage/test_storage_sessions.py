"""The broker state of one shard in the storage layer: offline fetches, retained lookups, queue marks, restarts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mqds.protocol.topics import matches
from mqds.server.storage import keys
from mqds.server.storage.expiry import NEVER
from mqds.server.storage.sessions import FetchFilter
from mqds.server.storage.shard import Engine, ShardStorage
from mqds.v1 import storage_pb2 as pb

SHARD_NUMBER = 3  # the conftest shard fixture opens this shard


def msg(topic: str, payload: str, qos: int = 1) -> pb.Message:
    return pb.Message(topic=topic, payload=payload.encode(), sender="s", qos=qos)


def wanted(topic_filter: str, **kwargs: object) -> FetchFilter:
    options: dict[str, object] = {
        "after_us": 0,
        "since_us": 0,
        "max_count": 1000,
        "include_qos0": False,
        "skip_acked": False,
    }
    options.update(kwargs)
    return FetchFilter(topic_filter=topic_filter, **options)  # type: ignore[arg-type]


def fetched(storage: ShardStorage, want: FetchFilter) -> list[str]:
    return [pb.Message.FromString(stored).payload.decode() for _, stored in storage.sessions.fetch(want)]


def test_fetch_merges_streams_by_time_across_generations_and_honours_the_count(shard: ShardStorage) -> None:
    # Two topic structures (two streams) interleaved, then a new generation.
    shard.store([msg("a/x", "1"), msg("b/y/z", "2"), msg("a/x", "3")], 100)
    shard.store([msg("b/y/z", "4"), msg("a/x", "5", qos=0)], 200)
    shard.add_generation(300)
    shard.store([msg("a/x", "6"), msg("b/y/z", "7")], 400)
    assert fetched(shard, wanted("#")) == ["1", "2", "3", "4", "6", "7"]
    assert fetched(shard, wanted("#", include_qos0=True)) == ["1", "2", "3", "4", "5", "6", "7"]
    assert fetched(shard, wanted("#", max_count=4)) == ["1", "2", "3", "4"]
    assert fetched(shard, wanted("b/#")) == ["2", "4", "7"]
    # After a position: strictly later timestamps only.
    assert fetched(shard, wanted("#", after_us=102)) == ["4", "6", "7"]
    # A time range: at or after since_us, from whatever generation holds it.
    assert fetched(shard, wanted("#", since_us=400)) == ["6", "7"]


def test_a_fetch_holds_at_most_its_byte_budget_and_one_message_at_least(shard: ShardStorage) -> None:
    """The node built a whole FetchMessages answer (up to max_count messages of each shard, 1 MiB each)
    before cutting it to max_answer_bytes."""
    shard.store([msg("big/a", str(i) * 1000) for i in range(10)], 100)
    size = len(shard.sessions.fetch(wanted("big/#", max_count=1))[0][1])
    assert fetched(shard, wanted("big/#", max_bytes=3 * size)) == [str(i) * 1000 for i in range(3)]
    assert fetched(shard, wanted("big/#", max_bytes=1)) == ["0" * 1000]
    assert len(fetched(shard, wanted("big/#", max_bytes=None))) == 10


def test_queue_marks_skip_messages_and_go_with_their_generation(shard: ShardStorage) -> None:
    first = shard.store([msg("q/a", "1"), msg("q/a", "2")], 100)
    shard.sessions.ack_queue(first, "q/#")
    assert fetched(shard, wanted("q/#", skip_acked=True)) == ["2"]
    assert fetched(shard, wanted("q/#")) == ["1", "2"]
    shard.add_generation(200)
    later = shard.store([msg("q/a", "3")], 300)
    shard.sessions.ack_queue(later, "q/#")
    assert fetched(shard, wanted("q/#", skip_acked=True)) == ["2"]
    shard.drop_generation(1)
    marks = [key for key, _ in shard.meta_scan(keys.QUEUE_ACK_PREFIX)]
    assert marks == [keys.queue_ack_key(later)], "the dropped generation's marks must go, the current one's stay"


def test_the_queue_floor_moves_over_acknowledged_messages_at_the_head_only(shard: ShardStorage) -> None:
    first = shard.store([msg("jobs/a", "0"), msg("jobs/b/x", "1"), msg("jobs/a", "2"), msg("jobs/a", "3")], 100)
    sessions = shard.sessions
    sessions.ack_queue(first + 2, "jobs/#")  # out of order: the head (0, 1) is not acknowledged
    assert sessions.queue_floor("jobs/#") == 0
    sessions.ack_queue(first, "jobs/#")
    assert sessions.queue_floor("jobs/#") == first
    sessions.ack_queue(first + 1, "jobs/#")  # closes the gap: the floor jumps over 2 as well
    assert sessions.queue_floor("jobs/#") == first + 2
    assert fetched(shard, wanted("jobs/#", skip_acked=True)) == ["3"]
    # Floors are per filter: another filter over the same messages scans its own way.
    assert sessions.queue_floor("jobs/a") == 0
    assert fetched(shard, wanted("jobs/a", skip_acked=True)) == ["3"]
    # New messages after the floor are offered.
    shard.store([msg("jobs/a", "4")], 200)
    assert fetched(shard, wanted("jobs/#", skip_acked=True)) == ["3", "4"]


def test_broker_state_survives_a_restart(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "shard")
    storage = ShardStorage(path, 1, engine)
    storage.initialize(1)
    storage.sessions.client_connected("c1", "b1", 10, applied_index=5)
    storage.sessions.subscribe("c1", "t/#", 2, applied_index=6)
    storage.sessions.retain(msg("t/1", "r"), 11, applied_index=7)
    storage.sessions.ack_pubsub("c1", "t/#", 4, 99, applied_index=8)
    storage.sessions.ack_pubsub("c1", "t/#", 4, 50, applied_index=9)  # never moves back
    storage.close()
    storage = ShardStorage(path, 1, engine)
    try:
        assert storage.applied_index == 9
        state = storage.sessions.client_state("c1")
        assert state is not None and state.online and state.node == "b1" and state.online_at_us == 10
        assert storage.sessions.clients_on_node("b1") == ["c1"]
        assert storage.sessions.subscriptions("c1") == [("t/#", 2)]
        (retained,) = storage.sessions.retained(["t", "+"], 12)
        assert pb.Message.FromString(retained).timestamp_us == 11
        position = storage.sessions.read_position("c1", "t/#")
        assert position is not None and dict(position.acked_us) == {4: 99}
    finally:
        storage.close()


def test_a_started_read_position_keeps_its_start_and_acknowledgements(shard: ShardStorage) -> None:
    sessions = shard.sessions
    started, position = sessions.start_position("c1", "t/#", 500)
    assert started and position.start_us == 500 and dict(position.acked_us) == {}
    sessions.ack_pubsub("c1", "t/#", 3, 700)
    # A second start (a re-subscribe) leaves the position as it is: its flow goes on.
    started, position = sessions.start_position("c1", "t/#", 900)
    assert not started and position.start_us == 500 and dict(position.acked_us) == {3: 700}
    # An acknowledgement's position (no start) is not started over either.
    sessions.ack_pubsub("c1", "u/#", 3, 10)
    started, position = sessions.start_position("c1", "u/#", 900)
    assert not started and position.start_us == 0 and dict(position.acked_us) == {3: 10}


def test_forgetting_a_session_deletes_its_subscriptions_and_positions_only(shard: ShardStorage) -> None:
    sessions = shard.sessions
    for clientid in ("c1", "c10"):  # c10's keys start with c1's bytes but not its sized prefix
        sessions.client_connected(clientid, "b1", 10)
        sessions.subscribe(clientid, "t/#", 1)
        sessions.subscribe(clientid, "u/+", 2)
        sessions.start_position(clientid, "t/#", 20)
    sessions.ack_pubsub("c1", "v", 3, 30)
    assert sessions.forget_session("c1") == (2, 2)
    assert sessions.subscriptions("c1") == [] and sessions.read_position("c1", "t/#") is None
    assert sessions.read_position("c1", "v") is None
    state = sessions.client_state("c1")
    assert state is not None and state.online  # the client state stays
    assert sessions.subscriptions("c10") == [("t/#", 1), ("u/+", 2)]
    assert sessions.read_position("c10", "t/#") is not None
    assert sessions.forget_session("c1") == (0, 0)


TOPIC_LEVEL = st.sampled_from(["a", "b", "ab", "$SYS", "x y", "é"])
TOPICS = st.lists(TOPIC_LEVEL, min_size=1, max_size=4).map("/".join)
FILTER_LEVEL = st.sampled_from(["a", "b", "ab", "$SYS", "+", "é"])


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(FILTER_LEVEL, min_size=1, max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(topics=st.sets(TOPICS, max_size=12), topic_filter=filters())
def test_retained_lookup_equals_matching_every_topic(
    tmp_path_factory: pytest.TempPathFactory, engine: Engine, topics: set[str], topic_filter: str
) -> None:
    storage = ShardStorage(str(tmp_path_factory.mktemp("retained") / "shard"), 0, engine)
    try:
        for topic in topics:
            storage.sessions.retain(msg(topic, topic), 1)
        found = [pb.Message.FromString(m).topic for m in storage.sessions.retained(topic_filter.split("/"), 2)]
        assert found == sorted((t for t in topics if matches(topic_filter, t)), key=lambda t: t.encode())
    finally:
        storage.close()


def test_a_fetch_never_returns_a_later_message_without_an_earlier_one_stored_meanwhile(shard: ShardStorage) -> None:
    """A store landing during a fetch may start a stream the fetch did not list; its later messages must wait.

    Found by the chaos run: a pubsub consumer acknowledged a message the
    fetch read from a listed stream, stored after a batch that had started a
    new stream, and so moved its read position past that batch for good.
    """
    shard.store([msg("old/a", str(i)) for i in range(600)], 100)  # more than one read chunk
    reading = shard.sessions._ordered("#", 0)
    first = next(reading)
    shard.store([msg("brand/new/stream", "B")], 1_000)  # a stream the fetch did not list
    shard.store([msg("old/a", "C")], 2_000)  # later, in a listed stream
    rest = [pb.Message.FromString(stored).payload.decode() for _, stored in reading]
    assert pb.Message.FromString(first[1]).payload == b"0"
    assert "C" not in rest and len(rest) == 599
    # The next fetch sees both, in order.
    assert fetched(shard, wanted("#", after_us=100 + 599))[-2:] == ["B", "C"]


def _retained(storage: ShardStorage, topic_filter: str, now_us: int) -> dict[str, str]:
    return {
        m.topic: m.payload.decode()
        for m in map(pb.Message.FromString, storage.sessions.retained(topic_filter.split("/"), now_us))
    }


def test_an_expired_retained_message_is_no_longer_returned_and_is_removed_in_bounded_steps(
    shard: ShardStorage,
) -> None:
    """MQTT 5 Message Expiry Interval on retained messages: hidden once due, removed by expire."""
    sessions = shard.sessions
    second = 1_000_000
    for i in range(5):
        expiring = msg(f"e/{i}", f"e{i}")
        expiring.message_expiry_s = 1 + i  # due at 10 s + (1 + i) s
        sessions.retain(expiring, 10 * second)
    sessions.retain(msg("e/kept", "forever"), 10 * second)
    assert len(_retained(shard, "e/#", 10 * second)) == 6
    assert not sessions.expiry_due(11 * second - 1)
    # Due but not removed yet: already left out.
    assert sessions.expiry_due(13 * second)
    assert _retained(shard, "e/#", 13 * second) == {"e/3": "e3", "e/4": "e4", "e/kept": "forever"}
    # A step removes the earliest ones, at most max_count.
    assert sessions.expire(13 * second, 2) == (2, 0)
    assert sessions.expiry_due(13 * second)
    assert sessions.expire(13 * second, 1000) == (1, 0)
    assert not sessions.expiry_due(13 * second)
    assert sorted(k for k, _ in shard.meta_scan(keys.RETAINED_PREFIX)) == [
        keys.retained_key(t) for t in ("e/3", "e/4", "e/kept")
    ]
    assert sessions.expire(10**15, 1000) == (2, 0)
    assert _retained(shard, "e/#", 10**15) == {"e/kept": "forever"}
    assert list(shard.meta_scan(keys.RETAINED_EXPIRY_PREFIX)) == []


def test_replacing_or_deleting_a_retained_message_replaces_its_expiry(shard: ShardStorage) -> None:
    sessions = shard.sessions
    second = 1_000_000
    first = msg("r/1", "old")
    first.message_expiry_s = 5
    sessions.retain(first, 0)
    sessions.retain(msg("r/1", "new, no expiry"), 1 * second)
    # The old expiry went with the old message: the new one stays.
    assert not sessions.expiry_due(10**15)
    assert sessions.expire(10**15, 1000) == (0, 0)
    assert _retained(shard, "r/1", 10**15) == {"r/1": "new, no expiry"}
    later = msg("r/1", "expires")
    later.message_expiry_s = 5
    sessions.retain(later, 2 * second)
    sessions.retain(msg("r/1", ""), 3 * second)  # deleted: its index entry too
    assert list(shard.meta_scan(keys.RETAINED_EXPIRY_PREFIX)) == []
    assert _retained(shard, "r/#", 3 * second) == {}


def _session_keys(shard: ShardStorage, clientid: str) -> list[bytes]:
    prefixes = (keys.client_key(clientid), keys.subscriptions_prefix(clientid), keys.positions_prefix(clientid))
    return [k for prefix in prefixes for k, _ in shard.meta_scan(prefix)]


def test_a_session_ends_its_expiry_interval_after_the_client_disconnects(shard: ShardStorage) -> None:
    """State, subscriptions and read positions removed once due; a reconnect in time keeps them; NEVER never."""
    sessions = shard.sessions
    second = 1_000_000
    for clientid, expiry in (("c-short", 5), ("c-zero", 0), ("c-never", NEVER), ("c-back", 5)):
        sessions.client_connected(clientid, "broker-1", 1 * second, expiry)
        sessions.subscribe(clientid, "t/#", 1)
        sessions.start_position(clientid, "t/#", 1 * second)
    assert not sessions.expiry_due(10**15)  # all online: nothing waits to expire
    for clientid in ("c-short", "c-zero", "c-never", "c-back"):
        state = sessions.client_disconnected(clientid, "broker-1", 10 * second)
        assert state is not None
    assert sessions.client_state("c-short").expires_at_us == 15 * second
    assert sessions.client_state("c-never").expires_at_us == 0
    assert sessions.expiry_due(10 * second)  # c-zero: at the disconnect
    # c-back reconnects in time: its session goes on.
    sessions.client_connected("c-back", "broker-2", 12 * second, 5)
    assert sessions.expire(12 * second, 1000) == (0, 1)
    assert _session_keys(shard, "c-zero") == []
    assert len(_session_keys(shard, "c-short")) == 3
    assert not sessions.expiry_due(15 * second - 1)
    assert sessions.expire(15 * second, 1000) == (0, 1)
    assert _session_keys(shard, "c-short") == [] and sessions.client_state("c-short") is None
    assert len(_session_keys(shard, "c-never")) == 3 and len(_session_keys(shard, "c-back")) == 3
    assert sessions.expire(10**15, 1000) == (0, 0)
    assert list(shard.meta_scan(keys.SESSION_EXPIRY_PREFIX)) == []


def test_a_disconnect_may_change_the_interval_and_a_late_reconnect_starts_afresh(shard: ShardStorage) -> None:
    sessions = shard.sessions
    second = 1_000_000
    sessions.client_connected("c", "b", 0, NEVER)
    sessions.subscribe("c", "a/b", 1)
    state = sessions.client_disconnected("c", "b", 1 * second, 3)  # MQTT 5's DISCONNECT set 3 s
    assert state is not None and state.session_expiry_s == 3 and state.expires_at_us == 4 * second
    # Due at 4 s, not removed yet, and the client comes back at 5 s: a new session, nothing of the old one.
    fresh = sessions.client_connected("c", "b", 5 * second, 60)
    assert fresh.session_expiry_s == 60
    assert sessions.subscriptions("c") == []
    assert not sessions.expiry_due(10**15)
    assert sessions.client_state("c") is not None


def _files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.suffix in (".sst", ".log"))


def test_the_disk_expired_sessions_took_comes_back(tmp_path: Path, shard: ShardStorage) -> None:
    """Sessions that end give their disk back: their records, their tombstones and RocksDB's log of them.

    Nothing else would: a broker's short-lived clientids write only to the
    metadata family, so no flush or compaction of it would come by itself.
    """
    sessions = shard.sessions
    second = 1_000_000
    shard_dir = tmp_path / "shard"
    baseline = _files_bytes(shard_dir)
    for i in range(6_000):
        clientid = f"soak-{i:06d}-" + "x" * 40
        sessions.client_connected(clientid, "broker-1", 1 * second, 5)
        sessions.subscribe(clientid, f"devices/{i}/#", 1)
        sessions.client_disconnected(clientid, "broker-1", 2 * second)
    loaded = _files_bytes(shard_dir)
    assert loaded > baseline + 1_000_000
    removed = 0
    while step := sessions.expire(10 * second, 1_000)[1]:
        removed += step
    assert removed == 6_000
    deadline = time.monotonic() + 30
    while _files_bytes(shard_dir) > baseline + 200_000 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _files_bytes(shard_dir) <= baseline + 200_000, (baseline, loaded, _files_bytes(shard_dir))
