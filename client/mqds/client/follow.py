"""Push subscriptions (``Client.follow``): positions, batches and the per-shard rules; no I/O.

A subscription to a topic filter is one ``Storage.Follow`` subscription per
shard, each on a node that holds the shard (its leader unless
``any_replica``), all of a client's on one call per node
(:mod:`mqds.client.follow_sync` runs them). Each shard part remembers the
position its last answer reached; when its node fails, stops leading or
goes away, the part starts again from that position on another replica, so
the messages continue with nothing lost or repeated. Credit keeps memory
bounded on both sides: a part is granted ``window`` messages, and grants
again only as many as the application has taken, so at most ``window``
messages per shard wait in the client.

A :class:`FollowPosition` is what an application saves to resume later: the
cluster's id, the filter, and each shard's position, with a checksum.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from mqds.client.model import Message
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason

__all__ = ["FollowBatch", "FollowPosition", "ShardPart"]

_MAGIC = b"mqf1"
_HEAD = struct.Struct(">4sHH")  # magic, len(cluster_id), len(topic_filter)... lengths in bytes
_ENTRY = struct.Struct(">IQ")  # shard, after_us
_CRC = struct.Struct(">I")


def _bad(why: str) -> MqdsError:
    return errors.error(Reason.INVALID_POSITION, f"not a follow position: {why}")


@dataclass(frozen=True)
class FollowPosition:
    """Where a subscription is: for each shard, the timestamp its messages were read up to.

    ``to_bytes()`` gives what to save; ``Client.follow(topic_filter,
    position=FollowPosition.from_bytes(saved))`` continues after it, with
    nothing lost or repeated. A position belongs to one cluster and one
    topic filter: another one is refused (INVALID_POSITION).
    """

    cluster_id: str
    topic_filter: str
    after_us: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, cluster_id: str, topic_filter: str, after_us: Mapping[int, int]) -> FollowPosition:
        return cls(cluster_id, topic_filter, tuple(sorted(after_us.items())))

    def shard_after(self, shard: int) -> int:
        return dict(self.after_us).get(shard, 0)

    def to_bytes(self) -> bytes:
        cid, flt = self.cluster_id.encode(), self.topic_filter.encode()
        body = _HEAD.pack(_MAGIC, len(cid), len(flt)) + cid + flt
        body += b"".join(_ENTRY.pack(shard, after) for shard, after in self.after_us)
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes) -> FollowPosition:
        """The position saved as ``data``; INVALID_POSITION if it is damaged or not a position."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise _bad(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEAD.size + _CRC.size:
            raise _bad(f"{len(data)} bytes is too short")
        body, (crc,) = data[: -_CRC.size], _CRC.unpack(data[-_CRC.size :])
        if zlib.crc32(body) != crc:
            raise _bad("its checksum does not match (damaged or truncated)")
        magic, cid_len, flt_len = _HEAD.unpack_from(body)
        if magic != _MAGIC:
            raise _bad("unknown format")
        rest = body[_HEAD.size :]
        if len(rest) < cid_len + flt_len or (len(rest) - cid_len - flt_len) % _ENTRY.size:
            raise _bad("its lengths do not add up")
        try:
            cid = rest[:cid_len].decode()
            flt = rest[cid_len : cid_len + flt_len].decode()
        except UnicodeDecodeError:
            raise _bad("its names are not UTF-8") from None
        entries = rest[cid_len + flt_len :]
        after = tuple(_ENTRY.unpack_from(entries, i) for i in range(0, len(entries), _ENTRY.size))
        return cls(cid, flt, after)

    def check(self, cluster_id: str, topic_filter: str, n_shards: int) -> None:
        """Refuse (INVALID_POSITION) a position of another cluster, filter or shard count."""
        if self.cluster_id != cluster_id:
            raise errors.error(
                Reason.INVALID_POSITION,
                f"this position is of cluster {self.cluster_id!r}, not of this cluster ({cluster_id!r})",
            )
        if self.topic_filter != topic_filter:
            raise errors.error(
                Reason.INVALID_POSITION,
                f"this position is of topic filter {self.topic_filter!r}, not {topic_filter!r}",
            )
        for shard, _ in self.after_us:
            if not 0 <= shard < n_shards:
                raise errors.error(
                    Reason.INVALID_POSITION, f"this position names shard {shard}; the cluster has {n_shards}"
                )


@dataclass(frozen=True)
class FollowBatch:
    """Messages of one shard, in the order they were stored, and the subscription's position after them."""

    shard: int
    messages: list[Message]
    position: FollowPosition
    """Save ``position.to_bytes()`` once these are handled: following from it continues after them."""

    def __iter__(self) -> Iterator[Message]:
        return iter(self.messages)

    def __len__(self) -> int:
        return len(self.messages)


@dataclass(eq=False)
class ShardPart:
    """One shard's part of a subscription: where it is, where it is served, what it may still be sent."""

    shard: int
    after_us: int
    sub_id: int = 0
    """The id of its current Follow subscription (a new one at each start)."""
    address: str | None = None
    granted: int = 0
    """Messages the node may still send it."""
    taken: int = 0
    """Messages the application took since credit was last granted."""
    attempt: int = 0
    retry_at: float = 0.0
    last_error: MqdsError | None = None
    hint: str | None = None
    """Where a NOT_LEADER answer said to go next."""
    history: list[str] = field(default_factory=list)
