"""Admission control by disk usage (``mqds.server.diskusage``): when new messages are refused, and taken again."""

from __future__ import annotations

import os
from pathlib import Path

from mqds.protocol.cluster_view import META_GROUP
from mqds.server.diskusage import DiskUsage, Usage, allocated_bytes, measure


def _usage(data: int = 0, free: int = 10**12) -> Usage:
    return Usage(data_bytes=data, free_bytes=free, total_bytes=2 * 10**12, wal_bytes=0)


def test_a_quota_refuses_at_the_limit_and_takes_messages_again_only_below_95_percent() -> None:
    disk = DiskUsage("n1", "unused", quota_bytes=1000, min_free_bytes=0)
    assert disk.decide(_usage(999)) is None
    why = disk.decide(_usage(1000))
    assert why is not None and "n1's data directory holds 1000 B" in why and "disk_quota_bytes" in why
    assert disk.refusals == 1
    # Back under the quota, but within the margin: still refused (no flapping at every compaction).
    assert disk.decide(_usage(960)) is not None and "not yet below 95%" in (disk.refusal or "")
    assert disk.decide(_usage(949)) is None and disk.refusal is None
    assert disk.decide(_usage(1200)) is not None
    assert disk.refusals == 2


def test_a_free_space_floor_refuses_below_it_and_takes_messages_again_5_percent_above() -> None:
    disk = DiskUsage("n2", "unused", quota_bytes=0, min_free_bytes=1000)
    assert disk.decide(_usage(free=1000)) is None
    why = disk.decide(_usage(free=999))
    assert why is not None and "n2's disk has 999 B free, below its floor" in why and "disk_min_free_bytes" in why
    assert disk.decide(_usage(free=1040)) is not None and "not yet 5% above" in (disk.refusal or "")
    assert disk.decide(_usage(free=1060)) is None


def test_no_limits_take_everything() -> None:
    disk = DiskUsage("n1", "unused", quota_bytes=0, min_free_bytes=0)
    assert disk.decide(_usage(data=10**15, free=0)) is None


def test_measure_counts_each_replica_the_raft_log_and_the_whole_directory(tmp_path: Path) -> None:
    for rel, size in [
        ("shards/shard-0003/000001.sst", 300_000),
        ("raft/shard-0003/snapshot", 100_000),
        ("raft/wal/00000001.log", 200_000),
        ("meta/state", 50_000),
        ("node.json", 100),
    ]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    usage = measure(str(tmp_path))
    assert usage.group_bytes[3] >= 400_000
    assert usage.group_bytes[META_GROUP] >= 50_000
    assert usage.wal_bytes >= 200_000
    assert usage.data_bytes >= 650_000 and usage.data_bytes == allocated_bytes(str(tmp_path))
    assert 0 < usage.free_bytes <= usage.total_bytes


def test_a_checkpoint_of_hard_links_in_tmp_takes_no_disk_of_its_own(tmp_path: Path) -> None:
    sst = tmp_path / "shards" / "shard-0001" / "000001.sst"
    sst.parent.mkdir(parents=True)
    sst.write_bytes(os.urandom(400_000))
    alone = measure(str(tmp_path))
    checkpoint = tmp_path / "tmp" / "export-1-abc"
    checkpoint.mkdir(parents=True)
    os.link(sst, checkpoint / "000001.sst")  # what a RocksDB checkpoint makes
    (checkpoint / "MANIFEST-000001").write_bytes(os.urandom(10_000))  # and a file of its own
    linked = measure(str(tmp_path))
    assert linked.group_bytes[1] == alone.group_bytes[1] >= 400_000
    assert alone.data_bytes + 10_000 <= linked.data_bytes < alone.data_bytes + 100_000


def test_metrics_report_the_measurement_and_the_refusal() -> None:
    disk = DiskUsage("n1", "unused", quota_bytes=1000, min_free_bytes=0)
    disk.decide(Usage(data_bytes=2000, free_bytes=5, total_bytes=10, wal_bytes=1, group_bytes={0: 7, META_GROUP: 3}))
    samples = {(s.name, tuple(s.labels.items())): s.value for m in disk.metrics() for s in m.samples}
    assert samples[("mqds_disk_data_dir_bytes", ())] == 2000
    assert samples[("mqds_disk_replica_bytes", (("shard", "0"),))] == 7
    assert samples[("mqds_disk_replica_bytes", (("shard", "meta"),))] == 3
    assert samples[("mqds_disk_writes_refused", ())] == 1
    assert samples[("mqds_disk_write_refusals_total", ())] == 1


def test_without_a_quota_a_new_replica_is_measured_at_once_and_the_rest_every_30_s(tmp_path: Path) -> None:
    disk = DiskUsage("n1", str(tmp_path), quota_bytes=0, min_free_bytes=0)
    (tmp_path / "shards" / "shard-0000").mkdir(parents=True)
    (tmp_path / "shards" / "shard-0000" / "a.sst").write_bytes(os.urandom(100_000))
    assert disk.check().group_bytes[0] >= 100_000
    # More data in a replica already measured: not walked again within WALK_INTERVAL_S.
    (tmp_path / "shards" / "shard-0000" / "b.sst").write_bytes(os.urandom(100_000))
    assert disk.check().group_bytes[0] < 200_000
    # A replica opened meanwhile: walked at once, so status shows its size.
    (tmp_path / "shards" / "shard-0001").mkdir()
    (tmp_path / "shards" / "shard-0001" / "c.sst").write_bytes(os.urandom(50_000))
    usage = disk.check()
    assert usage.group_bytes[1] >= 50_000 and usage.group_bytes[0] >= 200_000
