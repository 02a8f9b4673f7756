"""A shared offline fetch in the storage layer: one scan of a filter gives each fetch exactly what its own would."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mqds.server.storage import keys
from mqds.server.storage.sessions import FetchFilter
from mqds.server.storage.shard import Engine, ShardStorage
from mqds.v1 import storage_pb2 as pb


def msg(topic: str, payload: str, qos: int = 1) -> pb.Message:
    return pb.Message(topic=topic, payload=payload.encode(), sender="s", qos=qos)


def want(**kwargs: object) -> FetchFilter:
    options: dict[str, object] = {
        "topic_filter": "t/#",
        "after_us": 0,
        "since_us": 0,
        "max_count": 1000,
        "include_qos0": False,
        "skip_acked": False,
    }
    options.update(kwargs)
    return FetchFilter(**options)  # type: ignore[arg-type]


def test_one_scan_serves_fetches_at_different_positions_and_counts_once(shard: ShardStorage) -> None:
    first = shard.store([msg("t/a", str(i), qos=i % 3) for i in range(30)], 100)  # timestamps 100..129
    shard.sessions.ack_queue(first + 1, "t/#")
    wanted = [
        want(),
        want(after_us=110),
        want(after_us=120, include_qos0=True),
        want(max_count=3),
        want(skip_acked=True, max_count=4),
        want(since_us=125, include_qos0=True),
        want(after_us=2**63),
    ]
    scans = shard.sessions.fetch_scans
    scan = shard.sessions.fetch_shared(wanted)
    assert shard.sessions.fetch_scans == scans + 1
    assert not scan.cut
    for w, taken in zip(wanted, scan.taken, strict=True):
        assert [scan.found[k] for k in taken] == shard.sessions.fetch(w)
    # Each message once, oldest first, only those some fetch took.
    timestamps = [ts for ts, _ in scan.found]
    assert timestamps == sorted(set(timestamps))
    assert set(timestamps) == {scan.found[k][0] for taken in scan.taken for k in taken}


def test_a_shared_scan_stops_at_its_budget_and_says_so(shard: ShardStorage) -> None:
    shard.store([msg("t/big", str(i) * 1000) for i in range(10)], 100)
    size = len(shard.sessions.fetch(want(max_count=1))[0][1])
    scan = shard.sessions.fetch_shared([want(), want(after_us=102)], 3 * size)
    assert len(scan.found) == 3 and scan.cut
    assert scan.taken == [[0, 1, 2], []]
    # Everyone full before the budget: not cut.
    full = shard.sessions.fetch_shared([want(max_count=2), want(max_count=1)], 3 * size)
    assert not full.cut and full.taken == [[0, 1], [0]]
    # Each fetch taking a message costs ref_bytes more: two fetches, twice the references.
    tight = shard.sessions.fetch_shared([want(), want()], 3 * size, ref_bytes=size // 2)
    assert len(tight.found) == 1 and tight.cut  # 2 x (size + size/2) > 3 x size: one message (at least one)
    # One message at least, whatever the budget.
    assert len(shard.sessions.fetch_shared([want()], 0).found) == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=st.lists(st.tuples(st.sampled_from(["t/a", "t/b", "u/a"]), st.integers(0, 2)), max_size=40),
    acked=st.sets(st.integers(0, 39), max_size=10),
    fetches=st.lists(
        st.tuples(
            st.integers(0, 45),  # after (offset from the first timestamp)
            st.integers(0, 45),  # since
            st.integers(1, 12),  # max_count
            st.booleans(),  # include_qos0
            st.booleans(),  # skip_acked
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_each_fetch_of_a_shared_scan_gets_what_reading_everything_gives_it(
    tmp_path_factory: pytest.TempPathFactory,
    engine: Engine,
    messages: list[tuple[str, int]],
    acked: set[int],
    fetches: list[tuple[int, int, int, bool, bool]],
) -> None:
    directory = tmp_path_factory.mktemp("shared")
    shard = ShardStorage(str(directory / "shard"), 0, engine)
    shard.initialize(1)
    try:
        base = 1_000
        if messages:
            shard.store([msg(topic, str(i), qos) for i, (topic, qos) in enumerate(messages)], base)
        for offset in sorted(acked):
            if offset < len(messages):
                shard.sessions.ack_queue(base + offset, "t/#")
        wanted = [
            want(after_us=base + a - 1, since_us=base + s, max_count=n, include_qos0=q0, skip_acked=skip)
            for a, s, n, q0, skip in fetches
        ]
        scan = shard.sessions.fetch_shared(wanted)
        for w, taken in zip(wanted, scan.taken, strict=True):
            mine = [scan.found[k] for k in taken]
            assert mine == shard.sessions.fetch(w) == reference(shard, w)
    finally:
        shard.close()


def reference(shard: ShardStorage, w: FetchFilter) -> list[tuple[int, bytes]]:
    """What a fetch must return, from every stored message one by one (no queue floor, no shared scan)."""
    out: list[tuple[int, bytes]] = []
    for ts, stored in shard.sessions._ordered(w.topic_filter, 0):
        if ts <= w.after_us or ts < w.since_us:
            continue
        if not w.include_qos0 and pb.Message.FromString(stored).qos == 0:
            continue
        if w.skip_acked and shard.meta_get(keys.queue_ack_key(ts)) is not None:
            continue
        out.append((ts, stored))
        if len(out) == w.max_count:
            break
    return out
