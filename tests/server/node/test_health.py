"""gRPC health of a real node catching up: alive all along, ready only once its replicas are caught up."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from mqds.client import Message
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.processes import NodeProcess
from mqds.tools.waiting import READY_SERVICE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVING = health_pb2.HealthCheckResponse.SERVING


def metric_sum(proc: NodeProcess, name: str, **labels: str) -> float:
    """The sum of a metric's samples on a node (those with ``labels``)."""
    assert proc.metrics_url is not None
    with urllib.request.urlopen(proc.metrics_url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def probe(address: str, service: str) -> str:
    """What a Kubernetes gRPC probe of ``service`` sees: SERVING, NOT_SERVING, or the failure.

    A new connection each time, as the kubelet makes: a channel kept open
    would wait out its reconnect backoff after the port refused it.
    """
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.RpcError as err:
            return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def test_a_wiped_node_is_alive_but_not_ready_until_its_snapshots_are_installed(tmp_path: Path) -> None:
    # A small journal: the wiped node cannot be fed from the log, only by snapshots.
    with LocalCluster(tmp_path / "c", 3, n_shards=2, metrics=True, args=["--raft-log-max-bytes", "50000"]) as cluster:
        cluster.start()
        client = cluster.client(timeout_s=20)
        for _round in range(20):
            for sender in ("a", "b", "c", "d"):
                client.store_batch([Message(topic=f"t/{sender}", payload=b"x" * 200, sender=sender) for _ in range(50)])
        cluster.wipe("n3")
        client.store_batch([Message(topic="t/a", payload=b"after", sender="a")])
        n3 = cluster.nodes["n3"]
        n3.launch()

        # Probe both services the way Kubernetes would, until the node is ready.
        seen: list[tuple[str, str]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = (probe(n3.address, ""), probe(n3.address, READY_SERVICE))
            seen.append(state)
            if state[1] == "SERVING":
                break
            time.sleep(0.02)
        assert seen[-1][1] == "SERVING", f"not ready within 60 s: {seen[-5:]}\n{n3.output()}"
        vnode_installs = [metric_sum(n3, "mqds_snapshot_installs_total", shard=str(s)) for s in range(2)]
        installs_when_ready = metric_sum(n3, "mqds_snapshot_installs_total")

        # Alive from the first answer on: a liveness probe never fails while it catches up.
        answered = [s for s in seen if s[0] != "UNAVAILABLE"]
        assert answered and all(live == "SERVING" for live, _ in answered), sorted(set(seen))
        # Not ready at first, though alive.
        assert any(ready == "NOT_SERVING" for _, ready in answered), sorted(set(seen))

        # Ready only once caught up: it came back by snapshot, every install was
        # over before it said ready, and none came after.
        assert sum(vnode_installs) >= 1
        assert metric_sum(n3, "mqds_snapshot_received_bytes_total") > 0
        assert metric_sum(n3, "mqds_snapshot_installing") == 0
        cluster.assert_replicas_identical(timeout_s=30)
        assert metric_sum(n3, "mqds_snapshot_installs_total") == installs_when_ready
        sent = sum(metric_sum(cluster.nodes[n], "mqds_snapshot_sends_total") for n in ("n1", "n2"))
        assert sent >= sum(vnode_installs)
        assert sum(metric_sum(cluster.nodes[n], "mqds_snapshot_sent_bytes_total") for n in ("n1", "n2")) > 0
        assert metric_sum(n3, "mqds_node_ready") == 1.0
        assert cluster.status("n3").ready
        client.close()
