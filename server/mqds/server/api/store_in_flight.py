"""A StoreBatch whose parts are proposed: waiting for them, and the answer they make.

``StorageService.start_store`` checks a batch, splits it by shard and proposes
each shard's part without waiting; what it returns is a :class:`StoreInFlight`.
StoreBatch waits for it at once (``finish``); a StoreStream (``store_stream.py``)
keeps many in flight and answers each in order (``outcome``, ``answer``).
"""

from __future__ import annotations

import time

from mqds.protocol.errors import MqdsError
from mqds.protocol.messages import Problem, problem_error
from mqds.server.raft.futures import Proposal
from mqds.server.wire import positions_bytes
from mqds.v1 import storage_pb2 as pb


class StoreInFlight:
    """A batch whose parts are proposed (``StorageService.start_store``); ``finish`` waits for them and answers."""

    __slots__ = ("by_shard", "count", "invalid", "order", "started")

    def __init__(
        self,
        order: list[int],
        by_shard: dict[int, list[int]],
        count: int,
        started: list[Proposal | MqdsError],
        invalid: dict[int, tuple[int, Problem]] | None = None,
    ) -> None:
        self.order = order
        """The shards of the batch, in order."""
        self.by_shard = by_shard
        """Each shard's messages (their indexes in the request), in order: the ones its part stores."""
        self.count = count
        self.started = started
        self.invalid = invalid or {}
        """The messages refused alone (not in any part): index -> (their shard, what is wrong)."""

    def outcome(self, timeout_s: float) -> list[int | MqdsError]:
        """Each shard's first timestamp, or its error, once every part committed (or failed, or timed out)."""
        deadline = time.monotonic() + timeout_s
        results: list[int | MqdsError] = []
        for item in self.started:
            if isinstance(item, MqdsError):
                results.append(item)
                continue
            try:
                results.append(item.wait(max(0.0, deadline - time.monotonic())))
            except MqdsError as err:
                results.append(err)
        return results

    def finish(self, timeout_s: float) -> pb.StoreBatchResponse | bytes:
        """The StoreBatch answer; raises the error when no message was stored."""
        if not self.order:
            if self.invalid:
                index = min(self.invalid)
                raise problem_error(f"message {index}", self.invalid[index][1])
            return pb.StoreBatchResponse()
        return self.answer(self.outcome(timeout_s), raise_if_none=True)

    def answer(self, results: list[int | MqdsError], raise_if_none: bool) -> pb.StoreBatchResponse | bytes:
        """The StoreBatchResponse for the parts' results (encoded when one shard stored all)."""
        order, by_shard, invalid = self.order, self.by_shard, self.invalid
        failed = [(shard, r) for shard, r in zip(order, results, strict=True) if isinstance(r, MqdsError)]
        if raise_if_none and order and len(failed) == len(order):
            raise failed[0][1]
        if len(order) == 1 and not failed and not invalid:
            first = results[0]
            assert isinstance(first, int)
            return positions_bytes(order[0], first, self.count)
        timestamps = [0] * self.count
        shards = [0] * self.count
        for shard, first in zip(order, results, strict=True):
            for offset, index in enumerate(by_shard[shard]):
                timestamps[index] = 0 if isinstance(first, MqdsError) else first + offset
                shards[index] = shard
        for index, (shard, _) in invalid.items():
            shards[index] = shard
        response = pb.StoreBatchResponse()
        add = response.positions.add
        for ts, shard in zip(timestamps, shards, strict=True):
            add(shard=shard, timestamp_us=ts)
        for shard, err in failed:
            response.failures.add(shard=shard, reason=err.reason.value, message=err.message, metadata=err.metadata)
        for index in sorted(invalid):
            reason, text = invalid[index][1]
            response.message_failures.add(index=index, reason=reason.value, message=text)
        return response
