"""Stored messages with an MQTT 5 Message Expiry Interval in one shard (issue 47): offline fetches leave out the
expired ones and give the others what is left of their interval; expiry steps remove them, with their index
entries, in bounded steps that every replica applies alike; replay reads them until then; a backup carries the
entries of the messages it carries."""

from __future__ import annotations

from pathlib import Path

import pytest
from storage_support import replay

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.storage import keys
from mqds.server.storage.export import CheckpointExport
from mqds.server.storage.restore import check_records
from mqds.server.storage.sessions import FetchFilter
from mqds.server.storage.shard import Engine, ShardStorage
from mqds.v1 import storage_pb2 as pb

S = 1_000_000


def msg(topic: str, payload: str, expiry_s: int = 0) -> pb.Message:
    return pb.Message(topic=topic, payload=payload.encode(), sender="s", qos=1, message_expiry_s=expiry_s)


def everything(**options: int) -> FetchFilter:
    defaults = {"after_us": 0, "since_us": 0, "max_count": 1000}
    defaults.update(options)
    return FetchFilter("#", include_qos0=False, skip_acked=False, **defaults)


def fetched(shard: ShardStorage, now_us: int, **options: int) -> list[tuple[str, int]]:
    """What an offline fetch at ``now_us`` returns: (payload, the expiry interval it carries)."""
    got = shard.sessions.fetch(everything(**options), now_us=now_us)
    return [(m.payload.decode(), m.message_expiry_s) for m in (pb.Message.FromString(s) for _, s in got)]


def index_entries(shard: ShardStorage) -> list[tuple[int, int, int, int]]:
    return [
        keys.read_message_expiry_key(key)
        for family, key, _ in shard.dump()
        if family == "default" and key.startswith(keys.MESSAGE_EXPIRY_PREFIX)
    ]


def test_a_fetch_leaves_out_expired_messages_and_gives_the_others_what_is_left_of_their_interval(
    shard: ShardStorage,
) -> None:
    # Stored at 10 s (timestamps 10 s, 10 s + 1 µs, ...): every message's interval counts from its own.
    shard.store([msg("a/1", "short", 1), msg("a/2", "long", 5), msg("a/3", "none"), msg("b/1", "short-b", 2)], 10 * S)
    assert fetched(shard, 0) == [("short", 1), ("long", 5), ("none", 0), ("short-b", 2)]  # no clock: as stored
    assert fetched(shard, 10 * S + S // 2) == [("short", 1), ("long", 5), ("none", 0), ("short-b", 2)]
    # 1.5 s after: "short" ended (at 11 s); the others have what is left, rounded up.
    assert fetched(shard, 11 * S + S // 2) == [("long", 4), ("none", 0), ("short-b", 1)]
    # "short-b" (timestamp 10 s + 3 µs, 2 s): a microsecond before its end, 1 s is left; at its end it is expired
    # (as a retained message is).
    assert fetched(shard, 12 * S + 2) == [("long", 3), ("none", 0), ("short-b", 1)]
    assert fetched(shard, 12 * S + 3) == [("long", 3), ("none", 0)]
    # An expired message takes no place in a page: max_count counts what is returned.
    assert fetched(shard, 14 * S, max_count=2) == [("long", 2), ("none", 0)]  # 1 s and 1 µs left: 2
    assert fetched(shard, 15 * S + 1) == [("none", 0)]
    # A clock behind the one that stored it never gives more than the interval itself.
    assert fetched(shard, 9 * S) == [("short", 1), ("long", 5), ("none", 0), ("short-b", 2)]
    # A shared scan for several sessions hands each exactly what its own fetch would.
    scan = shard.sessions.fetch_shared([everything(), everything(max_count=1)], now_us=11 * S + S // 2)
    assert [pb.Message.FromString(scan.found[k][1]).payload for k in scan.taken[0]] == [b"long", b"none", b"short-b"]
    assert [pb.Message.FromString(scan.found[k][1]).payload for k in scan.taken[1]] == [b"long"]


def test_expiry_steps_remove_expired_messages_and_their_index_entries_in_bounded_steps(shard: ShardStorage) -> None:
    shard.store([msg(f"dev/{i}", f"m{i}", 1 if i % 2 else 0) for i in range(10)], 10 * S)
    shard.store([msg("dev/long", "long", 3600)], 10 * S)
    # One index entry per message with an interval, by generation, then the time it ends.
    entries = index_entries(shard)
    assert len(entries) == 6 and entries == sorted(entries)
    assert not shard.messages_expiry_due(10 * S + S // 2)
    assert shard.messages_expiry_due(11 * S + 5)
    # Replay reads what is stored, expired or not, with each message's interval as stored.
    assert sorted((r.message.payload.decode(), r.message.message_expiry_s) for r in replay(shard, "#")) == sorted(
        [(f"m{i}", 1 if i % 2 else 0) for i in range(10)] + [("long", 3600)]
    )
    steps = []
    while shard.messages_expiry_due(20 * S):
        steps.append(shard.expire_messages(20 * S, 2).messages)
    assert steps == [2, 2, 1]  # at most max_count a step
    # Replay read them until now; now they are gone, their entries too, but the long-lived one and its entry.
    assert sorted(r.message.payload.decode() for r in replay(shard, "#")) == sorted(
        [f"m{i}" for i in range(0, 10, 2)] + ["long"]
    )
    assert [e[1] for e in index_entries(shard)] == [shard.last_ts + 3600 * S]
    # A step with nothing due changes nothing.
    assert shard.expire_messages(20 * S, 1000).messages == 0


def test_a_dropped_generation_takes_its_index_entries_with_the_next_step(shard: ShardStorage) -> None:
    shard.store([msg("old/1", "a", 3600), msg("old/2", "b", 3600)], 10 * S)
    first = shard.current_generation
    shard.add_generation(11 * S)
    shard.store([msg("new/1", "c", 3600)], 12 * S)
    shard.drop_generation(first)
    # Not due by their time, but their messages are gone: the entries go as one range in the next step.
    assert shard.messages_expiry_due(12 * S)
    assert shard.expire_messages(12 * S, 1000).messages == 0
    assert [e[0] for e in index_entries(shard)] == [shard.current_generation]
    assert not shard.messages_expiry_due(12 * S)


def test_two_replicas_fed_the_same_commands_hold_the_same_keys(tmp_path: Path, engine: Engine) -> None:
    replicas = [ShardStorage(str(tmp_path / name), 3, engine) for name in ("a", "b")]
    try:
        for shard in replicas:
            shard.initialize(1)
            shard.store([msg(f"t/{i}", f"{i}", i % 3) for i in range(30)], 10 * S)
            shard.add_generation(11 * S)
            shard.store([msg(f"t/{i}", f"{i}", 2) for i in range(5)], 11 * S)
            shard.expire_messages(12 * S + 40, 7)
            shard.expire_messages(13 * S, 1000)
        a, b = (list(shard.dump()) for shard in replicas)
        assert a == b
        assert any(key.startswith(keys.MESSAGE_EXPIRY_PREFIX) for _, key, _ in a)  # the 2 s ones, not due yet
    finally:
        for shard in replicas:
            shard.close()


def test_a_backup_at_a_fence_takes_the_entries_of_the_messages_it_takes_and_the_restored_shard_expires_them(
    tmp_path: Path, engine: Engine
) -> None:
    src = ShardStorage(str(tmp_path / "src"), 3, engine)
    dst = ShardStorage(str(tmp_path / "dst"), 3, engine)
    checkpoint = str(tmp_path / "checkpoint")
    try:
        src.initialize(1)
        src.store([msg("a/1", "kept", 5), msg("a/2", "plain")], 10 * S)
        fence = src.last_ts
        src.store([msg("a/3", "late", 5)], 11 * S)  # after the fence: neither it nor its entry is exported
        src.checkpoint(checkpoint)
        export = CheckpointExport(checkpoint, fence, {})
        try:
            sections = [(s.column_family, list(s.records)) for s in export.sections()]
        finally:
            export.close()
        assert dst.restore_begin(applied_index=1) is None
        for family, records in sections:
            if records:
                check_records(3, family, [k for k, _ in records], [v for _, v in records])
                dst.restore_records(family, [k for k, _ in records], [v for _, v in records], applied_index=2)
        dst.restore_finish(fence, applied_index=3)
        assert [e[3] for e in index_entries(dst)] == [fence - 1]  # "kept", stored at 10 s
        assert dst.expire_messages(20 * S, 1000).messages == 1
        assert [r.message.payload for r in replay(dst, "#")] == [b"plain"]
    finally:
        src.close()
        dst.close()


def test_a_restore_refuses_an_expiry_entry_of_the_wrong_shape() -> None:
    """An expiry step reads each entry's fields: one that is not a ``z:`` key of its size would fail it on every
    replica, so the leader refuses it before logging the records."""
    good = keys.message_expiry_key(1, 5 * S, 7, 3 * S)
    check_records(3, "default", [good], [b""])
    with pytest.raises(MqdsError) as refused:
        check_records(3, "default", [good[:-1]], [b""])
    assert refused.value.reason is Reason.INVALID_REQUEST and "z:" in str(refused.value)
