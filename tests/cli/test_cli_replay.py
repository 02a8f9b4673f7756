"""``mqds replay`` without ``--follow``: to the fences of its start, streams merged, a dropped generation skipped."""

from __future__ import annotations

from typing import Any

import pytest

from mqds.cli.messages import Tail
from mqds.client import Client, Fence, MessageBatch, NextResult, Rank, Stream
from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.v1 import storage_pb2 as pb

STREAMS = {1: (0, [1, 4, 6, 9]), 2: (0, [2, 3, 7, 8, 12]), 3: (1, [5, 10])}
"""Stream id: (shard, timestamps stored); shard 0's fence is 9: its 12 came after the replay began."""
FENCES = {0: 9, 1: 10}


class FakeClient(Client):
    """A client whose reads answer from ``STREAMS`` (no node); stream 3's generation is dropped once it is read."""

    def __init__(self) -> None:
        super().__init__(["127.0.0.1:1"])
        self.fences_asked: list[int] = []
        self.read_fences: set[int] = set()

    def get_streams(self, topic_filter: str, start_time_us: int = 0, **_: Any) -> list[tuple[Rank, Stream]]:
        return [(Rank(shard, 1), Stream(shard, 1, sid, "t/+")) for sid, (shard, _) in STREAMS.items()]

    def get_fences(self, shards: Any = None, **_: Any) -> list[Fence]:
        self.fences_asked += shards
        return [Fence(shard, FENCES[shard], 1, ()) for shard in shards]

    def make_iterator(self, stream: Stream, topic_filter: str, start_time_us: int = 0, **_: Any) -> Any:
        return (stream.id, 0)

    def first_batch(
        self, stream: Stream, topic_filter: str, start_time_us: int = 0, batch_size: int = 100, **kw: Any
    ) -> NextResult:
        return self.next(self.make_iterator(stream, topic_filter, start_time_us), batch_size, **kw)

    def next(self, iterator: Any, batch_size: int = 100, *, fence_us: int | None = None, **_: Any) -> NextResult:
        batch = batch_size
        assert fence_us is not None
        sid, at = iterator
        self.read_fences.add(fence_us)
        if sid == 3:
            raise errors.error(Reason.GENERATION_DROPPED, "generation 1 of shard 1 was dropped")
        stamps = [ts for ts in STREAMS[sid][1] if ts <= fence_us][at : at + batch]
        answer = pb.NextResponse()
        for ts in stamps:
            answer.messages.add(topic=f"t/{sid}", payload=str(ts).encode(), timestamp_us=ts, shard=STREAMS[sid][0])
        ended = at + len(stamps) >= len([ts for ts in STREAMS[sid][1] if ts <= fence_us])
        return NextResult(MessageBatch(answer.messages), (sid, at + len(stamps)), ended)  # type: ignore[arg-type]


@pytest.mark.parametrize("batch", [1, 2, 100])
def test_replay_reads_to_the_fences_merges_streams_and_skips_a_dropped_generation(
    batch: int, capsys: pytest.CaptureFixture[str]
) -> None:
    client = FakeClient()
    got = [(m.shard, m.timestamp_us) for m in Tail(client, "t/#", 0, batch, False).poll()]
    assert got == [(0, ts) for ts in (1, 2, 3, 4, 6, 7, 8, 9)]  # one timeline; nothing after the fence
    assert client.fences_asked == [0, 1] and client.read_fences == {9, 10}
    assert "generation 1 of shard 1 was dropped meanwhile" in capsys.readouterr().err
