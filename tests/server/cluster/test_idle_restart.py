"""A cluster that was left idle comes back after restarts: of one node, of another, and of all of them.

Found by a review, as an operator would meet it: an election's no-op entry
never reached a replica's storage, so after the cluster had been quiet for a
Raft compaction interval every replica's snapshot manifest stood at a no-op
its storage had not recorded. A node restarted then asked for a snapshot at
the manifest's index, every peer refused (their storage was behind it too),
and the node never became ready; a whole-cluster restart left shards without
a leader. The compaction interval is a setting (``raft_compaction_interval_s``)
so this test can be quick.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mqds.client import Client, Message
from mqds.tools.local_cluster import LocalCluster

pytestmark = [pytest.mark.integration]

COMPACTION_S = 1.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    args = ["--raft-compaction-interval-s", str(COMPACTION_S), "--leader-balance-interval-s", "1"]
    with LocalCluster(tmp_path / "c", 3, n_shards=4, args=args) as c:
        c.start()
        yield c


def _stored(client: Client) -> set[bytes]:
    return {m.payload for m in client.replay("idle/#")}


def _ready_within(cluster: LocalCluster, node_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cluster.status(node_id, timeout_s=2).ready:
                return
        except Exception:  # still starting
            pass
        time.sleep(0.25)
    raise AssertionError(f"{node_id} did not become ready within {timeout_s:g}s:\n{cluster.nodes[node_id].output()}")


def test_nodes_and_the_whole_cluster_restart_after_an_idle_spell(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        batch = [
            Message(topic=f"idle/{i % 7}", payload=str(i).encode(), sender=f"dev-{i % 11}", qos=1) for i in range(200)
        ]
        client.store_batch(batch, timeout_s=30)
    expected = {str(i).encode() for i in range(200)}

    # n1 goes down and comes back: the vnodes it led elect others, and the
    # balancer hands them back to it (elections: no-op entries everywhere).
    cluster.kill("n1")
    cluster.start_node("n1", timeout_s=60)
    cluster.wait_ready(60)
    # Quiet for several compaction intervals: every replica compacts its log
    # at the last entry it applied, a no-op.
    time.sleep(6 * COMPACTION_S + 3)
    cluster.kill("n2")
    cluster.nodes["n2"].launch()
    _ready_within(cluster, "n2", 30)
    cluster.wait_ready(30)

    # Quiet again, then the whole cluster goes down and comes back.
    time.sleep(4 * COMPACTION_S)
    cluster.stop()
    cluster.start(timeout_s=60)
    with cluster.client() as client:
        assert _stored(client) == expected
        client.store_batch([Message(topic="idle/after", payload=b"after", sender="dev-0", qos=1)], timeout_s=30)
        assert b"after" in _stored(client)
    cluster.assert_replicas_identical(timeout_s=60)
