"""What the public services share: the shards as the API sees them, shard numbers checked, reads and proposals.

``ShardsAPI`` is the base of the Storage and Sessions services (and what the
delete and backup services are handed): a request's shard numbers checked
against the cluster's, an answer's size checked against ``max_answer_bytes``,
commands against the Raft entry limit, reads begun on leaders (a read index)
or any replica (``stale_ok``), one proposal per shard. The protocols say what
it needs of a node's vnodes (``mqds.server.cluster.vnode``), so the API never
imports the cluster layer's classes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.topics import TopicError, validate_filter
from mqds.server.raft.group import PendingRead, Proposal
from mqds.server.storage import GenerationInfo, StorePart
from mqds.v1 import storage_pb2 as pb

# What pysyncobj adds to a command in its log entry (the command type byte),
# with room to spare: a command this much under the entry limit is sent whole.
_ENTRY_OVERHEAD = 64


def now_us() -> int:
    return time.time_ns() // 1000


class Replica(Protocol):
    """A vnode replica as the API sees it (``mqds.server.cluster.vnode.VnodeReplica``)."""

    def reading(self) -> Any: ...

    def expect_store(self, body: bytes, part: StorePart) -> None: ...

    def unexpect_store(self, body: bytes) -> None: ...


class Group(Protocol):
    def propose(self, body: bytes) -> Proposal: ...


class VnodeView(Protocol):
    @property
    def shard(self) -> int: ...

    @property
    def replica(self) -> Replica: ...

    @property
    def group(self) -> Group: ...


class Shards(Protocol):
    """What the node gives the API: its vnode replicas and the rules to reach them."""

    @property
    def n_shards(self) -> int: ...

    @property
    def write_timeout_s(self) -> float: ...

    @property
    def read_timeout_s(self) -> float: ...

    def leader_vnode(self, shard: int) -> VnodeView: ...

    def vnode(self, shard: int) -> Any: ...

    def begin_read(self, shard: int, stale_ok: bool) -> tuple[VnodeView, PendingRead | None]: ...


class ShardsAPI:
    """What the public services share: shard numbers checked, reads on leaders, proposals to them."""

    def __init__(
        self, shards: Shards, *, max_answer_bytes: int | None = None, max_entry_bytes: int | None = None
    ) -> None:
        self.shards = shards
        self.max_answer_bytes = max_answer_bytes
        """Largest answer built (max_answer_bytes); None = no limit."""
        self.max_entry_bytes = max_entry_bytes
        """The Raft entry limit: a larger command could not reach the followers; None = no check."""

    def _shard_numbers(
        self, shard: int, all_shards: bool, shards: Sequence[int] = (), field: str = "shards"
    ) -> list[int]:
        """The shards a request names, each once, in order; a list longer than ``n_shards`` is refused."""
        n = self.shards.n_shards
        if len(shards) > n:
            raise errors.error(
                Reason.INVALID_REQUEST,
                f"{field} lists {len(shards):,} shard ids; at most {n} (the number of shards) are allowed, each once",
            )
        chosen = sorted(set(shards)) if shards else (list(range(n)) if all_shards else [shard])
        for number in chosen:
            if not 0 <= number < n:
                raise errors.error(Reason.UNKNOWN_SHARD, f"shard {number} does not exist; shards are 0 to {n - 1}")
        return chosen

    def _check_answer(self, size: int, what: str, advice: str) -> None:
        """Refuse an answer of ``size`` bytes over max_answer_bytes (INVALID_REQUEST), saying what to ask instead."""
        if self.max_answer_bytes is not None and size > self.max_answer_bytes:
            raise errors.error(
                Reason.INVALID_REQUEST,
                f"{what} would take more than {self.max_answer_bytes:,} bytes to answer (the node's "
                f"max_answer_bytes); {advice}",
            )

    def _check_commands(self, commands: list[tuple[int, bytes]]) -> None:
        """Refuse, before anything is proposed, a command the Raft log could not send to the followers."""
        if self.max_entry_bytes is None:
            return
        limit = self.max_entry_bytes - _ENTRY_OVERHEAD
        for shard, body in commands:
            if len(body) > limit:
                raise errors.error(
                    Reason.INVALID_REQUEST,
                    f"shard {shard}'s part of the request is {len(body):,} bytes as a Raft command, over the "
                    f"limit of {limit:,} (max_request_bytes + 1 MiB, less overhead); split it into smaller calls",
                )

    def _read(self, shard_numbers: list[int], stale_ok: bool) -> list[VnodeView]:
        """The vnodes to read, once each may be read (read index confirmed on all of them together)."""
        started = [self.shards.begin_read(shard, stale_ok) for shard in shard_numbers]
        for _, pending in started:
            if pending is not None:
                pending.wait(self.shards.read_timeout_s)
        return [vnode for vnode, _ in started]

    def _propose_all(self, commands: list[tuple[int, bytes]]) -> list[Any]:
        """Propose one command per shard (leaders checked first); the results, in order."""
        self._check_commands(commands)
        vnodes = [self.shards.leader_vnode(shard) for shard, _ in commands]
        proposals = [vnode.group.propose(body) for vnode, (_, body) in zip(vnodes, commands, strict=True)]
        return [p.wait(self.shards.write_timeout_s) for p in proposals]

    @staticmethod
    def _generation(info: GenerationInfo) -> pb.Generation:
        return pb.Generation(
            shard=info.shard,
            generation=info.generation,
            since_us=info.since_us,
            until_us=info.until_us or 0,
            created_at_us=info.created_at_us,
            current=info.current,
        )

    @staticmethod
    def _filter(topic_filter: str) -> list[str]:
        try:
            return validate_filter(topic_filter)
        except TopicError as err:
            raise errors.error(Reason.INVALID_TOPIC_FILTER, str(err)) from None
