"""Delivery steps in the storage layer: what replicas fed the same steps hold, dead letters written with the step."""

from __future__ import annotations

from pathlib import Path

from mqds.protocol.delivery import Policy
from mqds.server.storage import keys
from mqds.server.storage.deliveries import Delivered, DeliverStep
from mqds.server.storage.export import CheckpointExport
from mqds.server.storage.restore import check_records
from mqds.server.storage.sessions import FetchFilter
from mqds.server.storage.shard import Engine, ShardStorage
from mqds.v1 import storage_pb2 as pb

SECOND = 1_000_000


def step(policy: Policy, max_count: int = 10) -> DeliverStep:
    return DeliverStep("c", "t/#", policy, max_count, None, False, False, 0)


def feed(storage: ShardStorage) -> list[Delivered]:
    """The same calls on any shard: a store, delivery steps at logged times, an ack; what each step gave."""
    policy = Policy.of(ack_wait_ms=1_000, max_deliveries=2, backoff_ms=(1_000, 3_000), dead_letter_topic="dlq")
    storage.store([pb.Message(topic=f"t/{i}", payload=b"%d" % i, sender="s", qos=1) for i in range(4)], 10 * SECOND)
    out = []
    for n, now in enumerate((11, 11.5, 12.5, 14, 16)):
        out.append(storage.deliveries.deliver(step(policy, 3), int(now * SECOND), applied_index=100 + n))
        if n == 0:
            storage.deliveries.ack("c", "t/#", out[0].messages[0][0], applied_index=200)
    return out


def payloads(done: Delivered) -> list[tuple[bytes, int]]:
    return [(pb.Message.FromString(stored).payload, count) for _, stored, count in done.messages]


def test_replicas_fed_the_same_steps_hold_the_same_and_give_the_same(tmp_path: Path, engine: Engine) -> None:
    shards = [ShardStorage(str(tmp_path / name), 1, engine) for name in ("a", "b")]
    try:
        for storage in shards:
            storage.initialize(1)
        given = [[payloads(done) for done in feed(storage)] for storage in shards]
        assert (
            given[0]
            == given[1]
            == [
                [(b"0", 1), (b"1", 1), (b"2", 1)],  # max_count 3; then 0 is acknowledged
                [(b"3", 1)],  # 1 and 2 wait until 12 s (backoff[0]); 3 is new
                [(b"1", 2), (b"2", 2), (b"3", 2)],  # all due: the second delivery waits backoff[1], 3 s
                [],
                [],  # due after their last delivery: dead letters
            ]
        )
        assert list(shards[0].dump()) == list(shards[1].dump())
        assert shards[0].deliveries.unacked("c", "t/#") == []
        letters = shards[0].sessions.fetch(FetchFilter("dlq", 0, 0, 10, False, False))
        assert [pb.Message.FromString(stored).payload for _, stored in letters] == [b"1", b"2", b"3"]
    finally:
        for storage in shards:
            storage.close()


def test_dead_letters_are_stored_in_the_steps_own_write(shard: ShardStorage) -> None:
    policy = Policy.of(ack_wait_ms=1_000, max_deliveries=1, dead_letter_topic="dlq/x")
    shard.store([pb.Message(topic="t/a", payload=b"a", sender="s", qos=1)], 10 * SECOND)
    assert payloads(shard.deliveries.deliver(step(policy), 11 * SECOND, applied_index=5)) == [(b"a", 1)]
    done = shard.deliveries.deliver(step(policy), 13 * SECOND, applied_index=6)
    assert done.messages == [] and done.dead_lettered == 1 and done.dead_first_ts == 13 * SECOND == shard.last_ts
    # One write holds the dead letter, the ended delivery and the applied index: no crash falls between them.
    assert shard.applied_index == 6 and shard.deliveries.unacked("c", "t/#") == []
    (letter,) = [
        pb.Message.FromString(s) for _, s in shard.sessions.fetch(FetchFilter("dlq/#", 0, 0, 10, False, False))
    ]
    assert letter.topic == "dlq/x" and letter.payload == b"a" and letter.sender == "s"
    assert dict((p.key, p.value) for p in letter.properties)["mqds-deliveries"] == "1"
    assert shard.meta_get(keys.delivered_key(keys.consumer_id("c", "t/#"))) is not None


def test_a_backup_keeps_the_deliveries_of_the_messages_it_holds(tmp_path: Path, engine: Engine) -> None:
    src = ShardStorage(str(tmp_path / "src"), 2, engine)
    dst = ShardStorage(str(tmp_path / "dst"), 2, engine)
    checkpoint = str(tmp_path / "cp")
    try:
        src.initialize(1)
        policy = Policy.of(ack_wait_ms=60_000, max_deliveries=3)
        src.store([pb.Message(topic="t/a", payload=b"before", sender="s", qos=1)], 10 * SECOND)
        fence = src.last_ts
        src.store([pb.Message(topic="t/a", payload=b"after", sender="s", qos=1)], 11 * SECOND)
        assert len(src.deliveries.deliver(step(policy), 12 * SECOND, applied_index=5).messages) == 2
        src.checkpoint(checkpoint)
        export = CheckpointExport(checkpoint, fence, {})
        try:
            assert dst.restore_begin(applied_index=1) is None
            for section in export.sections():
                records = list(section.records)
                if records:
                    names, values = [k for k, _ in records], [v for _, v in records]
                    check_records(2, section.column_family, names, values)
                    dst.restore_records(section.column_family, names, values, applied_index=2)
        finally:
            export.close()
        dst.restore_finish(fence, applied_index=3)
        # The delivery of the message after the fence is not in the backup, nor the cursor past it: a message the
        # restored shard stores after its fence is the consumer's.
        assert [ts for ts, _, _ in dst.deliveries.unacked("c", "t/#")] == [fence]
        dst.store([pb.Message(topic="t/a", payload=b"new", sender="s", qos=1)], 20 * SECOND)
        assert payloads(dst.deliveries.deliver(step(policy), 21 * SECOND, applied_index=4)) == [(b"new", 1)]
    finally:
        src.close()
        dst.close()
