"""Retention per topic filter (issue 24) on a real 3-node cluster: rules set online, enforced by the leaders.

The policy is cluster configuration (the metadata group logs it); each
vnode's leader checks it every ``retention_check_interval_s`` (1 s here) and
logs retention steps that every replica applies. Across a leader kill the new
leader carries on, and the killed node, restarted, ends with the same content.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from mqds.cli import main
from mqds.client import Client, ConnectionSettings, Message
from mqds.client.errors import InvalidArgumentError
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.waiting import wait_until
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc

pytestmark = pytest.mark.integration

N_SHARDS = 4
SENDER = "ret-sender"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(
        tmp_path_factory.mktemp("retention") / "c", 3, n_shards=N_SHARDS, args=["--retention-check-interval-s", "1"]
    ) as c:
        c.start()
        yield c


def admin(cluster: LocalCluster) -> Client:
    return Client(cluster.addresses, settings=ConnectionSettings(timeout_s=30, cluster_secret=cluster.secret))


def topics(c: Client) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in c.replay("ret/#"):
        counts[m.topic] = counts.get(m.topic, 0) + 1
    return counts


def test_rules_set_online_remove_what_they_ended_and_keep_the_rest(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = shard_of(SENDER, N_SHARDS)
    with admin(cluster) as c:
        assert c.retention() is None
        for topic in ("ret/tel/a", "ret/tel/b", "ret/audit/a", "ret/other"):
            c.store_batch([Message(topic=topic, payload=b"x", sender=SENDER) for _ in range(50)])
        assert topics(c) == {"ret/tel/a": 50, "ret/tel/b": 50, "ret/audit/a": 50, "ret/other": 50}
        # Set through the command line, as an operator would; the policy is in the cluster map.
        monkeypatch.setenv("MQDS_CLUSTER_SECRET", cluster.secret)
        endpoints = ",".join(cluster.addresses)
        code = main(
            ["--endpoints", endpoints, "retention", "set", "ret/tel/#=2s", "ret/audit/#=keep", "--default", "1h"]
        )
        assert code == 0
        out = capsys.readouterr().out
        assert "ret/tel/#" in out and "2s" in out and "keep" in out and "1h" in out
        policy = wait_until("every node having applied the policy", c.retention, 30)
        assert [(r.topic_filter, r.period_s) for r in policy.rules] == [("ret/tel/#", 2), ("ret/audit/#", 0)]
        assert policy.default_s == 3600
        # The leader of the messages' vnode dies; the new leader removes what ended.
        leader = cluster.leader(shard)
        assert leader is not None
        cluster.kill(leader)
        try:
            wait_until(
                "telemetry removed, the rest kept",
                lambda: topics(c) == {"ret/audit/a": 50, "ret/other": 50},
                45,
            )
        finally:
            cluster.start_node(leader)
        assert main(["--endpoints", endpoints, "retention", "show"]) == 0
        assert "ret/audit/#" in capsys.readouterr().out
    wait_until("the restarted replica catching up", lambda: _same(cluster, shard), 60)
    cluster.assert_replicas_identical(shards=[shard])


def test_closed_generations_whose_messages_all_ended_are_dropped_whole(cluster: LocalCluster) -> None:
    with admin(cluster) as c:
        c.store_batch([Message(topic="ret/old/x", payload=b"x", sender=SENDER) for _ in range(20)])
        c.add_generation()
        before = {(g.shard, g.generation) for g in c.list_generations() if not g.current}
        assert before
        c.set_retention([("ret/audit/#", 0)], default_s=1)
        # Every closed generation holds only messages whose period (1 s) ended, or audit ones (kept):
        # the shard of the audit messages keeps its generation, the others are dropped whole.
        audit_shard = shard_of(SENDER, N_SHARDS)

        def dropped() -> bool:
            closed = {(g.shard, g.generation) for g in c.list_generations() if not g.current}
            return {s for s, _ in closed} <= {audit_shard} and closed < before

        wait_until("closed generations dropped", dropped, 45)
        wait_until("other messages removed", lambda: topics(c) == {"ret/audit/a": 50}, 45)
        c.set_retention([], default_s=0)  # keep everything again
    cluster.assert_replicas_identical()


def test_bad_rules_are_refused_clearly(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MQDS_CLUSTER_SECRET", cluster.secret)
    endpoints = ",".join(cluster.addresses)
    assert main(["--endpoints", endpoints, "retention", "set", "a/#/b=1d"]) == 2
    assert "'a/#/b=1d'" in capsys.readouterr().err
    assert main(["--endpoints", endpoints, "retention", "set", "ok/#=1d", "a/#=soon"]) == 2
    assert "rule 'a/#=soon': 'soon' is not a period" in capsys.readouterr().err  # the rule, not only the period
    with admin(cluster) as c, pytest.raises(InvalidArgumentError, match="listed twice"):
        c.set_retention([("a/#", 10), ("a/#", 20)])
    # The node checks too, and wants admin rights.
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = clpb_grpc.ClusterStub(channel)
        bad = clpb.SetRetentionRequest(policy=clpb.RetentionPolicy(rules=[clpb.RetentionRule(topic_filter="a/#/b")]))
        with pytest.raises(grpc.RpcError) as refused:
            stub.SetRetention(bad, timeout=10, metadata=[("x-mqds-cluster-secret", cluster.secret)])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rule 1" in (refused.value.details() or "")
        with pytest.raises(grpc.RpcError) as anonymous:
            stub.SetRetention(clpb.SetRetentionRequest(), timeout=10)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _same(cluster: LocalCluster, shard: int) -> bool:
    digests = cluster.digests(shard)
    return len(digests) == 3 and len({(d.applied_index, d.sha256) for d in digests.values()}) == 1
