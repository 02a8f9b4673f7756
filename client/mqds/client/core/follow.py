"""Push subscriptions (``Client.follow``): positions, batches and the per-shard rules; no I/O.

A subscription to a topic filter is one ``Storage.Follow`` subscription per
shard, each on a node that holds the shard (its leader unless
``any_replica``), all of a client's on one call per node
(:mod:`mqds.client.sync.follow` runs them). Each shard part remembers the
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

import itertools
import struct
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from mqds.client.batch import MessageBatch
from mqds.client.core.routing_table import RoutingTable
from mqds.client.model import Message
from mqds.protocol import errors
from mqds.protocol.cluster_view import ClusterView
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.topics import TopicError, validate_filter
from mqds.v1 import storage_pb2 as pb

__all__ = [
    "FollowBatch",
    "FollowCore",
    "FollowPosition",
    "FollowRoutes",
    "FollowState",
    "ShardPart",
    "merge_credits",
]

FOLLOW_METHOD = "/mqds.v1.Storage/Follow"
"""The Follow call's gRPC method, as both clients and the fan-out benchmark open it."""
_RETRY_MAX_S = 2.0

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
    messages: MessageBatch
    """A :class:`~mqds.client.batch.MessageBatch`: ``Message`` objects as it is read, or columns."""
    position: FollowPosition
    """Save ``position.to_bytes()`` once these are handled: following from it continues after them."""

    def __iter__(self) -> Iterator[Message]:
        return iter(self.messages)

    def __len__(self) -> int:
        return len(self.messages)


@dataclass(eq=False)
class ShardPart:
    """One shard's part of a subscription: where it is, and where and when it starts again after a failure."""

    shard: int
    after_us: int
    sub_id: int = 0
    """The id of its current Follow subscription (a new one at each start; 0 while it has none)."""
    attempt: int = 0
    retry_at: float = 0.0
    hint: str | None = None
    """Where a NOT_LEADER answer said to go next."""
    history: list[str] = field(default_factory=list)


S = TypeVar("S")
C = TypeVar("C")


class FollowRoutes(Generic[S, C]):
    """Which subscription and shard part each Follow subscription id belongs to, and on which call (``C``).

    The transports' shared bookkeeping; not thread-safe (the sync client holds a lock around it).
    """

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._routes: dict[int, tuple[S, ShardPart, C]] = {}

    def add(self, sub: S, part: ShardPart, call: C, request: pb.FollowStart) -> None:
        """``part`` starts on ``call`` under a new id (set in ``request`` too)."""
        part.sub_id = request.id = next(self._ids)
        self._routes[part.sub_id] = (sub, part, call)

    def call_of(self, part: ShardPart) -> C | None:
        route = self._routes.get(part.sub_id)
        return None if route is None else route[2]

    def answered(self, answer: pb.FollowResponse) -> list[tuple[int, S, ShardPart]]:
        """Whose answer this is: each subscription id it is for (its own and ``also``) with its subscription and
        shard part, leaving out those that ended; a failure ends the route.
        """
        routes = self._routes
        if answer.HasField("failure"):
            route = routes.pop(answer.id, None)
            return [] if route is None else [(answer.id, route[0], route[1])]
        ids = (answer.id, *answer.also) if answer.also else (answer.id,)
        return [(sid, route[0], route[1]) for sid in ids if (route := routes.get(sid)) is not None]

    def ended(self, call: C) -> list[tuple[int, S, ShardPart]]:
        """``call`` ended: the subscriptions that were on it (their routes removed)."""
        lost = [(sid, sub, part) for sid, (sub, part, c) in self._routes.items() if c is call]
        for sid, _, _ in lost:
            del self._routes[sid]
        return lost

    def remove(self, part: ShardPart) -> tuple[C, bool] | None:
        """End ``part``'s route: its call, and whether no other subscription is left on it."""
        route = self._routes.pop(part.sub_id, None)
        if route is None:
            return None
        call = route[2]
        return call, not any(r[2] is call for r in self._routes.values())

    def clear(self) -> None:
        self._routes.clear()


MERGE_MAX = 1024
"""Requests waiting on a call that are taken together to merge their credits, at most."""


def merge_credits(requests: list[pb.FollowRequest]) -> list[pb.FollowRequest]:
    """``requests`` as they go on a call, each run of credits of the same size merged into one request
    (``FollowCredit.also``); starts and cancels keep their places, so a credit never overtakes its start.
    """
    merged: list[pb.FollowRequest] = []
    run: dict[int, pb.FollowRequest] = {}
    for request in requests:
        if request.WhichOneof("kind") != "credit":
            run.clear()
            merged.append(request)
            continue
        credit = request.credit
        same = run.get(credit.messages)
        if same is None:
            run[credit.messages] = request
            merged.append(request)
        else:
            same.credit.also.append(credit.id)
            same.credit.also.extend(credit.also)
    return merged


class FollowCore:
    """A subscription's decisions, shared by the sync and asyncio clients (which do the I/O).

    Where each shard part starts and from where, what an answer means (a
    batch, progress, a failure to retry elsewhere or to raise), when a part
    is due to start again, and how much credit the application freed.
    """

    def __init__(
        self,
        table: RoutingTable,
        cluster_id: str,
        n_shards: int,
        topic_filter: str,
        *,
        start_time_us: int = 0,
        position: FollowPosition | None = None,
        window: int = 1000,
        any_replica: bool = False,
        shards: list[int] | None = None,
    ) -> None:
        try:
            validate_filter(topic_filter)
        except TopicError as err:
            raise errors.error(Reason.INVALID_TOPIC_FILTER, str(err)) from None
        if window < 1:
            raise errors.error(Reason.INVALID_REQUEST, f"window must be at least 1 message, got {window}")
        if position is not None:
            position.check(cluster_id, topic_filter, n_shards)
        self.table = table
        self.cluster_id = cluster_id
        self.topic_filter = topic_filter
        self.start_time_us = start_time_us
        self.window = window
        self.any_replica = any_replica
        chosen = list(range(n_shards)) if shards is None else sorted(set(shards))
        self.parts = {s: ShardPart(s, position.shard_after(s) if position else 0) for s in chosen}
        self.restarts = 0
        self._last: ShardPart | None = None
        self._taken = 0

    @classmethod
    def of(
        cls,
        table: RoutingTable,
        view: ClusterView,
        topic_filter: str,
        position: FollowPosition | bytes | None,
        shards: Iterable[int] | None,
        **options: Any,
    ) -> FollowCore:
        """A subscription's core for ``Client.follow``'s arguments (a position may be its saved bytes)."""
        if isinstance(position, (bytes, bytearray, memoryview)):
            position = FollowPosition.from_bytes(bytes(position))
        chosen = None if shards is None else list(shards)
        return cls(table, view.cluster_id, view.n_shards, topic_filter, position=position, shards=chosen, **options)

    @property
    def position(self) -> FollowPosition:
        return FollowPosition.of(self.cluster_id, self.topic_filter, {s: p.after_us for s, p in self.parts.items()})

    def start(self, part: ShardPart) -> tuple[str, pb.FollowStart]:
        """Where to start ``part`` now, and the request (its id left for the transport to set)."""
        address = part.hint or self._address(part)
        part.hint = None
        part.retry_at = 0.0
        part.history.append(address)
        del part.history[:-8]
        request = pb.FollowStart(
            topic_filter=self.topic_filter,
            shard=part.shard,
            after_us=part.after_us,
            start_time_us=self.start_time_us,
            credit=self.window,
            stale_ok=self.any_replica,
            shared_answers=True,
        )
        return address, request

    def _address(self, part: ShardPart) -> str:
        if not self.any_replica:
            leader = self.table.leader_of(part.shard)
            if leader is not None and (part.attempt == 0 or leader not in part.history[-1:]):
                return leader
        return self.table.address_for(part.shard, any_replica=True, attempt=part.attempt)

    def answer(
        self, part: ShardPart, sub_id: int, answer: pb.FollowResponse | None, err: MqdsError | None
    ) -> FollowBatch | None:
        """What came for ``part``: a batch, or None (progress only, an answer of a subscription the part left,
        or the end of its subscription: then it starts again later, see ``lost``). Raises what cannot be retried.

        The node's side of an ended subscription is gone already (a failure answer ends it, and so does the
        end of its call), so there is nothing to cancel.
        """
        if part.sub_id != sub_id:
            return None
        if err is None and answer is not None and answer.HasField("failure"):
            err = errors.from_failure(answer.failure)
        if err is not None:
            self.lost(part, err)
            return None
        assert answer is not None
        part.after_us = max(part.after_us, answer.position_us)
        part.attempt = 0
        if not answer.messages:
            return None
        self._last, self._taken = part, len(answer.messages)
        return FollowBatch(part.shard, MessageBatch(answer.messages), self.position)

    def lost(self, part: ShardPart, err: MqdsError) -> None:
        """``part``'s subscription ended with ``err``: start again later (elsewhere), or raise ``err``."""
        part.sub_id = 0
        if not err.retriable:
            raise err
        if err.reason in (Reason.NOT_LEADER, Reason.NOT_HOSTED) and self.table.learn(err, part.shard):
            part.hint = err.metadata.get("leader_address") or None
        elif err.reason is not Reason.REPLICA_BEHIND:
            self.table.forget_leader(part.shard)
        part.attempt += 1
        self.restarts += 1
        delay = 0.0 if part.hint else min(_RETRY_MAX_S, 0.05 * 2 ** min(part.attempt, 6))
        part.retry_at = time.monotonic() + delay

    def wants_refresh(self, part: ShardPart) -> bool:
        """Whether to ask for a new cluster map before starting ``part`` again (every fourth attempt)."""
        return part.attempt > 0 and part.attempt % 4 == 0

    def due(self) -> list[ShardPart]:
        now = time.monotonic()
        return [p for p in self.parts.values() if p.retry_at and p.retry_at <= now]

    def wait_s(self, deadline: float | None) -> float | None:
        waits = [p.retry_at - time.monotonic() for p in self.parts.values() if p.retry_at]
        if deadline is not None:
            waits.append(deadline - time.monotonic())
        return max(0.0, min(waits)) if waits else None

    def taken(self) -> tuple[ShardPart, int] | None:
        """The credit the application freed by taking the last batch: (part, messages), or None."""
        part, taken = self._last, self._taken
        self._last, self._taken = None, 0
        if part is None or not taken or part.retry_at or not part.sub_id:
            return None
        return part, taken


class FollowState:
    """What a push subscription says of itself, read from its :class:`FollowCore` (``self.core``); no I/O.

    Shared by both clients' subscriptions (:class:`mqds.client.sync.follow.Subscription`,
    :class:`mqds.client.aio.follow.AsyncSubscription`), so they say the same.
    """

    core: FollowCore

    @property
    def cluster_id(self) -> str:
        """The id of the cluster followed: a saved position belongs to it."""
        return self.core.cluster_id

    @property
    def restarts(self) -> int:
        """Shard parts started again elsewhere after a failure (a node lost, a leader moved)."""
        return self.core.restarts

    @property
    def position(self) -> FollowPosition:
        """Where the subscription is: what to save, to follow on later from here."""
        return self.core.position
