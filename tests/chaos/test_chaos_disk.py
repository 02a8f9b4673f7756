"""Power loss under mqds nodes: their data directories on the chaos suite's fault filesystem (mqds.chaos.faultfs).

``test_a_single_node_loses_nothing_acknowledged_to_a_power_loss``: one node,
one replica per vnode; every write acknowledged before a kill -9 and a power
loss (everything not fsynced is lost, torn) must be read back after the
restart, with both directory models of the filesystem. ``posix`` (a
directory's entries are durable once that directory is fsynced) is the
regression test of a bug the first runs found: the node never fsynced its
data directory after making its subdirectories, nor ``raft/`` and ``shards/``
after making the vnodes' directories, so a power loss took every
acknowledged write with them (400 of 400); every directory is now made with
``durable.make_dirs``.

``test_a_short_run_with_power_loss_of_every_node_passes``: the chaos runner
with ``power-loss-all`` on ``--disk journal`` (ext4's behaviour: any fsync
makes every earlier name durable).

Both need root and FUSE, and are skipped with the reason elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mqds.chaos import runner
from mqds.chaos.faultfs import FaultFs, unavailable_reason
from mqds.client import Client, Message
from mqds.tools.processes import NodeProcess

UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no fault filesystem here: {UNAVAILABLE}"),
]


@pytest.mark.parametrize("metadata", ["journal", "posix"])
def test_a_single_node_loses_nothing_acknowledged_to_a_power_loss(tmp_path: Path, metadata: str) -> None:
    with FaultFs(tmp_path / "n1.disk", tmp_path / "n1", metadata=metadata) as disk:
        node = NodeProcess(tmp_path / "n1", args=["--n-shards", "4"])
        try:
            node.start(60)
            with Client(node.address) as c:
                acked: list[Message] = []
                for i in range(20):
                    batch = [
                        Message(topic=f"k/{j % 7}", payload=f"{i}-{j}".encode(), sender=f"p{j % 3}") for j in range(20)
                    ]
                    acked += c.store_batch(batch)
            node.kill()
            report = disk.power_loss(torn=True, seed=5)
            assert report["files_reverted"] + report["entries_removed"] > 0, report
            node.start(60)
            with Client(node.address) as c:
                after = {(m.topic, m.payload, m.timestamp_us) for m in c.replay("k/#")}
        finally:
            node.kill()
    missing = {(m.topic, m.payload, m.timestamp_us) for m in acked} - after
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged messages lost; power loss: {report}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_run_with_power_loss_of_every_node_passes(tmp_path: Path) -> None:
    opts = runner.Options(
        duration_s=5,
        nemeses=["power-loss-all"],
        disk="journal",
        nodes=3,
        shards=2,
        seed=23,
        hold_s=(1.0, 1.5),
        quiet_s=(1.0, 1.5),
        readers=1,
        followers=1,
        pubsub_consumers=1,
        queue_consumers=0,
        hostile=False,
        drain_timeout_s=30,
        work_dir=tmp_path / "work",
    )
    report = runner.run(opts)
    print(report.text)
    assert report.passed, report.text
    assert [f.nemesis for f in report.faults] == ["power-loss-all"]
    assert not [f for f in report.faults if f.error], report.text
    assert report.run["disk"] == "journal"
    counts = report.result.counts
    assert counts["acked"] > 500 and counts["lost"] == counts["duplicates"] == counts["unexpected"] == 0
