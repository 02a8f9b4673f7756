"""A shard exported from a checkpoint at a fence, and restored into another: the key-exact copy a backup makes."""

from __future__ import annotations

from pathlib import Path

import pytest
from storage_support import msg, replay

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.cluster.vnode import VnodeReplica
from mqds.server.storage import keys
from mqds.server.storage.deletes import DeleteSpec
from mqds.server.storage.export import CheckpointExport, ExportedGeneration
from mqds.server.storage.restore import check_records
from mqds.server.storage.shard import Engine, ShardStorage
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb


def export(shard: ShardStorage, where: Path, fence: int | None, skip: dict[int, ExportedGeneration] | None = None):
    path = str(where / f"cp-{len(list(where.iterdir()))}")
    shard.checkpoint(path)
    out = CheckpointExport(path, fence, skip or {})
    try:
        sections = [(s.column_family, s.generation, s.skipped, list(s.records)) for s in out.sections()]
        return out.fence_us, out.generations, sections
    finally:
        out.close()


def restore(target: ShardStorage, sections, fence: int) -> None:
    assert target.restore_begin(applied_index=1) is None
    for name, _, skipped, records in sections:
        assert not skipped
        if records:
            check_records(target.shard, name, [k for k, _ in records], [v for _, v in records])
            target.restore_records(name, [k for k, _ in records], [v for _, v in records], applied_index=2)
    target.restore_finish(fence, applied_index=3)


def rows(shard: ShardStorage) -> list[tuple[int, str, bytes]]:
    return [(r.ts, r.message.topic, r.message.payload) for r in replay(shard, "#")]


def test_export_at_a_fence_restores_the_shard_as_it_stood(tmp_path: Path) -> None:
    engine = Engine()
    src = ShardStorage(str(tmp_path / "src"), 0, engine)
    dst = ShardStorage(str(tmp_path / "dst"), 0, engine)
    cps = tmp_path / "cps"
    cps.mkdir()
    try:
        src.initialize(500)
        src.store([msg("a/1", b"one"), msg("a/2", b"two")], 1_000, dedup=(b"p", 1))
        src.add_generation(2_000)
        second = src.store([msg("a/1", b"three")], 3_000, dedup=(b"p", 2))
        src.sessions.subscribe("c1", "a/#", 1)
        fence = src.last_ts
        # After the fence: a batch, a rotation and its generation, and the batch's dedup record.
        src.store([msg("a/3", b"late")], 4_000, dedup=(b"p", 3))
        src.add_generation(5_000)
        src.store([msg("a/1", b"later")], 6_000)
        got_fence, gens, sections = export(src, cps, fence)
        assert got_fence == fence
        assert [g.number for g in gens] == [1, 2] and gens[0].closed and not gens[1].closed
        names = [name for name, *_ in sections]
        assert names == ["default", "gen-00000001", "gen-00000002"]
        meta = dict(sections[0][3])
        assert keys.META_APPLIED not in meta and meta[keys.META_LAST_TS] == keys.u64(fence)
        assert keys.generation_key(3) not in meta
        assert keys.dedup_key(b"p", 3) not in meta and keys.dedup_key(b"p", 2) in meta
        restore(dst, sections, fence)
        assert rows(dst) == [r for r in rows(src) if r[0] <= fence]
        # Generation 2 closed after the fence, so it is exported open, still knowing the last message before it.
        assert [(g.generation, g.until_us, g.last_before_us) for g in dst.generations()] == [
            (1, gens[0].until_us, 0),
            (2, None, 1_001),
        ]
        assert dst.last_ts == fence and dst.applied_index == 3
        assert dst.sessions.subscriptions("c1") == [("a/#", 1)]
        # Storing goes on after the fence in the restored current generation; a batch resent is stored once.
        assert dst.store([msg("a/1", b"new")], 7_000) > fence
        assert dst.store([msg("a/1", b"three")], 7_500, dedup=(b"p", 2)) == second
        assert dst.store([msg("a/3", b"late")], 7_600, dedup=(b"p", 3)) > 7_000
        # Restoring over it is refused: it holds messages now.
        refused = dst.restore_begin(applied_index=4)
        assert refused is not None and refused.reason is Reason.SHARD_NOT_EMPTY
        assert "messages in generation" in refused.message and dst.applied_index == 4
    finally:
        src.close()
        dst.close()


def test_a_delete_in_a_closed_generation_changes_its_identity(tmp_path: Path) -> None:
    src = ShardStorage(str(tmp_path / "src"), 0, Engine())
    cps = tmp_path / "cps"
    cps.mkdir()
    try:
        src.initialize(500)
        src.store([msg("a/1", sender="x"), msg("a/2", sender="y")], 1_000)
        src.add_generation(2_000)
        src.store([msg("a/1", sender="x")], 3_000)
        _, gens, _ = export(src, cps, None)
        closed = gens[0]
        assert closed.closed and closed.changes == 0
        # Offered as held: skipped, no records read.
        _, _, sections = export(src, cps, None, {1: closed})
        assert sections[1][2] is True and sections[1][3] == []
        src.delete_messages(DeleteSpec("a/#", "x", 0, 0), None, 100)
        _, gens, sections = export(src, cps, None, {1: closed})
        assert gens[0].changes == 1 and gens[1].changes == 1
        assert sections[1][2] is False and len([k for k, _ in sections[1][3] if k[:1] == b"D"]) == 1
    finally:
        src.close()


@pytest.mark.parametrize(
    ("family", "key", "value", "why"),
    [
        ("default", b"m:applied", b"\0" * 8, "Raft state"),
        ("default", b"m:applied_part", b"\0" * 12, "Raft state"),
        ("default", b"m:shard", keys.u32(3), "of shard 3, not shard 0"),
        ("default", b"m:format", keys.u16(9), "format 9"),
        ("default", b"m:lts", b"\0" * 4, "4 bytes, not 8"),
        ("default", b"g:\0\0\0\1", b"junk", "not a record of its kind"),
        ("default", b"g:\0\0\0\1", b"\x07" + bytes(24), "version 7"),
        ("default", b"g:\0\0\0\1", b"\x02" + bytes(24), "version 2 is 33 bytes, not 25"),
        ("default", b"g:\0\0\0\1", b"\x01" + bytes(32), "version 1 is 25 bytes, not 33"),
        ("default", b"t:\0\0", keys.u32(1), "not a trie edge"),
        ("gen-00000001", b"Xjunkjunkjunkjunk", b"", "not a key of a generation"),
        ("gen-00000001", keys.data_key(1, 5), b"\xff\xff", "not a stored message"),
        ("gen-00000001", keys.index_key(keys.index_prefix(1, 0, "a"), 5), b"\x09\0\0\0\0", "not a posting list"),
        ("cf-1", b"k", b"v", "neither"),
        ("default", b"", b"v", "empty key"),
    ],
)
def test_records_a_restore_must_not_write_are_refused(family: str, key: bytes, value: bytes, why: str) -> None:
    with pytest.raises(Exception, match=why):
        check_records(0, family, [key], [value])


def test_generation_records_of_either_version_are_restored() -> None:
    old = keys.GenerationRecord(since_us=0, until_us=1_000, created_at_us=1).encode()
    new = keys.GenerationRecord(since_us=1_000, until_us=None, created_at_us=1_000, last_before_us=7).encode()
    assert (old[0], new[0]) == (1, 2)
    check_records(0, "default", [keys.generation_key(1), keys.generation_key(2)], [old, new])


def test_a_shard_that_never_stored_restores_as_one_and_stores_afterwards(tmp_path: Path) -> None:
    engine = Engine()
    src = ShardStorage(str(tmp_path / "src"), 0, engine)
    dst = ShardStorage(str(tmp_path / "dst"), 0, engine)
    cps = tmp_path / "cps"
    cps.mkdir()
    try:
        dst.initialize(100)  # a new cluster's shard may hold an empty first generation: cleared
        fence, gens, sections = export(src, cps, None)
        assert (fence, gens) == (0, [])
        restore(dst, sections, fence)
        assert dst.generations() == [] and not dst.initialized and dst.holds() is None
        dst.initialize(1_000)
        assert dst.store([msg("a/1")], 1_000) == 1_000
    finally:
        src.close()
        dst.close()


def test_a_restore_that_stopped_half_way_leaves_a_shard_that_is_not_empty(tmp_path: Path) -> None:
    dst = ShardStorage(str(tmp_path / "dst"), 0, Engine())
    try:
        assert dst.restore_begin(applied_index=1) is None
        # A generation's records written, the metadata's not yet: the views know no generation.
        dst.restore_records("gen-00000004", [keys.data_key(1, 5)], [msg("a/1").SerializeToString()], applied_index=2)
        assert dst.generations() == []
        refused = dst.restore_begin(applied_index=3)
        assert refused is not None and "messages in generation 4" in refused.message
    finally:
        dst.close()


def test_while_a_restore_runs_the_vnode_refuses_every_other_command(tmp_path: Path) -> None:
    def open_replica() -> VnodeReplica:
        return VnodeReplica(
            0, str(tmp_path / "v0"), Engine(), node_id="n1", fetch_snapshot=lambda *_: 0, lts_threshold_top=100,
            lts_threshold=10,
        )  # fmt: skip

    store = cpb.VnodeCommand(store=cpb.StoreMessages(now_us=5_000, messages=[msg("a/1")])).SerializeToString()
    subscribe = cpb.VnodeCommand(
        session=cpb.SessionCommand(now_us=5_000, subscribe=spb.SubscribeRequest(clientid="c", topic_filter="#"))
    ).SerializeToString()

    def step(replica: VnodeReplica, index: int, **kind: object) -> object:
        body = cpb.VnodeCommand(import_shard=pb.ImportShardRequest(shard=0, **kind)).SerializeToString()
        return replica.apply(body, index)

    replica = open_replica()
    try:
        assert step(replica, 1, begin=pb.ImportBegin()) is None
        for index, body in ((2, store), (3, subscribe)):
            refused = replica.apply(body, index)
            assert isinstance(refused, MqdsError) and refused.reason is Reason.SHARD_RESTORING
            assert replica.applied_index == index
        (batch,) = replica.apply_batch([store], 4)
        assert isinstance(batch, MqdsError) and batch.reason is Reason.SHARD_RESTORING
        assert step(replica, 5, records=pb.ImportRecords(column_family="default", keys=[b"c:x"], values=[b""])) == 1
    finally:
        replica.close()
    # The mark is in the database: the replica opened again (a node restarted mid-restore) still refuses.
    replica = open_replica()
    try:
        refused = replica.apply(store, 6)
        assert isinstance(refused, MqdsError) and refused.reason is Reason.SHARD_RESTORING
        step(replica, 7, finish=pb.ImportFinish(last_ts=4_000))
        assert replica.apply(store, 8) == 5_000
        assert replica.apply(subscribe, 9) is None
        # A begin on a shard that holds data is refused and sets no mark.
        refused = step(replica, 10, begin=pb.ImportBegin())
        assert isinstance(refused, MqdsError) and refused.reason is Reason.SHARD_NOT_EMPTY
        assert replica.apply(store, 11) == 5_001
    finally:
        replica.close()


def _replica(path: Path) -> VnodeReplica:
    return VnodeReplica(
        0, str(path), Engine(), node_id="n1", fetch_snapshot=lambda *_: 0, lts_threshold_top=100, lts_threshold=10
    )


def _step(replica: VnodeReplica, index: int, **kind: object) -> object:
    body = cpb.VnodeCommand(import_shard=pb.ImportShardRequest(shard=0, **kind)).SerializeToString()
    return replica.apply(body, index)


def _store(replica: VnodeReplica, index: int, now_us: int, *messages: pb.Message) -> object:
    body = cpb.VnodeCommand(store=cpb.StoreMessages(now_us=now_us, messages=list(messages))).SerializeToString()
    return replica.apply(body, index)


def test_restore_steps_without_a_begin_are_refused_and_change_nothing(tmp_path: Path) -> None:
    """Issue 44: a forged record replaced an acknowledged message, and a finish moved the last timestamp."""
    replica = _replica(tmp_path / "v0")
    try:
        acked = _store(replica, 1, 5_000, msg("a/1", b"acknowledged"))
        assert acked == 5_000
        (stream, key) = next(
            (keys.parse_data_key(k)[0], k)
            for k, _ in replica.storage._db.get_column_family("gen-00000001").items()
            if k[:1] == keys.DATA_TAG
        )
        assert keys.data_key(stream, 5_000) == key
        forged = pb.ImportRecords(
            column_family="gen-00000001", keys=[key], values=[msg("a/1", b"forged").SerializeToString()]
        )
        steps = [
            (2, {"records": forged}, "records"),
            (3, {"finish": pb.ImportFinish(last_ts=5_000 + 86_400_000_000)}, "finish"),
            (4, {"abandon": pb.ImportAbandon()}, "abandon"),
        ]
        for index, kind, name in steps:
            refused = _step(replica, index, **kind)
            assert isinstance(refused, MqdsError) and refused.reason is Reason.NOT_RESTORING, name
            assert f"ImportShard {name} comes after a begin" in refused.message
            assert replica.applied_index == index
        assert rows(replica.storage) == [(5_000, "a/1", b"acknowledged")]
        assert replica.storage.last_ts == 5_000 and not replica.storage.restoring
        assert _store(replica, 5, 6_000, msg("a/1", b"next")) == 6_000
    finally:
        replica.close()


def test_an_abandoned_restore_leaves_the_shard_empty_and_writable(tmp_path: Path) -> None:
    replica = _replica(tmp_path / "v0")
    try:
        assert _step(replica, 1, begin=pb.ImportBegin()) is None
        written = _step(
            replica,
            2,
            records=pb.ImportRecords(
                column_family="gen-00000004", keys=[keys.data_key(1, 3_000)], values=[msg("a/1").SerializeToString()]
            ),
        )
        assert written == 1
        # A second begin while the restore holds records: refused, naming the restore under way.
        refused = _step(replica, 3, begin=pb.ImportBegin())
        assert isinstance(refused, MqdsError) and refused.reason is Reason.SHARD_NOT_EMPTY
        assert "restore under way" in refused.message and replica.storage.restoring
        assert _step(replica, 4, abandon=pb.ImportAbandon()) is None
        storage = replica.storage
        assert not storage.restoring and storage.holds() is None and storage.generations() == []
    finally:
        replica.close()
    replica = _replica(tmp_path / "v0")  # as a restarted node opens it
    try:
        assert not replica.storage.restoring
        assert _store(replica, 5, 9_000, msg("a/2", b"after")) == 9_000
        assert rows(replica.storage) == [(9_000, "a/2", b"after")]
        # Nothing to abandon any more: a late abandon never clears a shard that holds data.
        refused = _step(replica, 6, abandon=pb.ImportAbandon())
        assert isinstance(refused, MqdsError) and refused.reason is Reason.NOT_RESTORING
        assert rows(replica.storage) == [(9_000, "a/2", b"after")]
    finally:
        replica.close()


def test_a_finish_before_the_records_timestamps_is_refused_even_after_a_restart(tmp_path: Path) -> None:
    replica = _replica(tmp_path / "v0")
    try:
        assert _step(replica, 1, begin=pb.ImportBegin()) is None
        generation = keys.GenerationRecord(since_us=2_000, until_us=None, created_at_us=2_000).encode()
        meta = pb.ImportRecords(column_family="default", keys=[keys.generation_key(1)], values=[generation])
        assert _step(replica, 2, records=meta) == 1
        data = pb.ImportRecords(
            column_family="gen-00000001",
            keys=[keys.data_key(1, 7_000), keys.data_key(2, 4_000)],
            values=[msg("a/1").SerializeToString(), msg("a/2").SerializeToString()],
        )
        assert _step(replica, 3, records=data) == 2
        assert replica.storage.restored_ts == 7_000
    finally:
        replica.close()
    replica = _replica(tmp_path / "v0")  # the mark keeps the records' largest timestamp
    try:
        assert replica.storage.restoring and replica.storage.restored_ts == 7_000
        refused = _step(replica, 4, finish=pb.ImportFinish(last_ts=6_999))
        assert isinstance(refused, MqdsError) and refused.reason is Reason.INVALID_REQUEST
        assert "before timestamp 7000 of the records written" in refused.message
        assert replica.storage.restoring and replica.applied_index == 4
        generations = _step(replica, 5, finish=pb.ImportFinish(last_ts=7_000))
        assert isinstance(generations, list) and [g.generation for g in generations] == [1]
        assert not replica.storage.restoring and replica.storage.last_ts == 7_000
        assert _store(replica, 6, 6_500, msg("a/1", b"new")) == 7_001
    finally:
        replica.close()


def test_records_from_the_future_are_refused_by_the_leader() -> None:
    future = pb.ImportRecords(
        column_family="gen-00000001", keys=[keys.data_key(1, 9_000)], values=[msg("a/1").SerializeToString()]
    )
    check_records(0, future.column_family, future.keys, future.values, 9_000)
    with pytest.raises(MqdsError, match="timestamp 9000, after 8999, the latest this node takes"):
        check_records(0, future.column_family, future.keys, future.values, 8_999)
    late_generation = keys.GenerationRecord(since_us=20_001, until_us=None, created_at_us=1).encode()
    with pytest.raises(MqdsError, match="timestamp 20000"):
        check_records(0, "default", [keys.generation_key(1)], [late_generation], 10_000)
