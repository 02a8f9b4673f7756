"""Deleting stored messages through the client: one shard after another, each until its delete is done.

``DeleteRun`` holds a delete's state and no I/O: it says which request to
send next (``next_call``) and takes each answer (``record``); the sync and
asyncio clients send them. A node answers after a bounded time with a cursor
when there is more to do; the next request carries it, so a failover (the
client retries the same request on the new leader) neither repeats nor skips
anything: a step applied twice deletes nothing more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mqds.client.core.operations import ShardCall
from mqds.protocol.deletes import check_delete
from mqds.protocol.sharding import shard_of
from mqds.v1 import storage_pb2 as pb


@dataclass(frozen=True)
class ShardDeleted:
    """What a delete removed from one shard."""

    shard: int
    messages: int
    """Messages deleted."""
    index_keys: int
    """Index keys deleted with them."""
    scanned_keys: int
    """Data keys read to find them."""
    steps: int
    """Logged steps (each applied by every replica)."""
    until_us: int
    """The delete's upper bound in this shard: messages stored from then on were kept."""


@dataclass
class DeleteReport:
    """What ``Client.delete_messages`` deleted, per shard."""

    shards: list[ShardDeleted] = field(default_factory=list)

    @property
    def messages(self) -> int:
        return sum(s.messages for s in self.shards)

    @property
    def keys(self) -> int:
        """Keys deleted: messages and index keys."""
        return sum(s.messages + s.index_keys for s in self.shards)

    @property
    def by_shard(self) -> dict[int, int]:
        """Messages deleted in each shard that had any."""
        return {s.shard: s.messages for s in self.shards if s.messages}


Progress = Callable[[int, pb.DeleteMessagesResponse], None]
"""Called after each answer: the shard, and what that call deleted (``cursor`` set while more is to do)."""


class DeleteRun:
    """One delete across the shards it touches: the next request to send, and the answers so far."""

    def __init__(
        self,
        n_shards: int,
        topic_filter: str,
        sender: str,
        since_us: int,
        until_us: int,
        confirm_all: bool,
        progress: Progress | None = None,
    ) -> None:
        check_delete(topic_filter, sender, since_us, until_us, confirm_all)
        self._base = pb.DeleteMessagesRequest(
            topic_filter=topic_filter, sender=sender, since_us=since_us, until_us=until_us, confirm_all=confirm_all
        )
        self._shards = [shard_of(sender, n_shards)] if sender else list(range(n_shards))
        self._position = 0
        self._cursor: pb.DeleteCursor | None = None
        self._totals = pb.DeleteMessagesResponse()
        self._progress = progress
        self.report = DeleteReport()

    def next_call(self) -> ShardCall[pb.DeleteMessagesResponse] | None:
        """The call to send next (to its shard's leader); None once every shard is done."""
        if self._position >= len(self._shards):
            return None
        shard = self._shards[self._position]
        request = pb.DeleteMessagesRequest()
        request.CopyFrom(self._base)
        request.shard = shard
        if self._cursor is not None:
            request.cursor.CopyFrom(self._cursor)
        return ShardCall("DeleteMessages", shard, request, _answer)

    def record(self, response: pb.DeleteMessagesResponse) -> None:
        """The answer to the request ``next_call`` gave."""
        shard = self._shards[self._position]
        totals = self._totals
        totals.deleted_messages += response.deleted_messages
        totals.deleted_index_keys += response.deleted_index_keys
        totals.scanned_keys += response.scanned_keys
        totals.steps += response.steps
        if self._progress is not None:
            self._progress(shard, response)
        if response.HasField("cursor"):
            self._cursor = response.cursor
            return
        self.report.shards.append(
            ShardDeleted(
                shard,
                totals.deleted_messages,
                totals.deleted_index_keys,
                totals.scanned_keys,
                totals.steps,
                response.until_us,
            )
        )
        self._totals = pb.DeleteMessagesResponse()
        self._cursor = None
        self._position += 1


def _answer(response: pb.DeleteMessagesResponse) -> pb.DeleteMessagesResponse:
    """A ``DeleteMessages`` answer as it is: ``DeleteRun.record`` reads it."""
    return response
