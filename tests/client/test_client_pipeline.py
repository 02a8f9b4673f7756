"""The pipelined-write rules of mqds.client.core.pipeline, without a cluster: batches, window, acks, resends."""

from __future__ import annotations

import asyncio
import itertools
import socket

import pytest

from mqds.client import Client, Message, aio
from mqds.client import errors as E
from mqds.client.aio.handles import AsyncStoreFuture
from mqds.client.core.operations import StoreBatch
from mqds.client.core.pipeline import (
    Batch,
    PendingCall,
    Pipeline,
    PipelineLimits,
    Plan,
    StreamState,
    check_message,
    check_messages,
)
from mqds.client.core.retry import Backoff
from mqds.client.core.routing_table import RoutingTable
from mqds.client.sync.handles import StoreFuture
from mqds.protocol.sharding import shard_of
from mqds.v1 import storage_pb2 as pb

N_SHARDS = 4
FAR = 1e18  # a deadline that never passes


def sender_on(shard: int, prefix: str = "s") -> str:
    return next(f"{prefix}-{i}" for i in range(10_000) if shard_of(f"{prefix}-{i}", N_SHARDS) == shard)


def table(leaders: dict[int, str]) -> RoutingTable:
    t = RoutingTable(["a:1"])
    view = t.view
    view.n_shards, view.version = N_SHARDS, 1
    view.addresses = {"a": "a:1", "b": "b:1", "c": "c:1"}
    view.replicas = {s: ["a", "b", "c"] for s in range(N_SHARDS)}
    view.leaders = {s: (1, node) for s, node in leaders.items()}
    return t


def pipeline(leaders: dict[int, str] | None = None, **limits: int) -> Pipeline:
    routes = table(leaders if leaders is not None else {s: "a" for s in range(N_SHARDS)})
    return Pipeline(routes, "prod", itertools.count(1), PipelineLimits(**limits), Backoff(initial_s=0.0, max_s=0.0))


def call(shard: int, *payloads: str, deadline: float = FAR, topic: str = "t/1") -> PendingCall:
    sender = sender_on(shard)
    return PendingCall([Message(topic, p.encode(), sender, 1) for p in payloads], N_SHARDS, deadline)


def ok(batch: Batch, ts: int = 1000) -> pb.StoreStreamResponse:
    positions = [pb.MessagePosition(shard=batch.shard, timestamp_us=ts + i) for i in range(len(batch.entries))]
    return pb.StoreStreamResponse(sequence=batch.sequence, result=pb.StoreBatchResponse(positions=positions))


def failed(batch: Batch, reason: str, **metadata: str) -> pb.StoreStreamResponse:
    failure = pb.ShardFailure(shard=batch.shard, reason=reason, message="no", metadata=metadata)
    positions = [pb.MessagePosition(shard=batch.shard) for _ in batch.entries]
    return pb.StoreStreamResponse(
        sequence=batch.sequence, result=pb.StoreBatchResponse(positions=positions, failures=[failure])
    )


def sent(batch: Batch) -> pb.StoreBatchRequest:
    """The batch as the node parses the frame the client sends."""
    return pb.StoreStreamRequest.FromString(batch.request).batch


def payloads(batch: Batch) -> list[bytes]:
    return [m.payload for m in sent(batch).messages]


def test_queued_calls_of_a_shard_go_out_as_one_batch_on_the_leaders_stream() -> None:
    p = pipeline()
    calls = [call(0, "1"), call(0, "2", "3"), call(0, "4")]
    for c in calls:
        assert not p.add(c)
    plan = p.plan()
    assert [s.address for s in plan.opened] == ["a:1"]
    ((stream, batch),) = plan.sends
    assert payloads(batch) == [b"1", b"2", b"3", b"4"]
    request = sent(batch)
    assert (request.producer_id, request.sequence, batch.sequence) == ("prod", 1, 1)
    assert p.unsettled_messages == 4 and not p.has_room(10_000 - 3)

    settled = p.acked(stream, ok(batch))
    assert settled == calls and p.unsettled_messages == 0
    assert [[m.timestamp_us for m in c.outcome()] for c in calls] == [[1000], [1001, 1002], [1003]]
    assert all(m.shard == 0 for c in calls for m in c.outcome())


def test_calls_made_while_a_shards_batches_are_in_flight_wait_and_share_the_next_one() -> None:
    """At most max_batches_per_shard batches of a shard in flight: one-message calls are coalesced meanwhile."""
    p = pipeline(max_batches_per_shard=2)
    first, second = call(0, "1"), call(0, "2")
    p.add(first)
    ((stream, batch1),) = p.plan().sends
    p.add(second)
    ((_, batch2),) = p.plan().sends
    assert payloads(batch2) == [b"2"]  # a free slot: sent at once
    later = [call(0, str(n)) for n in range(3, 9)]
    for c in later:
        p.add(c)
    assert p.plan().sends == []  # two batches in flight: the six calls wait
    assert p.acked(stream, ok(batch1)) == [first]
    ((_, batch3),) = p.plan().sends
    assert payloads(batch3) == [str(n).encode() for n in range(3, 9)]
    assert p.stats == {"calls": 8, "batches": 3, "messages": 8}


def test_one_stream_per_node_and_one_sequence_per_batch() -> None:
    p = pipeline({0: "a", 1: "b", 2: "a", 3: "b"})
    for shard in range(N_SHARDS):
        p.add(call(shard, str(shard)))
    plan = p.plan()
    assert sorted(s.address for s in plan.opened) == ["a:1", "b:1"]
    by_stream: dict[str, list[int]] = {}
    for stream, batch in plan.sends:
        by_stream.setdefault(stream.address, []).append(batch.sequence)
    assert all(seqs == sorted(seqs) for seqs in by_stream.values())
    assert sorted(s for seqs in by_stream.values() for s in seqs) == [1, 2, 3, 4]


def test_the_window_and_the_batch_limits() -> None:
    p = pipeline(max_in_flight_messages=3, max_batch_messages=1, max_batches_per_shard=2)
    assert p.has_room(50)  # a call larger than the window fits an empty one
    p.add(call(0, "1", "2", "3"))
    assert not p.has_room(1)
    plan = p.plan()
    assert [payloads(b) for _, b in plan.sends] == [[b"1"], [b"2"]]  # two batches per shard at most
    stream = plan.sends[0][0]
    assert p.acked(stream, ok(plan.sends[0][1])) == []
    (third,) = p.plan().sends
    assert payloads(third[1]) == [b"3"] and third[0] is stream  # on the same stream, after the others


def test_acks_complete_calls_in_order_and_multi_shard_calls_when_every_part_is_in() -> None:
    p = pipeline({0: "a", 1: "b", 2: "a", 3: "a"})
    both = PendingCall([Message("t", b"x", sender_on(0)), Message("t", b"y", sender_on(1))], N_SHARDS, FAR)
    p.add(both)
    sends = {b.shard: (s, b) for s, b in p.plan().sends}
    assert p.acked(*_ack(sends[0])) == []
    assert p.acked(*_ack(sends[1])) == [both]
    assert [m.payload for m in both.outcome()] == [b"x", b"y"]


def _ack(sent: tuple[StreamState, Batch]) -> tuple[StreamState, pb.StoreStreamResponse]:
    return sent[0], ok(sent[1])


def test_not_leader_with_a_hint_resends_the_shards_batches_in_order_to_the_new_leader() -> None:
    p = pipeline(max_batch_messages=1, max_batches_per_shard=8)
    c1, c2, c3 = call(0, "1"), call(0, "2"), call(0, "3")
    for c in (c1, c2, c3):
        p.add(c)
    plan = p.plan()
    old = plan.opened[0]
    first, second, third = (b for _, b in plan.sends)
    assert p.acked(old, ok(first)) == [c1]
    # The node lost the leadership: the second fails, the third is answered with the same failure.
    assert p.acked(old, failed(second, "NOT_LEADER", leader="b", leader_address="b:1")) == []
    assert p.acked(old, failed(third, "NOT_LEADER", leader="b", leader_address="b:1")) == []  # ignored
    plan = p.plan()
    assert [s.address for s in plan.opened] == ["b:1"]
    assert [b for _, b in plan.sends] == [second, third]  # the same batches: same sequences, same messages
    new = plan.opened[0]
    assert p.acked(new, ok(second)) == [c2]
    assert p.acked(new, ok(third)) == [c3]
    assert p.unsettled_messages == 0


def test_a_broken_stream_resends_everything_after_a_refresh_and_a_pause() -> None:
    p = pipeline()
    calls = [call(s, str(s)) for s in range(N_SHARDS)]
    for c in calls:
        p.add(c)
    plan = p.plan()
    stream = plan.opened[0]
    sent = [b for _, b in plan.sends]
    assert p.stream_ended(stream, E.UnavailableError(E.Reason.UNAVAILABLE, "connection reset")) == []
    assert p.table.view.leaders == {}  # forgotten: the node may be gone
    again = p.plan(now=1e12)  # after the pause
    assert again.refresh_map
    assert [b for _, b in again.sends] == sent
    assert all(c.last_error is not None for c in calls)
    # The old stream's late answers are ignored; the new one's settle the calls.
    assert p.acked(stream, ok(sent[0])) == []
    new = again.opened[0]
    assert [c for b in sent for c in p.acked(new, ok(b))] == calls


def test_a_resend_that_cannot_be_appended_restarts_the_nodes_stream() -> None:
    p = pipeline({0: "a", 1: "b", 2: "b", 3: "b"})
    c0, c1 = call(0, "x"), call(1, "y")
    p.add(c0)
    plan = p.plan()
    a = plan.opened[0]
    (_, moving) = plan.sends[0]
    p.add(c1)
    plan = p.plan()
    b = plan.opened[0]
    (_, other) = plan.sends[0]
    assert moving.sequence < other.sequence
    # Shard 0 moves to b, whose stream already carried a higher sequence: restart it, everything in order.
    p.acked(a, failed(moving, "NOT_LEADER", leader="b", leader_address="b:1"))
    plan = p.plan()
    assert plan.cancelled == [b] and [s.address for s in plan.opened] == ["b:1"]
    assert [x for _, x in plan.sends] == [moving, other]
    assert p.acked(b, ok(other)) == []  # the cancelled stream's answer is ignored
    new = plan.opened[0]
    assert p.acked(new, ok(moving)) == [c0] and p.acked(new, ok(other)) == [c1]


def test_an_invalid_batch_fails_only_its_calls() -> None:
    p = pipeline(max_batch_messages=1, max_batches_per_shard=8)
    good1, bad, good2 = call(0, "1"), call(0, "2"), call(0, "3")
    for c in (good1, bad, good2):
        p.add(c)
    plan = p.plan()
    stream = plan.opened[0]
    b1, b2, b3 = (b for _, b in plan.sends)
    assert p.acked(stream, ok(b1)) == [good1]
    assert p.acked(stream, failed(b2, "INVALID_TOPIC")) == [bad]
    with pytest.raises(E.InvalidArgumentError):
        bad.outcome()
    # The later batch of the shard is resent (deduplicated if stored) on a new stream.
    plan = p.plan()
    assert plan.cancelled == [stream] and [b for _, b in plan.sends] == [b3]
    assert p.acked(plan.opened[0], ok(b3)) == [good2]
    assert good2.outcome()[0].timestamp_us == 1000


def test_check_message_refuses_what_no_node_stores() -> None:
    with pytest.raises(E.InvalidArgumentError, match="wildcards"):
        check_message(0, Message("a/+/b", b"x", "s"))
    with pytest.raises(E.InvalidArgumentError, match="qos"):
        check_message(3, Message("a", b"x", "s", qos=3))
    check_message(0, Message("a/b", b"x", "s", qos=2))


def test_a_call_past_its_deadline_fails_with_the_last_error_and_its_batch_is_dropped() -> None:
    p = pipeline()
    late = call(0, "1", deadline=100.0)
    p.add(late)
    plan = p.plan(now=50.0)
    stream, batch = plan.sends[0]
    assert plan.wake_at == 55.0  # the stream's stall check (stall_s 5) comes before the deadline
    p.acked(stream, failed(batch, "NO_LEADER"))
    plan = p.plan(now=101.0)
    assert plan.settled == [late] and plan.sends == []
    with pytest.raises(E.UnavailableError, match="no"):
        late.outcome()
    assert p.unsettled_messages == 0


def test_a_partial_failure_of_a_multi_shard_call() -> None:
    p = pipeline()
    mixed = PendingCall([Message("t", b"x", sender_on(0)), Message("t", b"y", sender_on(1))], N_SHARDS, FAR)
    p.add(mixed)
    plan: Plan = p.plan()
    stream = plan.opened[0]
    by_shard = {b.shard: b for _, b in plan.sends}
    p.acked(stream, ok(by_shard[0]))
    assert p.acked(stream, failed(by_shard[1], "PAYLOAD_TOO_LARGE")) == [mixed]
    with pytest.raises(E.PartialBatchError) as raised:
        mixed.outcome()
    assert [m.payload for m in raised.value.stored] == [b"x"]
    assert [m.payload for m in raised.value.failed_messages] == [b"y"]


def test_close_fails_what_is_not_acknowledged() -> None:
    p = pipeline()
    pending = call(0, "1")
    p.add(pending)
    p.plan()
    assert p.close(E.UnavailableError(E.Reason.UNAVAILABLE, "closed")) == [pending]
    with pytest.raises(E.UnavailableError, match="closed"):
        pending.outcome()


def test_a_message_the_node_refuses_fails_its_own_call_and_the_batch_is_stored() -> None:
    """Calls coalesced into one batch: the node refuses one message (message_failures); only its call fails."""
    p = pipeline()
    first, bad, last = call(0, "1"), call(0, "2", "3"), call(0, "4")
    for c in (first, bad, last):
        p.add(c)
    plan = p.plan()
    ((stream, batch),) = plan.sends
    answer = ok(batch)
    answer.result.positions[2].timestamp_us = 0
    answer.result.message_failures.add(index=2, reason="PAYLOAD_TOO_LARGE", message="payload is 2,000,000 bytes")
    assert p.acked(stream, answer) == [first, bad, last]
    assert first.outcome()[0].timestamp_us == 1000 and last.outcome()[0].timestamp_us == 1003
    with pytest.raises(E.PartialBatchError) as raised:
        bad.outcome()
    assert [m.payload for m in raised.value.stored] == [b"2"]
    ((message, err),) = raised.value.failed
    assert message.payload == b"3" and err.reason is E.Reason.PAYLOAD_TOO_LARGE
    assert str(err) == "PAYLOAD_TOO_LARGE: message 1: payload is 2,000,000 bytes"  # the call's own numbering
    # Not a shard failure: the stream goes on with the shard's next batch.
    p.add(after := call(0, "5"))
    plan = p.plan()
    assert not plan.cancelled and [s for s, _ in plan.sends] == [stream]
    assert p.acked(stream, ok(plan.sends[0][1])) == [after]


def test_a_call_with_a_message_no_node_stores_sends_the_others() -> None:
    """check_messages before the call joins a batch: 1,025 user properties fail at once, alone."""
    p = pipeline()
    sender = sender_on(0)
    messages = [
        Message("t", b"1", sender),
        Message("t", b"2", sender, properties=[(f"k{i}", "v") for i in range(1025)]),
        Message("t", b"3", sender),
    ]
    refused = check_messages(messages)
    assert list(refused) == [1] and "1,025 user properties" in str(refused[1])
    partial = PendingCall(messages, N_SHARDS, FAR, refused)
    p.add(partial)
    ((stream, batch),) = p.plan().sends
    assert payloads(batch) == [b"1", b"3"]
    assert p.acked(stream, ok(batch)) == [partial]
    with pytest.raises(E.PartialBatchError) as raised:
        partial.outcome()
    assert [m.payload for m in raised.value.stored] == [b"1", b"3"]
    assert [m.payload for m in raised.value.failed_messages] == [b"2"]


def test_a_call_whose_every_message_is_refused_settles_at_once() -> None:
    p = pipeline()
    messages = [Message("a/+", b"", "s"), Message("#", b"", "s")]
    doomed = PendingCall(messages, N_SHARDS, FAR, check_messages(messages))
    assert p.add(doomed) == [doomed] and p.unsettled_messages == 0
    with pytest.raises(E.InvalidArgumentError, match="message 0: invalid topic"):
        doomed.outcome()


def test_store_batch_sends_no_message_a_node_refuses_and_maps_the_nodes_refusals_to_its_own() -> None:
    """store_batch (one request per leader): a message the client can tell is bad is not sent; one its node
    refused (message_failures, numbered in that node's request) fails alone, the rest is returned."""
    senders = [sender_on(0), sender_on(1)]
    batch = [
        Message("t", b"0", senders[1]),
        Message("t/+", b"1", senders[0]),
        Message("t", b"2", senders[0]),
        Message("t", b"3", senders[1]),
    ]
    plan = StoreBatch(batch, N_SHARDS, "prod", 7, True)
    indexes, request = plan.request([1])
    assert indexes == [0, 3] and [m.payload for m in request.messages] == [b"0", b"3"]
    refused = pb.StoreBatchResponse(positions=[pb.MessagePosition(shard=1, timestamp_us=50), pb.MessagePosition()])
    refused.message_failures.add(index=1, reason="PAYLOAD_TOO_LARGE", message="payload is 9 bytes")
    plan.record(indexes, refused)
    indexes, request = plan.request([0])
    assert indexes == [2] and [m.payload for m in request.messages] == [b"2"]
    plan.record(indexes, pb.StoreBatchResponse(positions=[pb.MessagePosition(shard=0, timestamp_us=60)]))
    with pytest.raises(E.PartialBatchError) as raised:
        plan.outcome({})
    assert [m.payload for m in raised.value.stored] == [b"0", b"2"]
    errs = {m.payload: err for m, err in raised.value.failed}
    assert errs[b"1"].reason is E.Reason.INVALID_TOPIC and str(errs[b"1"]).startswith("INVALID_TOPIC: message 1:")
    assert errs[b"3"].reason is E.Reason.PAYLOAD_TOO_LARGE and "message 3: payload is 9 bytes" in str(errs[b"3"])
    assert raised.value.sequence == 7


def test_a_stream_that_answers_nothing_for_stall_s_is_given_up_and_its_batches_go_to_the_new_leader() -> None:
    """A stopped node (SIGSTOP) keeps its connection: the stream is given up after stall_s, not at the deadline."""
    p = pipeline({0: "a", 1: "a", 2: "b", 3: "b"}, max_batches_per_shard=4)
    calls = [call(0, "1", deadline=100.0), call(0, "2", deadline=100.0), call(2, "3", deadline=100.0)]
    for c in calls:
        p.add(c)
    plan = p.plan(now=10.0)
    a = next(s for s in plan.opened if s.address == "a:1")
    b = next(s for s in plan.opened if s.address == "b:1")
    sent_a = [x for s, x in plan.sends if s is a]
    assert plan.wake_at == 15.0
    ((_, on_b),) = [(s, x) for s, x in plan.sends if s is b]
    assert p.acked(b, ok(on_b)) == [calls[2]]  # b answers; a says nothing
    assert p.plan(now=14.9).cancelled == []
    given_up = p.plan(now=15.0)
    assert a in given_up.cancelled and given_up.refresh_map and given_up.settled == []
    assert 0 not in p.table.view.leaders  # forgotten: the map is asked again
    # Resent after the backoff (none in these tests), and not to the stalled node while no leader is known:
    # to another replica, which answers with a hint or stores them if it leads now. (b's stream already
    # carried a higher sequence, so it is restarted: the rule for any resend.)
    assert {s.address for s, _ in given_up.sends} == {"b:1"}
    resent = [x for _, x in given_up.sends]
    assert [x for x in resent if x.shard == 0] == sent_a  # the same batches, same sequences
    stream = given_up.sends[0][0]
    assert [c for x in sent_a for c in p.acked(stream, ok(x))] == calls[:2]


def test_every_call_settles_by_its_deadline_wherever_it_waits() -> None:
    """Queued behind full slots, sealed but not sent (backing off), or sent: each fails at its own deadline."""
    p = pipeline(max_batches_per_shard=1, max_batch_messages=1)
    sent, queued = call(0, "1", deadline=20.0), call(0, "2", deadline=30.0)
    p.add(sent)
    p.add(queued)
    plan = p.plan(now=10.0)
    assert len(plan.sends) == 1  # one slot: the second call waits in the queue
    stalled_at = plan.wake_at
    assert stalled_at is not None and stalled_at <= 20.0
    backing_off = call(1, "3", deadline=12.0)
    p.add(backing_off)
    p.shards[1].not_before = 1e12  # as after a failure
    assert p.plan(now=11.0).sends == [] and p.check_at <= 12.0
    assert p.plan(now=12.0).settled == [backing_off]
    with pytest.raises(E.DeadlineExceededError):
        backing_off.outcome()
    late = p.plan(now=30.0)
    assert sorted(late.settled, key=lambda c: c.deadline) == [sent, queued] or set(late.settled) >= {queued}
    assert sent.settled and queued.settled and p.unsettled_messages == 0
    assert p.check_at >= 30.0


def test_a_one_message_call_is_its_own_entry_and_a_plain_answer_settles_it() -> None:
    """No tuple or encoded copy per one-message call; the C reader's (sequence, timestamps) answer settles it."""
    p = pipeline()
    one, two = call(0, "1"), call(0, "2")
    p.add(one)
    p.add(two)
    ((stream, batch),) = p.plan().sends
    assert batch.entries == [one, two]
    assert payloads(batch) == [b"1", b"2"]
    assert p.acked(stream, (batch.sequence, [7, 8])) == [one, two]
    assert [m.timestamp_us for m in one.outcome() + two.outcome()] == [7, 8]
    assert all(m.shard == 0 for m in one.outcome())


def test_a_pipelined_call_that_finds_no_node_in_time_is_a_failed_future_in_both_clients() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    message = Message("t/1", b"x", sender_on(0), 1)
    with Client([endpoint], timeout_s=0.3) as sync:
        handle = sync.store_async(message)
        assert isinstance(handle, StoreFuture) and handle.done()
        with pytest.raises(E.UnavailableError, match=endpoint):
            handle.result()

    async def scenario() -> None:
        async with aio.Client([endpoint], timeout_s=0.3) as client:
            handle = await client.store_async(message)
            assert isinstance(handle, AsyncStoreFuture) and handle.done()
            with pytest.raises(E.UnavailableError, match=endpoint):
                await handle

    asyncio.run(scenario())
