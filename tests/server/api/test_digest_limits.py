"""GetReplicaDigest on a real 3-node cluster with client tokens: who may call it, and what it may cost the node.

The nodes hash at most ``RATE`` bytes a second (``digest_rate_bytes``), so a
digest of the busy shard takes seconds: long enough to see it refused,
cancelled and cut at its deadline. A digest once re-hashed the whole replica
until a pass saw no change, up to 50 times, and went on after its caller had
gone.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from mqds.client import Client, ConnectionSettings, Message
from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.sharding import shard_of
from mqds.server.api.replica_digest import MAX_DIGESTS
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.waiting import wait_until
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc

pytestmark = pytest.mark.integration

READER = "reader-token-0123456789"
BROKER = "broker-token-0123456789"
ADMIN = "admin-token-0123456789ab"
N_SHARDS = 2
BUSY = "busy-sender"
QUIET = next(f"quiet-{i}" for i in range(100) if shard_of(f"quiet-{i}", N_SHARDS) != shard_of(BUSY, N_SHARDS))
MESSAGES = 60_000
RATE = 2 * 1024 * 1024
"""About 5 s for a digest of the busy shard (60,000 keys of about 175 bytes, each counting 64 more)."""


class Nodes:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.busy = shard_of(BUSY, N_SHARDS)
        self.quiet = shard_of(QUIET, N_SHARDS)
        self._channels = {n: grpc.insecure_channel(cluster.nodes[n].address) for n in cluster.nodes}

    def stub(self, node_id: str) -> clpb_grpc.ClusterStub:
        return clpb_grpc.ClusterStub(self._channels[node_id])

    def digest(self, node_id: str, shard: int, timeout_s: float, token: str | None = ADMIN) -> clpb.ReplicaDigest:
        metadata = [("authorization", f"Bearer {token}")] if token else []
        return self.stub(node_id).GetReplicaDigest(
            clpb.GetReplicaDigestRequest(shard=shard), timeout=timeout_s, metadata=metadata
        )

    def started(self, node_id: str, shard: int, timeout_s: float) -> grpc.Future:
        return self.stub(node_id).GetReplicaDigest.future(
            clpb.GetReplicaDigestRequest(shard=shard),
            timeout=timeout_s,
            metadata=[("authorization", f"Bearer {ADMIN}")],
        )

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    base = tmp_path_factory.mktemp("digest")
    tokens = base / "tokens"
    tokens.write_text(f"reader {READER}\nbroker {BROKER}\nadmin {ADMIN}\n")
    args = ["--auth-tokens-file", str(tokens), "--digest-rate-bytes", str(RATE)]
    with LocalCluster(base / "c", 3, n_shards=N_SHARDS, args=args) as cluster:
        cluster.start()
        with broker(cluster) as client:
            client.store_batch([Message("quiet/t", b"q" * 100, sender=QUIET, qos=1) for _ in range(100)])
            for start in range(0, MESSAGES, 2_000):
                client.store_batch(
                    [Message(f"busy/{i % 10}/t", b"p" * 100, sender=BUSY, qos=1) for i in range(start, start + 2_000)]
                )
        found = Nodes(cluster)
        yield found
        found.close()


def broker(cluster: LocalCluster) -> Client:
    return Client(cluster.addresses, settings=ConnectionSettings(timeout_s=60, auth_token=BROKER))


class Writer:
    """A broker storing a few messages on the busy shard every ``every_s``, until stopped."""

    def __init__(self, cluster: LocalCluster, every_s: float) -> None:
        self.client = broker(cluster)
        self.every_s = every_s
        self.stored = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.client.store_batch([Message("busy/w/t", b"w" * 100, sender=BUSY, qos=1) for _ in range(5)])
            self.stored += 5


def cpu_s(pid: int) -> float:
    """CPU time (user and system) the process has used so far, in seconds (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_over(pid: int, seconds: float) -> float:
    before = cpu_s(pid)
    time.sleep(seconds)
    return cpu_s(pid) - before


def reason(err: grpc.RpcError) -> Reason:
    return errors.from_rpc_error(err).reason


def test_only_an_admin_or_a_node_may_digest(nodes: Nodes) -> None:
    for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (READER, grpc.StatusCode.PERMISSION_DENIED)):
        with pytest.raises(grpc.RpcError) as refused:
            nodes.digest("n1", nodes.quiet, 10, token)
        assert refused.value.code() == code, refused.value
    with pytest.raises(grpc.RpcError) as refused:
        nodes.digest("n1", nodes.quiet, 10, BROKER)
    assert "needs the admin role" in str(refused.value.details())
    assert nodes.digest("n1", nodes.quiet, 10).keys > 0
    # The harness and the chaos checker present the cluster secret.
    assert nodes.cluster.digests(nodes.quiet)["n1"].keys > 0


def test_digests_whose_callers_left_stop_using_the_cpu(nodes: Nodes) -> None:
    pid = nodes.cluster.nodes["n1"].pid
    assert pid is not None
    with Writer(nodes.cluster, 0.05):
        time.sleep(1.0)
        baseline = cpu_over(pid, 3.0)
        # Four digests of the shard being written: two cut by their deadline, two cancelled.
        timed = [nodes.started("n1", nodes.busy, 1.0) for _ in range(2)]
        cancelled = [nodes.started("n1", nodes.busy, 120.0) for _ in range(2)]
        time.sleep(1.0)
        for call in cancelled:
            call.cancel()
        time.sleep(1.0)
        after = cpu_over(pid, 3.0)
    for call in timed:
        with pytest.raises(grpc.RpcError) as ended:
            call.result(timeout=10)
        assert ended.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    # Generous for a loaded 2-core machine: digests running on would take most of a core.
    assert after < baseline + 1.0, f"n1 used {after:.2f}s of CPU in 3s after the callers left ({baseline:.2f}s before)"
    # Their places are free again: two digests start (and are cancelled).
    again = [nodes.started("n1", nodes.busy, 120.0) for _ in range(MAX_DIGESTS)]
    time.sleep(1.0)
    assert not any(call.done() for call in again), [call.exception() for call in again if call.done()]
    for call in again:
        call.cancel()


def test_digests_beyond_the_limit_are_refused_at_once(nodes: Nodes) -> None:
    running = [nodes.started("n2", nodes.busy, 120.0) for _ in range(MAX_DIGESTS)]
    try:
        time.sleep(1.0)
        assert not any(call.done() for call in running), [call.exception() for call in running if call.done()]
        asked = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            nodes.digest("n2", nodes.quiet, 10)
        assert time.monotonic() - asked < 5
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reason(refused.value) is Reason.OVERLOADED
    finally:
        for call in running:
            call.cancel()
    # A cancelled digest gives its place back at once.
    wait_until("a digest place free on n2", lambda: _digested(nodes, "n2"), 5, interval_s=0.2)


def _digested(nodes: Nodes, node_id: str) -> bool:
    try:
        return nodes.digest(node_id, nodes.quiet, 10).keys > 0
    except grpc.RpcError as err:
        if reason(err) is not Reason.OVERLOADED:
            raise
        return False


def test_a_shard_being_written_is_digested_in_one_pass_and_matches_once_writes_stop(nodes: Nodes) -> None:
    cluster = nodes.cluster
    with Writer(cluster, 0.02) as writer, concurrent.futures.ThreadPoolExecutor(3) as pool:
        stored_before = writer.stored
        answers = list(pool.map(lambda n: nodes.digest(n, nodes.busy, 60), ["n1", "n2", "n3"]))
        assert writer.stored > stored_before, "nothing was written while the digests ran"
    for answer in answers:
        assert answer.keys >= MESSAGES
        assert answer.applied_index > 0

    def same() -> bool:
        indexes = set()
        for node_id in ("n1", "n2", "n3"):
            (replica,) = [r for r in cluster.status(node_id).replicas if r.group == nodes.busy]
            indexes.add(replica.applied_index)
        if len(indexes) > 1:
            return False
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            digests = list(pool.map(lambda n: nodes.digest(n, nodes.busy, 60), ["n1", "n2", "n3"]))
        return len({(d.applied_index, d.sha256, d.keys) for d in digests}) == 1

    wait_until("the replicas of the busy shard agreeing", same, 90, interval_s=0.5)
