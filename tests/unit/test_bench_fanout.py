"""The fan-out benchmark's latencies: deliveries matched to the acknowledgement of the call that stored them."""

from __future__ import annotations

from mqds.bench_fanout import delivery_latencies
from mqds.cli.bench_fanout import weighted_pct_ms

# Two store calls on shard 3 (timestamps 100-109, acknowledged at 1.0; 110-119 at 2.0), one on shard 5.
ACKS = [(3, 110, 119, 2.0), (3, 100, 109, 1.0), (5, 100, 149, 4.0)]


def test_a_delivery_counts_from_the_acknowledgement_of_the_call_that_held_it() -> None:
    samples = [
        (1.25, 3, 104, 10),  # oldest message from the first call: 0.25 s after its acknowledgement
        (1.995, 3, 110, 500),  # delivered before the publisher had its answer: below zero
        (4.5, 5, 149, 1),
        (9.0, 3, 120, 7),  # no acknowledged call holds it (a retried call): only the time from storing
        (9.0, 4, 100, 7),  # a shard with no acknowledged call at all
    ]
    from_ack, from_stored = delivery_latencies(samples, ACKS)
    assert [(round(s, 3), w) for s, w in from_ack] == [(-0.005, 500), (0.25, 10), (0.5, 1)]
    # From storing: every sample, from its message's timestamp (microseconds, on the same clock).
    assert from_stored == sorted((arrived - ts / 1e6, w) for arrived, _, ts, w in samples)


def test_the_percentiles_weigh_each_sample_by_the_deliveries_it_stands_for() -> None:
    ordered = [(-0.005, 500), (0.25, 10), (0.5, 1)]
    assert weighted_pct_ms(ordered, 0.5) == -5.0
    assert weighted_pct_ms(ordered, 0.99) == 250.0
    assert weighted_pct_ms([], 0.99) == 0.0
