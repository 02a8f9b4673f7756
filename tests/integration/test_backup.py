"""Backup and restore (issue 25) between real clusters: a 3-node source, a 5-node target made from the backup.

The backup runs while a thread keeps storing: every message acknowledged at
or before a shard's fence must be in the restored cluster, none after it.
Broker state (client state, subscriptions, retained messages, read
positions) comes back equal, and an iterator and a read position saved on
the source before the backup go on on the restored cluster. An incremental
backup after a rotation copies only the new generations; a damaged or
partial backup, a non-empty cluster and one of another shard count are
refused with messages naming the problem; export and import need the admin
role.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mqds.cli import main
from mqds.client import Client, ConnectionSettings, Message
from mqds.client.backup_files import BackupError, Place, verify
from mqds.protocol.sharding import shard_of
from mqds.tools.localproc import LocalCluster
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
