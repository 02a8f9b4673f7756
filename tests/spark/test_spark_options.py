"""The Spark source's options, tokens and planning arithmetic, without Spark or a cluster."""

from __future__ import annotations

import doctest
import itertools
import json
from types import ModuleType

import pytest

from mqds.client import Fence, Generation, Rank, Stream
from mqds.spark import options as options_module
from mqds.spark import plan as plan_module
from mqds.spark import snapshot as snapshot_module
from mqds.spark.options import (
    EARLIEST,
    LATEST,
    OptionError,
    format_time_us,
    intersect_filters,
    parse_options,
    parse_time_us,
    prefix_as_filter,
)
from mqds.spark.plan import data_loss, dropped_ranges, pack_slices, plan_slices
from mqds.spark.snapshot import GenerationRange, Snapshot, VnodeFence

pytestmark = pytest.mark.spark

BASE = {"endpoints": "10.0.0.1:7101,10.0.0.2:7101"}
STREAM = {**BASE, "topicFilter": "sensor/#"}


@pytest.mark.parametrize("module", [options_module, plan_module], ids=lambda m: m.__name__)
def test_doctests_pass(module: ModuleType) -> None:
    result = doctest.testmod(module, verbose=False, report=True)
    assert result.attempted > 0 and result.failed == 0


def test_defaults_and_every_option_parse() -> None:
    parsed = parse_options(BASE)
    assert parsed.endpoints == ("10.0.0.1:7101", "10.0.0.2:7101")
    assert (parsed.topic_filter, parsed.start_us, parsed.end_us, parsed.snapshot) == ("#", 0, None, None)
    assert parsed.fail_on_data_loss and parsed.max_records_per_partition == 500_000
    full = parse_options(
        {
            **BASE,
            "topicFilter": "sensor/+/temp",
            "startTime": "2026-11-01T00:00:00Z",
            "ENDTIME": "2026-11-01T02:00:00+01:00",  # Spark's option names are case-insensitive
            "maxRecordsPerPartition": "1_000",
            "failOnDataLoss": "false",
            "batchSize": "50",
            "timeout": "7.5",
            "token": "s3cret",
        }
    )
    assert full.topic_filter == "sensor/+/temp"
    assert format_time_us(full.start_us) == "2026-11-01T00:00:00.000000Z"
    assert full.end_us is not None and full.end_us - full.start_us == 3_600_000_000
    assert (full.max_records_per_partition, full.fail_on_data_loss, full.batch_size) == (1000, False, 50)
    assert full.settings.timeout_s == 7.5 and full.settings.auth_token == "s3cret"
    stream = parse_options({**STREAM, "startingOffsets": '{"0": 5, "2": "1970-01-01T00:00:01Z"}'}, streaming=True)
    assert stream.starting_offsets.for_vnode(0) == 5
    assert stream.starting_offsets.for_vnode(2) == 1_000_000
    assert stream.starting_offsets.for_vnode(1) == EARLIEST  # not named: earliest, as the Kafka source does
    assert parse_options(STREAM, streaming=True).starting_offsets.default == LATEST
    assert parse_options({**STREAM, "maxMessagesPerTrigger": "10"}, streaming=True).max_messages_per_trigger == 10
    assert parse_options({**STREAM, "topicFilter": "#"}, streaming=True).topic_filter == "#"  # everything, if asked


@pytest.mark.parametrize(
    ("given", "streaming", "says"),
    [
        ({}, False, "option endpoints is required"),
        ({"endpoints": "10.0.0.1"}, False, "option endpoints: endpoint '10.0.0.1' is not host:port"),
        ({**BASE, "topicFilter": "a/#/b"}, False, "option topicFilter: invalid topic filter"),
        ({**BASE, "startTime": "last tuesday"}, False, "option startTime: 'last tuesday' is not a time"),
        ({**BASE, "endTime": "2026-13-01"}, False, "option endTime: '2026-13-01' is not a time"),
        (
            {**BASE, "startTime": "2026-11-02", "endTime": "2026-11-01"},
            False,
            "option endTime (2026-11-01T00:00:00.000000Z) must be after startTime",
        ),
        ({**STREAM, "startingOffsets": "oldest"}, True, "option startingOffsets: 'oldest' is not known"),
        ({**STREAM, "startingOffsets": '{"x": 1}'}, True, "'x' is not a vnode number"),
        ({**STREAM, "startingOffsets": '{"0": -7}'}, True, "vnode 0: -7 is not a position"),
        ({**BASE, "snapshot": "abc"}, False, "option snapshot: not a snapshot token (not JSON"),
        ({**BASE, "snapshot": '{"vnodes": {}}'}, False, "option snapshot: not a snapshot token"),
        ({**BASE, "maxRecordsPerPartition": "0"}, False, "option maxRecordsPerPartition: must be 1 or more, got 0"),
        ({**BASE, "maxRecordsPerPartition": "many"}, False, "'many' is not a whole number"),
        ({**BASE, "batchSize": "-3"}, False, "option batchSize: must be 1 or more"),
        ({**BASE, "failOnDataLoss": "perhaps"}, False, "option failOnDataLoss: 'perhaps' is not true or false"),
        ({**STREAM, "maxMessagesPerTrigger": "0"}, True, "option maxMessagesPerTrigger: must be 1 or more"),
        ({**BASE, "timeout": "0"}, False, "option timeout: must be above 0"),
        ({**BASE, "topicfilterr": "#"}, False, "unknown option topicfilterr for the mqds source; it takes"),
        ({**STREAM, "startTime": "2026-11-01"}, True, "option startTime applies to batch reads (spark.read) only"),
        ({**BASE, "startingOffsets": "latest"}, False, "applies to streaming reads (spark.readStream) only"),
        (BASE, True, "option topicFilter is required for a stream (spark.readStream)"),
        ({**BASE, "topicFilter": " "}, True, "option topicFilter is required for a stream"),
        ({**BASE, "tlsCert": "c.pem"}, False, "tls_client_cert and tls_client_key go together"),
    ],
)
def test_bad_options_say_which_and_why(given: dict[str, str], streaming: bool, says: str) -> None:
    with pytest.raises(OptionError) as err:
        parse_options(given, streaming=streaming)
    assert says in str(err.value)


def test_times_are_exact_and_utc_without_a_zone() -> None:
    assert parse_time_us("t", "2026-11-01T00:00:00.000001Z") == parse_time_us("t", "2026-11-01T00:00:00") + 1
    assert parse_time_us("t", "2026-11-01T01:00:00+01:00") == parse_time_us("t", "2026-11-01")
    assert parse_time_us("t", format_time_us(1_762_000_000_123_457)) == 1_762_000_000_123_457


@pytest.mark.parametrize(
    ("a", "b", "both"),
    [
        ("#", "sensor/+/temp", "sensor/+/temp"),
        ("sensor/+/temp", "sensor/42/temp", "sensor/42/temp"),
        ("sensor/+/temp", "sensor/42/hum", None),
        ("sensor/#", "sensor", "sensor"),
        ("+/x", "a/+", "a/x"),
        ("a/+", "a", None),
        ("#", "$SYS/up", None),
        ("$SYS/#", "$SYS/+", "$SYS/+"),
    ],
)
def test_filters_intersect_as_mqtt_matches(a: str, b: str, both: str | None) -> None:
    assert intersect_filters(a, b) == both
    assert intersect_filters(b, a) == both


def test_prefixes_narrow_by_whole_levels_only() -> None:
    assert prefix_as_filter("sensor/4") == "sensor/#"
    assert prefix_as_filter("sensor/") == "sensor/#"
    assert prefix_as_filter("a+b/c") is None


def _fences() -> dict[int, Fence]:
    g1 = Generation(0, 1, 0, 2_000, 1_000)
    g2 = Generation(0, 2, 2_000, None, 2_000)
    return {0: Fence(0, 2_999, 10, (g1, g2), (1_000, 100))}


def _streams(shard: int, generation: int) -> list[tuple[Rank, Stream]]:
    return [(Rank(shard, generation), Stream(shard, generation, i, f"s/{i}")) for i in (2, 1)]


def test_a_large_generation_is_cut_into_consecutive_time_ranges() -> None:
    streams = _streams(0, 1) + _streams(0, 2)
    slices = plan_slices({0: (0, 2_999)}, _fences(), streams, "#", max_rows=300)
    first = [s for s in slices if s.generation == 1]
    assert len(first) == 4  # 1,000 keys over 300 per partition
    assert first[0].start_us == 0 and first[-1].fence_us == 1_999  # nothing before or after is left out
    assert all(a.fence_us + 1 == b.start_us for a, b in itertools.pairwise(first))
    assert [s.id for s in first[0].streams] == [1, 2]
    (second,) = [s for s in slices if s.generation == 2]
    assert (second.start_us, second.fence_us) == (2_000, 2_999)
    # A time window keeps only the generations it overlaps, clipped to it.
    (only,) = plan_slices({0: (2_100, 2_500)}, _fences(), streams, "#", max_rows=300)
    assert (only.generation, only.start_us, only.fence_us) == (2, 2_100, 2_500)
    # Cuts start at the first matching message when a probe finds it; an empty range is skipped.
    probed = plan_slices({0: (0, 1_999)}, _fences(), streams, "#", 300, first_timestamp=lambda part: 1_600)
    assert probed[0].start_us == 0 and probed[1].start_us > 1_600
    assert plan_slices({0: (0, 1_999)}, _fences(), streams, "#", 300, first_timestamp=lambda part: None) == []


def test_a_micro_batch_of_small_slices_runs_as_few_tasks_and_large_slices_keep_their_own() -> None:
    """A few new messages on many vnodes: one task, not one per vnode (each task costs tens of ms in Spark)."""
    fences = {s: Fence(s, 3_000, 10, (Generation(s, 1, 0, None, 1_000),), (10,)) for s in range(16)}
    streams = [pair for s in range(16) for pair in _streams(s, 1)]
    small = plan_slices({s: (2_990, 3_000) for s in range(16)}, fences, streams, "#", max_rows=1_000_000)
    assert len(small) == 16 and all(part.estimated_rows < 1 for part in small)
    assert pack_slices(small) == [tuple(small)]
    # Slices each estimated at 10,000 rows (a catch-up) keep one task each: the read stays parallel.
    big = {s: Fence(s, 3_000, 10, (Generation(s, 1, 0, None, 0),), (30_000,)) for s in range(4)}
    large = plan_slices({s: (1, 1_000) for s in range(4)}, big, streams, "#", max_rows=1_000_000)
    assert [len(group) for group in pack_slices(large)] == [1, 1, 1, 1]
    # Nothing is lost or repeated, in order.
    assert [part for group in pack_slices(small + large + small) for part in group] == small + large + small


def test_dropped_generations_are_found_from_a_snapshot_or_from_gaps() -> None:
    kept = [Generation(0, 3, 3_000, None, 3_000)]
    pinned = (GenerationRange(2, 2_000, 3_000), GenerationRange(3, 3_000, None))
    assert dropped_ranges(kept, pinned) == [GenerationRange(2, 2_000, 3_000)]
    assert data_loss(0, 2_500, 2_600, dropped_ranges(kept, pinned)) == [
        "vnode 0 generation 2 (1970-01-01T00:00:00.002000Z to 1970-01-01T00:00:00.003000Z)"
    ]
    assert data_loss(0, 3_000, 3_500, dropped_ranges(kept, pinned)) == []
    gaps = dropped_ranges([Generation(0, 2, 1_000, 2_000, 1_000), Generation(0, 4, 3_000, None, 3_000)])
    assert gaps == [GenerationRange(1, 0, 1_000), GenerationRange(3, 2_000, 3_000)]


def test_snapshot_tokens_round_trip_and_are_readable() -> None:
    snap = Snapshot(5, (VnodeFence(0, 1_762_000_000_000_001, (GenerationRange(1, 0, None),)), VnodeFence(1, 0, ())))
    token = snap.to_token()
    assert Snapshot.from_token(token) == snap
    body = json.loads(token)
    assert body["vnodes"]["0"]["fence"] == "2025-11-01T12:26:40.000001Z"
    with pytest.raises(ValueError, match="malformed snapshot token"):
        Snapshot.from_token(token.replace('"fence_us":0', '"fence_us":"zero"'))
    assert body["mqds_snapshot"] == snapshot_module.TOKEN_VERSION
