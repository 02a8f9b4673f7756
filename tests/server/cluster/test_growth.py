"""Which vnode commands add data (``mqds.server.cluster.growth``): what a node past its disk quota refuses."""

from __future__ import annotations

import pytest

from mqds.server.cluster.growth import adds
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.node.hosting import add_generation_command
from mqds.server.storage import keys
from mqds.server.wire import store_command
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

KNOWN = {
    keys.client_key("known"),
    keys.subscriptions_prefix("known") + b"a/#",
    keys.position_key("known", "a/#"),
    keys.share_group_prefix("g", "a/#") + b"m1",
}


def session(**kind: object) -> bytes:
    return cpb.VnodeCommand(session=cpb.SessionCommand(now_us=1, **kind)).SerializeToString()


def restore(**kind: object) -> bytes:
    return cpb.VnodeCommand(import_shard=pb.ImportShardRequest(shard=0, **kind)).SerializeToString()


ADDS = {
    "a store": cpb.VnodeCommand(
        store=cpb.StoreMessages(now_us=1, messages=[pb.Message(topic="a")])
    ).SerializeToString(),
    "a store logged from the request's bytes": store_command(
        pb.StoreBatchRequest(messages=[pb.Message(topic="a")]).SerializeToString(), 1
    ),
    "a retained message": session(retain=pb.Message(topic="a", payload=b"x" * 1024)),
    "a new client": session(connected=spb.ClientConnectedRequest(clientid="new", node="b")),
    "a new subscription": session(subscribe=spb.SubscribeRequest(clientid="known", topic_filter="b/#")),
    "a new read position": session(start_position=spb.StartReadPositionRequest(clientid="known", topic_filter="b/#")),
    "an ack that creates a position": session(
        ack=spb.AckRequest(clientid="new", topic_filter="a/#", shard=0, timestamp_us=5, mode=spb.PUBSUB)
    ),
    "a new share group member": session(share_join=spb.ShareGroupRequest(group="g", topic_filter="a/#", member="m2")),
    "a restore's begin": restore(begin=pb.ImportBegin()),
    "a restore's records": restore(records=pb.ImportRecords(column_family="default", keys=[b"c:x"], values=[b""])),
}
TAKEN = {
    "a rotation": add_generation_command(1, 1),
    "a drop": cpb.VnodeCommand(drop_generation=cpb.DropGeneration(generation=1)).SerializeToString(),
    "a delete step": cpb.VnodeCommand(delete_messages=cpb.DeleteMessages(topic_filter="#")).SerializeToString(),
    "a retention step": cpb.VnodeCommand(apply_retention=cpb.ApplyRetention(now_us=1)).SerializeToString(),
    "clearing a retained message": session(retain=pb.Message(topic="a")),
    "a known client's connect": session(connected=spb.ClientConnectedRequest(clientid="known", node="b")),
    "a disconnect": session(disconnected=spb.ClientDisconnectedRequest(clientid="new")),
    "subscribing again": session(subscribe=spb.SubscribeRequest(clientid="known", topic_filter="a/#", qos=2)),
    "an unsubscribe": session(unsubscribe=spb.UnsubscribeRequest(clientid="known", topic_filter="a/#")),
    "an ack of a position": session(
        ack=spb.AckRequest(clientid="known", topic_filter="a/#", shard=0, timestamp_us=5, mode=spb.PUBSUB)
    ),
    "a queue ack": session(ack=spb.AckRequest(topic_filter="a/#", timestamp_us=5, mode=spb.QUEUE)),
    "starting a position that is there": session(
        start_position=spb.StartReadPositionRequest(clientid="known", topic_filter="a/#")
    ),
    "forgetting a position": session(
        forget_position=spb.ForgetReadPositionRequest(clientid="known", topic_filter="a/#")
    ),
    "forgetting a session": session(forget_session=spb.ForgetSessionRequest(clientid="known")),
    "expiry": session(expire=cpb.Expire(max_count=10)),
    "a lease renewed": session(share_join=spb.ShareGroupRequest(group="g", topic_filter="a/#", member="m1")),
    "leaving a share group": session(share_leave=spb.ShareGroupRequest(group="g", topic_filter="a/#", member="m1")),
    "a restore's finish": restore(finish=pb.ImportFinish(last_ts=5)),
    "a restore's abandon": restore(abandon=pb.ImportAbandon()),
    "bytes that are no command (its apply refuses it)": b"\xff\xff\xff",
}


@pytest.mark.parametrize("name", sorted(ADDS))
def test_what_adds_data_is_named(name: str) -> None:
    assert adds(ADDS[name], KNOWN.__contains__) is not None


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_what_removes_data_or_updates_a_record_that_is_there_adds_nothing(name: str) -> None:
    assert adds(TAKEN[name], KNOWN.__contains__) is None


def test_a_store_is_classed_without_decoding_its_messages() -> None:
    looked_up: list[bytes] = []
    # Not a valid message after the tag: a store is known by its first byte alone.
    assert adds(b"\x0a\x7f" + b"\xff" * 10, lambda key: looked_up.append(key) or False) == "new messages"
    assert looked_up == []
