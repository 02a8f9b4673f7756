"""The benchmarks' parts without a cluster: where the publishers write, and the fan-out's latencies (each
delivered message matched to the acknowledgement of the call that stored it)."""

from __future__ import annotations

from collections import Counter

import pytest

from mqds.bench.fanout import weighted_pct_ms
from mqds.bench.fanout_load import delivery_latencies
from mqds.bench.load import publisher_ids
from mqds.bench.storm import Storm, _print
from mqds.protocol.sharding import shard_of

# Shard 3: a call of timestamps 100-109 acknowledged at 1.0, one of 110-119 at 2.0; shard 5: 100-149 at 4.0.
ACKS = [(3, 110, 119, 2.0), (3, 100, 109, 1.0), (5, 100, 149, 4.0)]


def ms(pairs: list[tuple[float, int]]) -> list[tuple[float, int]]:
    return [(round(seconds * 1000, 3), weight) for seconds, weight in pairs]


def test_each_message_counts_from_the_acknowledgement_of_the_call_that_held_it() -> None:
    samples = [
        # 104-113 for 10 subscriptions: 6 messages of the first call, 4 of the second (before its answer came)
        (2.25, 3, 104, 113, 10, 10),
        (4.5, 5, 149, 149, 1, 1),
        (9.0, 3, 118, 121, 4, 7),  # 120 and 121 are in no acknowledged call (one retried): only from storing
        (9.0, 4, 100, 100, 1, 7),  # a shard with no acknowledged call at all
    ]
    from_ack, from_stored = delivery_latencies(samples, ACKS)
    assert ms(from_ack) == [(250.0, 40), (500.0, 1), (1250.0, 60), (7000.0, 14)]
    # From storing: each call's part from its oldest message, what no call holds from the answer's first.
    assert ms(from_stored) == ms(
        sorted(
            [
                (2.25 - 104e-6, 60),
                (2.25 - 110e-6, 40),
                (4.5 - 149e-6, 1),
                (9.0 - 118e-6, 14),
                (9.0 - 118e-6, 14),
                (9.0 - 100e-6, 7),
            ]
        )
    )


def test_a_message_can_arrive_before_its_publisher_has_the_answer() -> None:
    from_ack, _ = delivery_latencies([(1.995, 3, 110, 119, 10, 500)], ACKS)
    assert ms(from_ack) == [(-5.0, 5000)]


def test_the_percentiles_weigh_each_sample_by_the_deliveries_it_stands_for() -> None:
    ordered = [(-0.005, 500), (0.25, 10), (0.5, 1)]
    assert weighted_pct_ms(ordered, 0.5) == -5.0
    assert weighted_pct_ms(ordered, 0.99) == 250.0
    assert weighted_pct_ms([], 0.99) == 0.0


def test_publishers_spread_over_the_shards_and_over_the_nodes_that_lead_them() -> None:
    plain = publisher_ids(8, 16)
    assert len({shard_of(name, 16) for name in plain}) == 8
    leaders = {shard: f"n{shard % 3 + 1}" for shard in range(16)}  # the leader balancer's round robin
    # Without the leaders, most of those eight shards are led by one node (six of eight here): with them, the
    # nodes lead three, three and two.
    assert max(Counter(leaders[shard_of(name, 16)] for name in plain).values()) > 3
    spread = publisher_ids(8, 16, leaders)
    assert len({shard_of(name, 16) for name in spread}) == 8
    assert sorted(Counter(leaders[shard_of(name, 16)] for name in spread).values()) == [2, 3, 3]
    # The first is the same either way (a benchmark that kills its shard's leader names it before the load).
    assert spread[0] == plain[0] == "bench-pub-0"
    # More publishers than shards: every shard, then the next names.
    many = publisher_ids(20, 16, leaders)
    assert len(set(many)) == 20 and len({shard_of(name, 16) for name in many}) == 16


def test_the_storm_summary_compares_cpu_even_when_the_storms_measured_none(capsys: pytest.CaptureFixture[str]) -> None:
    """A storm short enough that the nodes' CPU did not move by one clock tick measured 0 ms, a figure like any
    other: the summary still gives both ratios (a tiny run in the tests once printed only the time's)."""
    _print(Storm(0.05, 200, 0.0, 0, calls=2), Storm(0.33, 200, 1000.0, 0))
    out = capsys.readouterr().out
    assert "shared/baseline: 0.15 of the time, 0.00 of the nodes' CPU per message\n" in out
    _print(Storm(0.05, 200, None, 0, calls=2), Storm(0.33, 200, 1000.0, 0))  # not measured (--endpoints only)
    assert "shared/baseline: 0.15 of the time\n" in capsys.readouterr().out
