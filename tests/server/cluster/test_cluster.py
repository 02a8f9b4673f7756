"""Clusters of real mqds-server processes on loopback: failover, restarts, snapshots, membership, partitions."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mqds.client import Client, ConnectionSettings, Message
from mqds.client import errors as E
from mqds.protocol.errors import from_rpc_error
from mqds.protocol.sharding import shard_of
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.raft.v1 import raft_pb2_grpc as rpb_grpc
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.ports import free_port
from mqds.tools.waiting import wait_until
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MQDS = str(Path(sys.executable).with_name("mqds"))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "c", 3, n_shards=4) as c:
        c.start()
        yield c


def messages(publisher: str, start: int, count: int) -> list[Message]:
    return [
        Message(topic=f"dev/{publisher}/seq", payload=str(seq).encode(), sender=publisher, qos=1)
        for seq in range(start, start + count)
    ]


class Publishers:
    """Publishers writing (publisher, sequence) messages until stopped; records what was acknowledged."""

    def __init__(self, client: Client, names: list[str], batch: int = 20) -> None:
        self.client = client
        self.names = names
        self.batch = batch
        self.acked: dict[str, list[int]] = defaultdict(list)
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in names]

    def _run(self, name: str) -> None:
        seq = 0
        retry: int | None = None
        while not self._stop.is_set():
            try:
                self.client.store_batch(messages(name, seq, self.batch), timeout_s=15, sequence=retry)
            except E.MqdsError as err:
                self.failures.append(f"{name}@{seq}: {err}")
                # The same messages again, as the same call: stored once even
                # if the failed attempt did commit.
                retry = int(err.metadata["sequence"])
                continue
            retry = None
            self.acked[name].extend(range(seq, seq + self.batch))
            seq += self.batch

    def __enter__(self) -> Publishers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def total(self) -> int:
        return sum(len(v) for v in self.acked.values())


def check_every_acked_message(client: Client, acked: dict[str, list[int]], stale_ok: bool = False) -> None:
    """Every acknowledged (publisher, seq) is stored, in publish order per publisher."""
    seen: dict[str, list[int]] = defaultdict(list)
    for m in client.replay("dev/#", stale_ok=stale_ok):
        seen[m.sender].append(int(m.payload))
    for name, seqs in acked.items():
        stored = seen[name]
        missing = set(seqs) - set(stored)
        assert not missing, f"{name}: {len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
        # Exactly once: a batch retried after an unknown outcome (its leader
        # died after committing it) is not stored twice.
        assert len(stored) == len(set(stored)), f"{name}: {len(stored) - len(set(stored))} messages stored twice"
        assert stored == sorted(stored), f"{name}: replay out of publish order"


def test_writes_survive_killing_the_leader_and_it_catches_up(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "c", 5, n_shards=4) as cluster:
        cluster.start()
        _kill_leader_during_writes(cluster)


def test_killing_each_vnode_leader_in_turn_stores_every_ack_exactly_once(cluster: LocalCluster) -> None:
    client = cluster.client(timeout_s=20)
    # Publishers on every shard, so each kill hits some of them mid-write.
    publishers: list[str] = []
    for i in range(200):
        name = f"pub-{i}"
        if shard_of(name, cluster.n_shards) not in {shard_of(p, cluster.n_shards) for p in publishers}:
            publishers.append(name)
    assert len(publishers) == cluster.n_shards
    with Publishers(client, publishers, batch=10) as pubs:
        for shard, name in sorted((shard_of(p, cluster.n_shards), p) for p in publishers):
            wait_until("writes to the shard", lambda name=name: len(pubs.acked[name]) > 30, 30)
            victim = cluster.wait_for_leader(shard)
            cluster.kill(victim)
            cluster.wait_for_leader(shard, exclude=[victim])
            before = len(pubs.acked[name])
            wait_until(
                f"writes to shard {shard} resuming", lambda name=name, n=before: len(pubs.acked[name]) > n + 20, 30
            )
            cluster.restart(victim)
    check_every_acked_message(client, pubs.acked)
    cluster.assert_replicas_identical(timeout_s=60)
    client.close()


def _kill_leader_during_writes(cluster: LocalCluster) -> None:
    client = cluster.client(timeout_s=20)
    publishers = [f"pub-{i}" for i in range(6)]
    shard = shard_of(publishers[0], cluster.n_shards)
    with Publishers(client, publishers) as pubs:
        wait_until("some writes", lambda: pubs.total() > 200, 30)
        victim = cluster.wait_for_leader(shard)
        cluster.kill(victim)
        killed_at = time.monotonic()
        new_leader = cluster.wait_for_leader(shard, exclude=[victim])
        failover_s = time.monotonic() - killed_at
        before = len(pubs.acked[publishers[0]])
        wait_until("writes to the shard resuming", lambda: len(pubs.acked[publishers[0]]) > before + 40, 30)
    assert new_leader != victim
    assert failover_s < 10, failover_s
    check_every_acked_message(client, pubs.acked)

    cluster.restart(victim)
    cluster.assert_replicas_identical(timeout_s=60)
    # The restarted replica holds everything too: read it from that node alone.
    with Client([cluster.nodes[victim].address]) as alone:
        status = cluster.status(victim)
        assert all(r.applied_index > 0 for r in status.replicas if r.group < cluster.n_shards)
        check_every_acked_message(alone, pubs.acked, stale_ok=True)


def test_wiped_replica_comes_back_by_snapshot(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "c", 3, n_shards=2, args=["--raft-log-max-bytes", "50000"]) as cluster:
        cluster.start()
        client = cluster.client()
        acked: dict[str, list[int]] = defaultdict(list)
        for round_ in range(20):
            for name in ("a", "b", "c"):
                client.store_batch(messages(name, round_ * 50, 50))
                acked[name].extend(range(round_ * 50, round_ * 50 + 50))
        # The journals were compacted: a new replica cannot be fed from the log alone.
        assert all(r.log_bytes < 200_000 for r in cluster.status("n1").replicas)
        cluster.wipe("n3")
        client.store_batch(messages("a", 1000, 50))
        acked["a"].extend(range(1000, 1050))
        cluster.start_node("n3")
        cluster.assert_replicas_identical(timeout_s=60)
        status = cluster.status("n3")
        assert sum(r.snapshots_installed for r in status.replicas if r.group < 2) >= 1
        with Client([cluster.nodes["n3"].address]) as alone:
            check_every_acked_message(alone, acked, stale_ok=True)


def test_restart_of_all_nodes_loses_nothing(cluster: LocalCluster) -> None:
    client = cluster.client()
    acked: dict[str, list[int]] = defaultdict(list)
    for name in ("x", "y", "z", "w"):
        client.store_batch(messages(name, 0, 300))
        acked[name].extend(range(300))
    cluster.kill_all()
    cluster.start()
    check_every_acked_message(client, acked)
    cluster.assert_replicas_identical()
    # Generations and iterators survive too.
    gens = client.list_generations()
    assert len(gens) == cluster.n_shards and all(g.current for g in gens)


def test_a_node_restarted_at_a_new_address_rejoins(cluster: LocalCluster) -> None:
    client = cluster.client()
    client.store_batch(messages("m", 0, 50))
    moved = cluster.nodes["n3"]
    moved.kill()
    moved.port = free_port()
    moved.start(60)
    wait_until(
        "the cluster map showing n3's new address",
        lambda: next(n.address for n in cluster.cluster_map("n2").nodes if n.id == "n3") == moved.address,
        30,
    )
    # With n1 gone, every vnode needs n3 at its new address for a majority.
    cluster.kill("n1")
    with Client([cluster.nodes["n2"].address, moved.address], timeout_s=30) as survivors:
        survivors.store_batch([m for name in ("p", "q", "r", "s") for m in messages(name, 0, 20)])
    cluster.start_node("n1")
    cluster.assert_replicas_identical(timeout_s=60)


def test_a_replica_down_during_rotation_and_retention_converges(cluster: LocalCluster) -> None:
    client = cluster.client(settings=ConnectionSettings(cluster_secret=cluster.secret))  # generations: admin calls
    client.store_batch([m for name in ("a", "b", "c", "d") for m in messages(name, 0, 20)])
    cluster.kill("n2")
    client.add_generation()
    client.store_batch([m for name in ("a", "b", "c", "d") for m in messages(name, 20, 20)])
    dropped = [client.drop_generation(s, 1) for s in range(cluster.n_shards)]
    assert all(g.generation == 1 for g in dropped)
    cluster.start_node("n2")
    cluster.assert_replicas_identical(timeout_s=60)
    with Client([cluster.nodes["n2"].address]) as alone:
        gens = alone.list_generations(stale_ok=True)
        assert [(g.shard, g.generation) for g in gens] == [(s, 2) for s in range(cluster.n_shards)]


def test_a_minority_accepts_no_writes_and_serves_no_stale_reads(cluster: LocalCluster) -> None:
    client = cluster.client()
    client.store_batch(messages("p", 0, 10))
    # Give n1 leadership of a shard, then cut it off from the others.
    shard = next(s for s in range(cluster.n_shards) if cluster.replicas(s)[0] == "n1")
    wait_until("n1 leading its preferred shard", lambda: cluster.leader(shard) == "n1", 30)
    cluster.partition(["n1"], ["n2", "n3"])
    stub = pb_grpc.StorageStub(grpc.insecure_channel(cluster.nodes["n1"].address))

    def read_on_minority() -> E.MqdsError:
        try:
            stub.GetStreams(pb.GetStreamsRequest(topic_filter="#", shards=[shard]), timeout=5)
        except grpc.RpcError as err:
            return from_rpc_error(err)
        raise AssertionError("the cut-off node served a linearizable read")

    # At once (before it notices) and later: the old leader cannot confirm a majority.
    assert read_on_minority().retriable
    new_leader = cluster.wait_for_leader(shard, exclude=["n1"], timeout_s=30)
    assert read_on_minority().reason in (E.Reason.NOT_LEADER, E.Reason.NO_LEADER, E.Reason.DEADLINE_EXCEEDED)
    sender = next(f"p{i}" for i in range(1000) if shard_of(f"p{i}", cluster.n_shards) == shard)
    request = pb.StoreBatchRequest(messages=[m.to_pb() for m in messages(sender, 0, 1)])
    with pytest.raises(grpc.RpcError) as info:
        stub.StoreBatch(request, timeout=15)
    assert from_rpc_error(info.value).reason in (E.Reason.NOT_LEADER, E.Reason.NO_LEADER)
    # The majority side keeps taking writes for every shard.
    with Client([cluster.nodes["n2"].address, cluster.nodes["n3"].address], timeout_s=30) as majority:
        majority.store_batch([m for name in ("q", "r", "s", "t") for m in messages(name, 0, 5)])
    assert new_leader in ("n2", "n3")
    cluster.heal()
    cluster.assert_replicas_identical(timeout_s=60)


def mqds_cli(cluster: LocalCluster, *args: str) -> str:
    """Run the `mqds` command against the cluster (any live node as endpoint); its output."""
    endpoints = ",".join(cluster.nodes[n].address for n in cluster.live())
    env = {**os.environ, "MQDS_CLUSTER_SECRET": cluster.secret}  # admin commands present it
    result = subprocess.run(
        [MQDS, "--endpoints", endpoints, *args], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_join_rebalance_leave_and_forget(cluster: LocalCluster) -> None:
    client = cluster.client()
    acked: dict[str, list[int]] = defaultdict(list)

    def write(round_: int) -> None:
        for name in ("a", "b", "c", "d"):
            client.store_batch(messages(name, round_ * 100, 100))
            acked[name].extend(range(round_ * 100, round_ * 100 + 100))

    write(0)
    n4 = cluster.add_node("n4")
    out = mqds_cli(cluster, "admin", "join", "n4", "--address", n4.address)
    assert "node n4 joined" in out and "n4" in out.splitlines()[-1]
    n4.wait(60)
    out = mqds_cli(cluster, "admin", "rebalance")
    assert "moved replica" in out, "a rebalance onto an empty node moves replicas"
    placement = {v.shard: list(v.replicas) for v in cluster.cluster_map().vnodes}
    counts: dict[str, int] = defaultdict(int)
    for replicas in placement.values():
        assert len(replicas) == len(set(replicas)) == 3
        for node in replicas:
            counts[node] += 1
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    write(1)
    cluster.assert_replicas_identical(timeout_s=60)
    status = mqds_cli(cluster, "status")
    assert "4 nodes" in status and "NONE" not in status, status

    # n2 leaves: its replicas move away first (never fewer than three), then it is removed.
    leaving = "n2"
    out = mqds_cli(cluster, "admin", "leave", leaving)
    assert f"node {leaving} left" in out
    cmap = cluster.cluster_map()
    assert leaving not in [n.id for n in cmap.nodes]
    assert all(leaving not in v.replicas and len(v.replicas) == 3 for v in cmap.vnodes)
    cluster.nodes.pop(leaving).stop()
    write(2)
    cluster.assert_replicas_identical(timeout_s=60)

    # A node that died for good is forgotten; with two nodes left, each vnode keeps two replicas.
    gone = next(n for n in cluster.live() if n != cluster.cluster_map().meta_leader)
    cluster.kill(gone)
    cluster.nodes.pop(gone)
    out = mqds_cli(cluster, "admin", "forget", gone)
    assert f"node {gone} forgotten" in out
    assert gone not in [n.id for n in cluster.cluster_map().nodes]
    write(3)
    cluster.assert_replicas_identical(timeout_s=60)
    check_every_acked_message(client, acked)


def test_a_replica_move_cut_short_is_finished_by_the_metadata_leader(tmp_path: Path) -> None:
    # A move changes a vnode's placement and its Raft group one after the
    # other. Here only the placement is changed, as when the metadata leader
    # dies (or loses leadership) between the two steps. Left so, a node holds
    # a placed replica that no leader ever contacts and never gets ready.
    with LocalCluster(tmp_path / "c", 3, n_shards=4, args=["--placement-repair-interval-s", "1"]) as cluster:
        cluster.start()
        client = cluster.client()
        acked: dict[str, list[int]] = defaultdict(list)
        for name in ("a", "b", "c", "d"):
            client.store_batch(messages(name, 0, 100))
            acked[name].extend(range(100))
        n4 = cluster.add_node("n4")
        mqds_cli(cluster, "admin", "join", "n4", "--address", n4.address)
        n4.wait(60)
        before = {v.shard: list(v.replicas) for v in cluster.cluster_map().vnodes}
        replaced = before[1][-1]
        cut_short = {
            0: [*before[0], "n4"],  # an add cut short before the Raft group took n4
            1: [*before[1][:-1], "n4"],  # a move of `replaced` to n4, where neither side reached the group
        }
        meta_leader = cluster.cluster_map().meta_leader
        raft = rpb_grpc.RaftStub(grpc.insecure_channel(cluster.nodes[meta_leader].address))
        for shard, replicas in cut_short.items():
            command = cpb.MetaCommand(set_replicas=cpb.SetReplicas(shard=shard, replicas=replicas))
            raft.ProposeMeta(
                rpb.ProposeMetaRequest(command=command.SerializeToString()),
                timeout=10,
                metadata=[(SECRET_HEADER, cluster.secret), (NODE_HEADER, "harness")],
            )

        def agreed() -> dict[int, list[str]] | None:
            placed = {v.shard: list(v.replicas) for v in cluster.cluster_map().vnodes}
            members: dict[int, list[str]] = {}
            for node_id in cluster.live():
                for r in cluster.status(node_id).replicas:
                    if r.role == clpb.RAFT_ROLE_LEADER and r.group in placed:
                        members[r.group] = sorted(r.members)
            if all(members.get(s) == sorted(r) for s, r in placed.items()) and placed[1] == cut_short[1]:
                return placed
            return None

        placed = wait_until("every vnode's Raft group holding the replicas its placement names", agreed, 90)
        assert placed[0] == before[0], "the add cut short is undone: n4 left shard 0's placement"
        assert placed[1] == cut_short[1], "the move cut short is finished: n4 took the replaced replica's place"
        cluster.wait_ready(60)  # n4 among them: its replica of shard 1 caught up
        assert all(r.group != 1 for r in cluster.status(replaced).replicas), f"{replaced} still holds shard 1"
        for name in ("a", "b", "c", "d"):
            client.store_batch(messages(name, 100, 100))
            acked[name].extend(range(100, 200))
        cluster.assert_replicas_identical(timeout_s=60)
        check_every_acked_message(client, acked)


def test_five_replicas_survive_losing_two_nodes(tmp_path: Path) -> None:
    # Five nodes and five replicas per vnode: any two nodes may die and every
    # shard still has a majority. (With three replicas, two dead nodes that
    # share a vnode stop that vnode's writes, and lose nothing.)
    with LocalCluster(tmp_path / "c", 5, n_shards=5, replication_factor=5) as cluster:
        cluster.start()
        client = cluster.client(timeout_s=30)
        acked: dict[str, list[int]] = defaultdict(list)
        for name in ("a", "b", "c", "d", "e"):
            client.store_batch(messages(name, 0, 100))
            acked[name].extend(range(100))
        cluster.kill("n1")
        cluster.kill("n2")
        for name in ("a", "b", "c", "d", "e"):
            client.store_batch(messages(name, 100, 100))
            acked[name].extend(range(100, 200))
        check_every_acked_message(client, acked)
        cluster.start_node("n1")
        cluster.start_node("n2")
        cluster.assert_replicas_identical(timeout_s=60)


def test_internal_calls_need_the_cluster_secret_and_garbage_is_dropped(cluster: LocalCluster) -> None:
    channel = grpc.insecure_channel(cluster.nodes["n1"].address)
    raft = rpb_grpc.RaftStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        raft.InjectFault(rpb.InjectFaultRequest(), timeout=5, metadata=[(SECRET_HEADER, "wrong"), (NODE_HEADER, "x")])
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        list(raft.FetchSnapshot(rpb.FetchSnapshotRequest(group=0), timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # A peer with the secret that sends garbage: frames that do not parse, a
    # pickled membership change, an unknown command type. All dropped and counted.
    metadata = [(SECRET_HEADER, cluster.secret), (NODE_HEADER, "n2")]
    evil = rpb.RaftMessage()
    evil.append_entries.term = 10**6
    evil.append_entries.prev_log_index = 1
    evil.append_entries.entries.add(command=b"\x02" + b"\x80\x02cos\nsystem\n", index=2, term=10**6)
    unknown = rpb.RaftMessage()
    unknown.append_entries.entries.add(command=b"\x03\x80\x02K\x07.", index=1, term=1)
    frames = [
        b"\xff\xfe garbage",
        rpb.Frame(messages=[rpb.Envelope(group=0, message=evil)]).SerializeToString(),
        rpb.Frame(messages=[rpb.Envelope(group=0, message=unknown)]).SerializeToString(),
        rpb.Frame(messages=[rpb.Envelope(group=12345, message=rpb.RaftMessage())]).SerializeToString(),
    ]
    stream = channel.stream_unary(
        "/mqds.server.raft.v1.Raft/Stream", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    stream(iter(frames), timeout=10, metadata=metadata)
    status = cluster.status("n1")
    assert status.dropped_raft_messages >= 4
    # The node still works, and its term was not pushed by the forged message.
    client = cluster.client()
    client.store_batch(messages("after", 0, 5))
    assert all(r.term < 10**6 for r in cluster.status("n1").replicas)


def test_a_batch_retried_after_its_answer_was_lost_is_stored_once(cluster: LocalCluster) -> None:
    """The first attempt commits but its answer never arrives; the client's retry must not store it again."""
    with cluster.client(timeout_s=20) as client:
        real = client._rpc
        lost: list[str] = []

        def lose_first_answer(
            address: str, method: str, request: object, timeout_s: float, service: str = "Storage"
        ) -> object:
            response = real(address, method, request, timeout_s, service)
            if method == "StoreBatch" and not lost:
                lost.append(address)
                raise E.DeadlineExceededError(E.Reason.DEADLINE_EXCEEDED, "answer lost on the way back")
            return response

        client._rpc = lose_first_answer  # type: ignore[method-assign]
        batch = [m for name in ("p1", "p2", "p3") for m in messages(name, 0, 10)]
        stored = client.store_batch(batch)
        assert lost, "the first answer was not lost: the test did not test anything"
        assert len(stored) == 30 and all(m.timestamp_us for m in stored)
        check_every_acked_message(client, {name: list(range(10)) for name in ("p1", "p2", "p3")})
        assert len(list(client.replay("dev/#"))) == 30


def test_a_partial_failure_says_what_was_stored_and_a_retry_completes_it(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "c", 3, n_shards=6, replication_factor=1) as cluster:
        cluster.start()
        with cluster.client(timeout_s=20) as client:
            cmap = client.cluster_map()
            victim = cmap.vnodes[0].replicas[0]
            lost_shards = {v.shard for v in cmap.vnodes if victim in v.replicas}
            names = [f"pub-{i}" for i in range(40)]
            batch = [m for name in names for m in messages(name, 0, 3)]
            cluster.kill(victim)
            with pytest.raises(E.PartialBatchError) as exc:
                client.store_batch(batch, timeout_s=3)
            err = exc.value
            assert err.retriable, err
            assert {m.shard for m in err.failed_messages} == lost_shards
            assert all(m.shard not in lost_shards and m.timestamp_us for m in err.stored)
            assert len(err.stored) + len(err.failed) == len(batch)
            assert f"{len(err.stored)} messages stored, {len(err.failed)} not" in str(err)
            cluster.start_node(victim)
            again = client.store_batch(err.failed_messages, sequence=err.sequence)
            assert len(again) == len(err.failed)
            check_every_acked_message(client, {name: [0, 1, 2] for name in names})


def test_followers_never_rewrite_entries_under_pipelined_writes(cluster: LocalCluster) -> None:
    """With many appends in flight, acknowledgements must not make the leader send entries again.

    pysyncobj rewound a follower's next index to each acknowledgement, so the
    entries still in flight were sent a second time and the follower cut them
    from its journal (already applied, as it logs) and wrote them again.
    """
    with cluster.client(timeout_s=20) as client, Publishers(client, [f"pipe-{i}" for i in range(12)], batch=50) as pubs:
        wait_until("pipelined writes", lambda: pubs.total() > 30_000, 60)
    logs = {node_id: proc.log_path.read_text(errors="replace") for node_id, proc in cluster.nodes.items()}
    rewritten = {node_id: text.count("truncating already-applied") for node_id, text in logs.items()}
    assert not any(rewritten.values()), rewritten
