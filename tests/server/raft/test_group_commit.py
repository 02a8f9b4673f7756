"""Group commit: proposals gathered into one log entry, and a vnode applying such an entry.

Each command of a batch entry keeps its own result (positions, refusals,
exactly-once answers); consecutive stores become one RocksDB write; an
entry written in several parts is applied once per part even when its apply
is interrupted and run again (a failed disk write, a crash and a replay).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pysyncobj import FAIL_REASON
from storage_support import vnode_replica

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.cluster.vnode import VnodeReplica
from mqds.server.raft import batching
from mqds.server.raft.futures import Proposal
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

# -- gathering proposals -----------------------------------------------------------------


def drained(queue: batching.ProposalQueue) -> list[tuple[bytes, Any, bool]]:
    entries: list[tuple[bytes, Any, bool]] = []
    queue.drain(lambda body, callback, is_batch: entries.append((body, callback, is_batch)))
    return entries


def test_a_lone_proposal_is_a_plain_entry() -> None:
    queue = batching.ProposalQueue(max_entry_bytes=1024)
    proposal = Proposal(3)
    queue.add(b"one", proposal)
    ((body, callback, is_batch),) = drained(queue)
    assert (body, is_batch) == (b"one", False)
    callback("result", FAIL_REASON.SUCCESS)
    assert proposal.wait(1) == "result"
    assert queue.batched_entries == 0


def test_proposals_waiting_together_share_an_entry_each_keeping_its_result() -> None:
    queue = batching.ProposalQueue(max_entry_bytes=1024)
    proposals = [Proposal(3) for _ in range(3)]
    for i, proposal in enumerate(proposals):
        queue.add(f"cmd{i}".encode(), proposal)
    ((body, callback, is_batch),) = drained(queue)
    assert is_batch and batching.decode(body) == [b"cmd0", b"cmd1", b"cmd2"]
    refusal = MqdsError(Reason.INVALID_REQUEST, "a reused sequence", {})
    callback([10, refusal, 30], FAIL_REASON.SUCCESS)
    assert proposals[0].wait(1) == 10 and proposals[2].wait(1) == 30
    with pytest.raises(MqdsError, match="reused"):
        proposals[1].wait(1)
    assert (queue.batched_entries, queue.batched_commands) == (1, 3)


def test_an_entry_never_passes_the_size_limit() -> None:
    queue = batching.ProposalQueue(max_entry_bytes=100)
    for i in range(5):
        queue.add(bytes([i]) * 40, Proposal(1))
    entries = drained(queue)
    assert [is_batch for _, _, is_batch in entries] == [True, True, False]
    assert all(len(body) <= 100 for body, _, _ in entries)
    assert sum(len(batching.decode(b)) if batch else 1 for b, _, batch in entries) == 5


def test_a_failed_entry_fails_every_proposal_in_it() -> None:
    queue = batching.ProposalQueue(max_entry_bytes=1024)
    proposals = [Proposal(2), Proposal(2)]
    for proposal in proposals:
        queue.add(b"x", proposal)
    ((_, callback, _),) = drained(queue)
    callback(None, FAIL_REASON.DISCARDED)
    for proposal in proposals:
        with pytest.raises(MqdsError) as err:
            proposal.wait(1)
        assert err.value.reason is Reason.NO_LEADER
    queue.add(b"y", late := Proposal(2))
    queue.fail_all(FAIL_REASON.NOT_LEADER)
    with pytest.raises(MqdsError):
        late.wait(1)


# -- a vnode applying a batch entry ------------------------------------------------------


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[VnodeReplica]:
    with vnode_replica(str(tmp_path / "v0")) as r:
        yield r


def store(topic: str, n: int, now_us: int, producer: str = "", sequence: int = 0) -> bytes:
    cmd = cpb.VnodeCommand()
    cmd.store.now_us = now_us
    cmd.store.messages.extend(pb.Message(topic=f"{topic}/{i}", payload=b"p", sender="s") for i in range(n))
    if producer:
        cmd.store.producer_id, cmd.store.sequence = producer, sequence
    return cmd.SerializeToString()


def subscribe(clientid: str, topic_filter: str) -> bytes:
    request = spb.SubscribeRequest(clientid=clientid, topic_filter=topic_filter, qos=1)
    return cpb.VnodeCommand(session=cpb.SessionCommand(now_us=5_000, subscribe=request)).SerializeToString()


def stored_topics(replica: VnodeReplica) -> list[str]:
    with replica.reading() as storage:
        topics = []
        for ref in storage.get_streams(["#"], 0):
            state = storage.make_iterator(ref.generation, ref.stream, "#", 0)
            topics.extend(pb.Message.FromString(v).topic for _, v in storage.next(state, 10_000).entries)
        return sorted(topics)


def test_stores_in_one_entry_get_consecutive_positions_and_their_own_answers(replica: VnodeReplica) -> None:
    bodies = [
        store("a", 2, 2_000, "p", 1),
        store("b", 3, 2_001, "p", 2),
        store("a", 2, 2_002, "p", 1),  # the same batch again, within the entry: stored once
        store("c", 1, 2_003, "p", 2),  # a sequence reused with another count: refused
    ]
    results = replica.apply_batch(bodies, 2)
    assert results[0] == 2_000 and results[1] == 2_002 and results[2] == 2_000
    assert isinstance(results[3], MqdsError) and results[3].reason is Reason.INVALID_REQUEST
    assert replica.applied_index == 2
    assert stored_topics(replica) == ["a/0", "a/1", "b/0", "b/1", "b/2"]
    assert replica.stored_messages == 5
    assert replica.apply_batch(bodies, 2) == [None] * 4  # applied already: skipped


def test_session_commands_and_stores_mix_in_order(replica: VnodeReplica) -> None:
    bodies = [store("x", 1, 3_000), subscribe("c1", "x/#"), store("y", 1, 3_001), b"\xff\xff not a command"]
    results = replica.apply_batch(bodies, 5)
    assert isinstance(results[0], int) and isinstance(results[2], int) and results[2] > results[0]
    assert isinstance(results[3], MqdsError)
    assert replica.storage.sessions.subscriptions("c1") == [("x/#", 1)]
    assert replica.applied_index == 5


def test_an_entry_interrupted_between_its_writes_is_applied_once_when_run_again(
    replica: VnodeReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stores written before a failed session write are not written again when the entry is retried."""
    bodies = [store("s", 2, 4_000), subscribe("c2", "s/#"), store("t", 1, 4_001)]
    sessions = replica.storage.sessions
    real = sessions.subscribe
    failing = {"left": 1}

    def subscribe_once_failing(*args: Any, **kwargs: Any) -> None:
        if failing["left"]:
            failing["left"] -= 1
            raise OSError("disk full")
        real(*args, **kwargs)

    monkeypatch.setattr(sessions, "subscribe", subscribe_once_failing)
    with pytest.raises(OSError):
        replica.apply_batch(bodies, 7)
    assert replica.applied_index < 7
    replica.apply_batch(bodies, 7)  # the group's cycle retries the entry
    assert stored_topics(replica) == ["s/0", "s/1", "t/0"]
    assert replica.applied_index == 7
