"""The rules of a StoreStream call, without a node: what ends the stream, and a failed shard's later batches.

The node-level behaviour (statuses, flow control) is in
``tests/server/api/test_store_stream.py``; here the reader's decisions are
checked one frame at a time against a stand-in for the storage service.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pysyncobj import FAIL_REASON

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.api.request_bounds import WithRaw
from mqds.server.api.storage_service import StorageService, StoreInFlight
from mqds.server.api.store_stream import _Stream, batch_bytes
from mqds.server.raft.futures import Proposal
from mqds.v1 import storage_pb2 as pb


class FakeStorage:
    """Proposes every batch to shard 0 and remembers which shards it was told to refuse."""

    max_batch_messages = 10
    shards = SimpleNamespace(n_shards=4)
    check_batch_size = StorageService.check_batch_size  # the real check, on this max_batch_messages

    def __init__(self) -> None:
        self.proposals: list[Proposal] = []
        self.refused_seen: list[set[int]] = []

    def start_store(self, batch: pb.StoreBatchRequest, raw: bytes | None, refused: dict[int, MqdsError]) -> Any:
        self.refused_seen.append(set(refused))
        if 0 in refused:
            return StoreInFlight([0], {0: [0]}, len(batch.messages), [refused[0]])
        proposal = Proposal(0)
        self.proposals.append(proposal)
        return StoreInFlight([0], {0: [0]}, len(batch.messages), [proposal])


def frame(sequence: int, producer: str = "p", n: int = 1) -> WithRaw:
    request = pb.StoreStreamRequest(
        batch=pb.StoreBatchRequest(
            producer_id=producer, sequence=sequence, messages=[pb.Message(topic="t", sender="s")] * n
        )
    )
    return WithRaw(request, request.SerializeToString())


def test_a_failed_proposal_refuses_its_shards_next_batches_before_anyone_answered_it() -> None:
    storage = FakeStorage()
    stream = _Stream(storage, window=8)  # type: ignore[arg-type]
    stream.start(frame(1))
    stream.start(frame(2))
    assert storage.refused_seen == [set(), set()]
    storage.proposals[1].on_result(None, FAIL_REASON.DISCARDED)  # a leader change dropped it
    _, third = stream.start(frame(3))
    assert storage.refused_seen[-1] == {0}
    assert isinstance(third, StoreInFlight) and isinstance(third.started[0], MqdsError)
    assert third.started[0].reason is Reason.NO_LEADER


def test_the_streams_rules() -> None:
    stream = _Stream(FakeStorage(), window=8)  # type: ignore[arg-type]
    stream.start(frame(5))
    with pytest.raises(MqdsError) as err:
        stream.start(frame(5))
    assert err.value.reason is Reason.OUT_OF_ORDER
    with pytest.raises(MqdsError) as err:
        stream.start(frame(6, producer="other"))
    assert err.value.reason is Reason.OUT_OF_ORDER
    with pytest.raises(MqdsError) as err:
        stream.start(frame(7, n=11))
    assert err.value.reason is Reason.BATCH_TOO_LARGE
    with pytest.raises(MqdsError) as err:
        stream.start(frame(8, producer=""))
    assert err.value.reason is Reason.INVALID_REQUEST


def test_the_batch_inside_a_frame_is_found_without_parsing_it() -> None:
    batch = pb.StoreBatchRequest(producer_id="p", sequence=3, messages=[pb.Message(topic="a/b", payload=b"x" * 300)])
    raw = pb.StoreStreamRequest(batch=batch).SerializeToString()
    assert batch_bytes(raw) == batch.SerializeToString()
    assert batch_bytes(raw + b"\x12\x00") is None  # another field too: parse it instead
    assert batch_bytes(b"") is None and batch_bytes(b"\x12\x01x") is None
