"""Backup and restore (issue 25) between real clusters: a 3-node source, a 5-node target made from the backup.

The backup runs while a thread keeps storing: every message acknowledged at
or before a shard's fence must be in the restored cluster, none after it.
Broker state (client state, subscriptions, retained messages, read
positions) comes back equal, and an iterator and a read position saved on
the source before the backup go on on the restored cluster. An incremental
backup after a rotation copies only the new generations; a damaged or
partial backup, a non-empty cluster and one of another shard count are
refused with messages naming the problem; export and import need the admin
role. A restore is a state of each shard (issue 44): no step but a begin is
taken outside it, a shard in it takes no other write, even after a leader
change, and one abandoned is empty and writable; a restore that fails
half-way abandons every shard it began.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mqds.cli import main
from mqds.client import Client, ConnectionSettings, Message
from mqds.client.core.backup_files import BackupError, Place, verify
from mqds.client.errors import UnavailableError
from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

N_SHARDS = 4


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("backup-src") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        c.wait_leaders_settled()  # the leader balancer's first moves: the test compares exporters with leaders
        yield c


def admin(cluster: LocalCluster) -> Client:
    return Client(cluster.addresses, settings=ConnectionSettings(timeout_s=30, cluster_secret=cluster.secret))


def _messages(c: Client, topic_filter: str) -> set[tuple[int, int, str, bytes]]:
    return {(m.shard or 0, m.timestamp_us or 0, m.topic, m.payload) for m in c.replay(topic_filter)}


def test_backup_under_load_restores_into_a_5_node_cluster(
    source: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with admin(source) as c:
        before = c.store_batch(
            [Message(topic=f"bk/dev{i % 8}/t", payload=b"%d" % i, sender=f"s{i}", qos=1) for i in range(400)]
        )
        # Broker state of every kind.
        c.client_connected("alice", "broker-1", session_expiry_s=3600)
        c.client_connected("bob", "broker-2", session_expiry_s=3600)
        c.client_disconnected("bob", "broker-2")
        c.subscribe("alice", "bk/+/t", 1)
        c.subscribe("bob", "bk/#", 2)
        c.retain(Message(topic="bk/dev1/state", payload=b"on", sender="s1", retain=True))
        c.start_read_position("bob", "bk/#")
        c.set_retention([("bk/never/#", 365 * 86_400)], default_s=0)
        offline = c.fetch_offline("alice", "bk/+/t", max_count=50)
        assert len(offline) == 50
        c.ack("alice", "bk/+/t", offline[-1])
        saved_position = c.read_position("alice", "bk/+/t")
        # An iterator saved before the backup, read part-way.
        stream = next(s for _, s in c.get_streams("bk/#"))
        iterator = c.make_iterator(stream, "bk/#")
        first = c.next(iterator, 3)
        rest_on_source = c.next(first.iterator, 10_000).messages

        stop = threading.Event()
        acked: list[Message] = []

        def writer() -> None:
            with admin(source) as w:
                i = 0
                while not stop.is_set():
                    acked.extend(
                        w.store_batch([Message(topic=f"bk/load{i % 4}/t", payload=b"L%d" % i, sender=f"w{i}")])
                    )
                    i += 1

        load = threading.Thread(target=writer, daemon=True)
        load.start()
        try:
            while len(acked) < 20:
                stop.wait(0.05)
            place = tmp_path / "backup"
            monkeypatch.setenv("MQDS_CLUSTER_SECRET", source.secret)
            assert main(["--endpoints", ",".join(source.addresses), "backup", "--to", str(place)]) == 0
        finally:
            stop.set()
            load.join(30)
        assert not load.is_alive()
        out = capsys.readouterr().out
        assert "backed up 4 shards" in out and "MB/s" in out
        manifest = Place(str(place)).read_manifest()
        fences = {s.shard: s.fence_us for s in manifest.shards}
        # Read from followers: a follower reaches the fence moments after the leader pinned it.
        leaders = source.leaders()
        assert all(s.node != leaders.get(s.shard) for s in manifest.shards), (leaders, manifest.shards)
        assert len(acked) > 20
        assert any((m.timestamp_us or 0) > fences[m.shard or 0] for m in acked), "the load went on past the fences"
        state_source = (
            c.client_state("alice"),
            c.client_state("bob"),
            c.subscriptions("alice"),
            c.subscriptions("bob"),
            [(m.topic, m.payload) for m in c.retained("bk/#")],
            c.read_position("bob", "bk/#"),
        )
        source_retention = c.retention()
    # The backup checks out.
    assert main(["backup", "--verify", str(place)]) == 0
    assert "whole" in capsys.readouterr().out

    with LocalCluster(tmp_path / "target", 5, n_shards=N_SHARDS) as target:
        target.start()
        monkeypatch.setenv("MQDS_CLUSTER_SECRET", target.secret)
        # One shard of the new cluster holds a subscription: nothing is restored, and the shards whose
        # restore had begun take writes again at once (SHARD_RESTORING would be retried to the timeout).
        intruder = next(f"intruder-{i}" for i in range(100) if shard_of(f"intruder-{i}", N_SHARDS) == 2)
        probes = [next(f"p{s}-{i}" for i in range(1000) if shard_of(f"p{s}-{i}", N_SHARDS) == s) for s in (0, 1, 3)]
        with admin(target) as t:
            t.subscribe(intruder, "x/#")
            with pytest.raises(BackupError, match="not empty, nothing was restored: shard 2 holds subscriptions"):
                t.restore(str(place))
            for probe in probes:
                t.subscribe(probe, "x/#", timeout_s=10)
                assert t.unsubscribe(probe, "x/#", timeout_s=10)
            assert t.unsubscribe(intruder, "x/#")
        assert main(["--endpoints", ",".join(target.addresses), "restore", "--from", str(place)]) == 0
        assert "restored 4 shards" in capsys.readouterr().out
        with admin(target) as t:
            restored = _messages(t, "bk/#")
            expected_before = {(m.shard or 0, m.timestamp_us or 0, m.topic, m.payload) for m in before}
            assert expected_before <= restored
            for m in acked:
                row = (m.shard or 0, m.timestamp_us or 0, m.topic, m.payload)
                if (m.timestamp_us or 0) <= fences[m.shard or 0]:
                    assert row in restored, f"acknowledged before the fence but missing: {row}"
                else:
                    assert row not in restored, f"stored after the fence but restored: {row}"
            assert all(ts <= fences[shard] for shard, ts, _, _ in restored)
            # Broker state equal.
            state_target = (
                t.client_state("alice"),
                t.client_state("bob"),
                t.subscriptions("alice"),
                t.subscriptions("bob"),
                [(m.topic, m.payload) for m in t.retained("bk/#")],
                t.read_position("bob", "bk/#"),
            )
            assert state_target == state_source
            assert t.retention() == source_retention and source_retention is not None
            # The read position saved before the backup goes on: what comes next is after the ack.
            assert t.read_position("alice", "bk/+/t") == saved_position
            after_ack = t.fetch_offline("alice", "bk/+/t", max_count=5)
            assert after_ack and all(
                (m.timestamp_us or 0) > saved_position.acked_us.get(m.shard or 0, 0) for m in after_ack
            )
            # The iterator saved before the backup reads on where it stopped.
            rest = t.next(first.iterator, 10_000).messages
            assert [(m.timestamp_us, m.payload) for m in rest] == [
                (m.timestamp_us, m.payload) for m in rest_on_source if (m.timestamp_us or 0) <= fences[stream.shard]
            ]
            # New writes go on after the fence, in the restored generations.
            new = t.store_batch([Message(topic="bk/new/t", payload=b"new", sender="s1")])
            assert (new[0].timestamp_us or 0) > fences[new[0].shard or 0]
            assert ("bk/new/t", b"new") in {(m.topic, m.payload) for m in t.replay("bk/new/#")}
            # A restored cluster is not empty: restoring again is refused, naming the shard's content.
            with pytest.raises(BackupError, match="not empty, nothing was restored: shard 0 holds"):
                t.restore(str(place))
            assert _messages(t, "bk/#") == restored | {m for m in _messages(t, "bk/new/#")}
        target.assert_replicas_identical()


def test_incremental_backup_after_rotation_copies_only_new_generations(
    source: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    place = str(tmp_path / "inc")
    with admin(source) as c:
        c.store_batch([Message(topic=f"inc/{i}", payload=b"x" * 100, sender=f"i{i}") for i in range(100)])
        c.add_generation()
        c.store_batch([Message(topic=f"inc/{i}", payload=b"y" * 100, sender=f"i{i}") for i in range(100)])
        first = c.backup(place)
        assert first.files_written >= 2 * N_SHARDS and first.files_skipped == 0
        closed = sum(
            1 for _, f in Place(place).read_manifest().files() if f.generation is not None and f.generation.until_us
        )
        assert closed >= N_SHARDS
        c.add_generation()
        c.store_batch([Message(topic=f"inc/{i}", payload=b"z" * 100, sender=f"i{i}") for i in range(100)])
        monkeypatch.setenv("MQDS_CLUSTER_SECRET", source.secret)
        assert main(["--endpoints", ",".join(source.addresses), "backup", "--to", place]) == 0
        out = capsys.readouterr().out
        second = Place(place).read_manifest()
        # Skipped: the closed generations the first backup holds; copied: metadata, the just-closed and new ones.
        old = [f for _, f in second.files() if f.run == first.run]
        new = [f for _, f in second.files() if f.run == second.run]
        assert len(old) == closed
        assert all(f.generation is not None and f.generation.until_us for f in old)
        assert {f.column_family for f in new if f.generation is None} == {"default"}
        assert len(new) == N_SHARDS * 3  # default, the generation closed since, the new current one
        assert f"skipped {closed} files" in out
        # A delete inside closed generations counts a change in each: those are copied again, the rest not.
        closed_now = [(s.shard, f) for s, f in second.files() if f.generation is not None and f.generation.until_us]
        assert len(closed_now) == 2 * N_SHARDS
        home = shard_of("i1", N_SHARDS)
        c.delete_messages("inc/#", sender="i1")  # i1 stored in every generation of its shard
        third = c.backup(place)
        assert third.files_skipped == len(closed_now) - 2
        recopied = [
            (s.shard, f.generation.generation)
            for s, f in Place(place).read_manifest().files()
            if f.run == third.run and f.generation is not None and f.generation.until_us
        ]
        assert sorted(recopied) == [(home, 1), (home, 2)]
    assert verify(Place(place)).ok


def test_damaged_or_partial_backups_are_refused(
    source: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    place = tmp_path / "dmg"
    with admin(source) as c:
        c.store_batch([Message(topic="dmg/a", payload=b"p", sender="d")])
        c.backup(str(place))
    manifest = json.loads((place / "manifest.json").read_text())
    victim = manifest["shards"][1]["files"][-1]["path"]
    data = bytearray((place / victim).read_bytes())
    data[-1] ^= 0xFF
    (place / victim).write_bytes(bytes(data))
    assert main(["backup", "--verify", str(place)]) == 1
    err = capsys.readouterr().err
    assert victim in err and "SHA-256" in err
    with LocalCluster(tmp_path / "one", 1, n_shards=2, replication_factor=1) as other:
        other.start()
        monkeypatch.setenv("MQDS_CLUSTER_SECRET", other.secret)
        endpoints = ["--endpoints", ",".join(other.addresses)]
        # Restore checks the whole backup first: the damaged file is named, nothing is written.
        assert main([*endpoints, "restore", "--from", str(place)]) == 1
        assert victim in capsys.readouterr().err
        (place / victim).write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF]))
        # Whole again, but the cluster has 2 shards, the backup 4.
        assert main([*endpoints, "restore", "--from", str(place)]) == 1
        assert "the backup has 4 shards and the cluster 2" in capsys.readouterr().err
    # A missing file, and a backup without its manifest (one that did not finish).
    partial = tmp_path / "partial"
    shutil.copytree(place, partial)
    (partial / victim).unlink()
    assert main(["backup", "--verify", str(partial)]) == 1
    assert f"{victim} is missing" in capsys.readouterr().err
    (partial / "manifest.json").unlink()
    assert main(["backup", "--verify", str(partial)]) == 1
    assert "no manifest.json" in capsys.readouterr().err
    with admin(source) as c, pytest.raises(BackupError, match=r"no manifest\.json"):
        c.restore(str(partial))


def test_export_and_import_need_the_admin_role_and_sound_requests(source: LocalCluster) -> None:
    channel = grpc.insecure_channel(source.addresses[0])
    stub = pb_grpc.StorageStub(channel)
    secret = [("x-mqds-cluster-secret", source.secret)]
    try:
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ExportShard(pb.ExportShardRequest(shard=0), timeout=10))
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refused:
            stub.ImportShard(pb.ImportShardRequest(shard=0, begin=pb.ImportBegin()), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        bad = [
            pb.ImportShardRequest(shard=0),
            pb.ImportShardRequest(shard=99, begin=pb.ImportBegin()),
            pb.ImportShardRequest(shard=0, records=pb.ImportRecords(column_family="nope", keys=[b"k"], values=[b"v"])),
            pb.ImportShardRequest(
                shard=0, records=pb.ImportRecords(column_family="default", keys=[b"m:applied"], values=[b"\0" * 8])
            ),
            pb.ImportShardRequest(shard=0, records=pb.ImportRecords(column_family="default", keys=[b"k"], values=[])),
        ]
        for request in bad:
            with pytest.raises(grpc.RpcError) as err:
                stub.ImportShard(request, timeout=10, metadata=secret)
            assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), request
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ExportShard(pb.ExportShardRequest(shard=0, fence_us=2**63), timeout=10, metadata=secret))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            skip = [pb.ExportedGeneration(generation=1, until_us=0)]
            list(stub.ExportShard(pb.ExportShardRequest(shard=0, skip=skip), timeout=10, metadata=secret))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()


def _import(cluster: LocalCluster, request: pb.ImportShardRequest) -> pb.ImportShardResponse:
    """One ImportShard step on the shard's leader, found again while leadership moves (NOT_LEADER, NO_LEADER)."""
    deadline = time.monotonic() + 30
    while True:
        leader = cluster.wait_for_leader(request.shard)
        with grpc.insecure_channel(cluster.nodes[leader].address) as channel:
            try:
                return pb_grpc.StorageStub(channel).ImportShard(
                    request, timeout=20, metadata=[("x-mqds-cluster-secret", cluster.secret)]
                )
            except grpc.RpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
        time.sleep(0.2)


def _refused(cluster: LocalCluster, request: pb.ImportShardRequest, reason: Reason) -> str:
    with pytest.raises(grpc.RpcError) as err:
        _import(cluster, request)
    refusal = errors.from_rpc_error(err.value)
    assert refusal.reason is reason, (request, refusal)
    return refusal.message


def _sender_of(shard: int, n_shards: int, prefix: str) -> str:
    return next(f"{prefix}{i}" for i in range(1000) if shard_of(f"{prefix}{i}", n_shards) == shard)


def test_a_restore_is_a_state_of_the_shard_no_step_writes_outside_it_and_it_can_be_abandoned(tmp_path: Path) -> None:
    """Issue 44: ImportShard records and finish were applied without a begin: a forged record replaced an
    acknowledged message on every replica, and a finish a day ahead pushed every later write a day ahead."""
    with LocalCluster(tmp_path / "c", 3, n_shards=2) as cluster:
        cluster.start()
        live, empty = 0, 1
        with admin(cluster) as c:
            (acked,) = c.store_batch([Message(topic="sm/1", payload=b"acknowledged", sender=_sender_of(live, 2, "a"))])
            assert acked.shard == live
            # The acknowledged message's key, as a backup holds it: a forged record would replace its value.
            with grpc.insecure_channel(cluster.nodes[cluster.wait_for_leader(live)].address) as channel:
                answers = pb_grpc.StorageStub(channel).ExportShard(
                    pb.ExportShardRequest(shard=live),
                    timeout=20,
                    metadata=[("x-mqds-cluster-secret", cluster.secret)],
                )
                family, key = "", b""
                for answer in answers:
                    if answer.HasField("section"):
                        family = answer.section.column_family
                    elif answer.HasField("records"):
                        for k in answer.records.keys:
                            if k[:1] == b"D" and int.from_bytes(k[5:13], "big") == acked.timestamp_us:
                                key = k
            assert key, "the acknowledged message is not in the export"
            forged = pb.Message(topic="sm/1", payload=b"forged").SerializeToString()
            records = pb.ImportRecords(column_family=family, keys=[key], values=[forged])
            message = _refused(cluster, pb.ImportShardRequest(shard=live, records=records), Reason.NOT_RESTORING)
            assert f"shard {live} is not being restored: ImportShard records comes after a begin" in message
            finish = pb.ImportFinish(last_ts=acked.timestamp_us or 0)
            _refused(cluster, pb.ImportShardRequest(shard=live, finish=finish), Reason.NOT_RESTORING)
            # A day ahead (less than the day once allowed): refused by the leader, before anything is logged.
            now_us = time.time_ns() // 1000
            ahead = pb.ImportFinish(last_ts=now_us + 86_400_000_000 - 60_000_000)
            message = _refused(cluster, pb.ImportShardRequest(shard=live, finish=ahead), Reason.INVALID_REQUEST)
            assert "after this node's clock, more than the 5 minutes it takes" in message
            assert [m.payload for m in c.replay("sm/#")] == [b"acknowledged"]
            (later,) = c.store_batch([Message(topic="sm/2", payload=b"later", sender=_sender_of(live, 2, "a"))])
            assert (later.timestamp_us or 0) < time.time_ns() // 1000 + 60_000_000
            # A shard that holds data cannot begin a restore.
            message = _refused(
                cluster, pb.ImportShardRequest(shard=live, begin=pb.ImportBegin()), Reason.SHARD_NOT_EMPTY
            )
            assert "new, empty cluster only" in message

            # The empty shard in restore mode: it takes the restore's steps and no other write.
            _import(cluster, pb.ImportShardRequest(shard=empty, begin=pb.ImportBegin()))
            rid = _sender_of(empty, 2, "r")
            state = spb.ClientState(online=False, node="b1").SerializeToString()
            restored = pb.ImportRecords(column_family="default", keys=[b"c:" + rid.encode()], values=[state])
            assert _import(cluster, pb.ImportShardRequest(shard=empty, records=restored)).records == 1
            assert c.client_state(rid) is not None
            future = pb.ImportRecords(
                column_family="gen-00000001",
                keys=[b"D" + bytes(4) + (now_us + 3_600_000_000).to_bytes(8, "big")],
                values=[pb.Message(topic="sm/9").SerializeToString()],
            )
            message = _refused(cluster, pb.ImportShardRequest(shard=empty, records=future), Reason.INVALID_REQUEST)
            assert "the latest this node takes" in message
            _refused(cluster, pb.ImportShardRequest(shard=empty, finish=ahead), Reason.INVALID_REQUEST)
        writer = _sender_of(empty, 2, "e")
        with Client(cluster.addresses, settings=ConnectionSettings(timeout_s=2, cluster_secret=cluster.secret)) as w:
            with pytest.raises(UnavailableError) as err:
                w.store_batch([Message(topic="sm/3", payload=b"mixed", sender=writer)])
            assert err.value.reason is Reason.SHARD_RESTORING
            # Restore mode is the shard's replicated state: a new leader has it.
            old = cluster.wait_for_leader(empty)
            cluster.kill(old)
            cluster.wait_for_leader(empty, exclude=[old])
            with pytest.raises(UnavailableError) as err:
                w.store_batch([Message(topic="sm/3", payload=b"mixed", sender=writer)])
            assert err.value.reason is Reason.SHARD_RESTORING
        cluster.start_node(old)
        with admin(cluster) as c:
            # Abandoned: what the restore wrote is gone, and the shard takes writes again.
            _import(cluster, pb.ImportShardRequest(shard=empty, abandon=pb.ImportAbandon()))
            assert c.client_state(rid) is None
            (taken,) = c.store_batch([Message(topic="sm/3", payload=b"after", sender=writer)])
            assert taken.shard == empty
            _refused(cluster, pb.ImportShardRequest(shard=empty, abandon=pb.ImportAbandon()), Reason.NOT_RESTORING)
            assert sorted(m.payload for m in c.replay("sm/#")) == [b"acknowledged", b"after", b"later"]
        cluster.assert_replicas_identical()


def test_a_restore_that_fails_half_way_abandons_every_shard_it_began(
    source: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    place = tmp_path / "half"
    with admin(source) as c:
        c.store_batch([Message(topic=f"half/{s}", payload=b"h", sender=_sender_of(s, N_SHARDS, "h")) for s in range(4)])
        c.backup(str(place))
    manifest = json.loads((place / "manifest.json").read_text())
    intact = json.dumps(manifest)
    # Shard 0 finishes below its records' timestamps (its fence cut to 1): refused when applied, after every
    # shard's records are in.
    manifest["shards"][0]["fence_us"] = 1
    (place / "manifest.json").write_text(json.dumps(manifest))
    with LocalCluster(tmp_path / "one", 1, n_shards=N_SHARDS, replication_factor=1) as target:
        target.start()
        with admin(target) as t:
            with pytest.raises(BackupError) as err:
                t.restore(str(place))
            assert "last_ts 1 is before timestamp" in str(err.value)
            assert f"the restore of the {N_SHARDS} shards it began was abandoned" in str(err.value)
            # Empty and writable: the whole backup restores now.
            (place / "manifest.json").write_text(intact)
            monkeypatch.setenv("MQDS_CLUSTER_SECRET", target.secret)
            assert main(["--endpoints", ",".join(target.addresses), "restore", "--from", str(place)]) == 0
            assert "restored 4 shards" in capsys.readouterr().out
            assert {m.topic for m in t.replay("half/#")} == {f"half/{s}" for s in range(4)}
            # Nothing left to abandon.
            assert main(["--endpoints", ",".join(target.addresses), "restore", "--abandon"]) == 0
            assert "no shard was being restored" in capsys.readouterr().out
