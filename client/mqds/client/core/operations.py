"""What each client call sends and how its answer becomes model objects; no I/O.

The synchronous client and the asyncio one (:mod:`mqds.client.aio`) build
their requests and read their responses here, so both mean the same thing
by every method; each only runs the requests (with the routing rules of
:mod:`mqds.client.sync.routing`) in its own way.

A :class:`ShardCall` goes to one shard's leader (or any replica with
``stale_ok``); a :class:`FanoutCall` goes once to each node leading some of
its shards, and the parts are merged. :class:`StoreBatch` is one
``store_batch``: the batch split by shard, each leader's request, and the
result or the (partial) failure.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from mqds.client.batch import NextResult
from mqds.client.core.fanout import ShardFailures
from mqds.client.core.pipeline_calls import check_messages
from mqds.client.model import (
    ClientState,
    Delivered,
    Fence,
    Generation,
    Iterator,
    Message,
    Rank,
    ReadPosition,
    Stream,
)
from mqds.protocol import errors
from mqds.protocol.delivery import Policy
from mqds.protocol.errors import MqdsError, PartialBatchError, Reason
from mqds.protocol.limits import SESSION_NEVER_EXPIRES
from mqds.protocol.sharding import shard_of
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

T = TypeVar("T")


@dataclass(frozen=True)
class ShardCall(Generic[T]):
    """A request to one shard's leader (any replica with ``stale_ok``) and how to read its answer."""

    method: str
    shard: int
    request: Any
    parse: Callable[[Any], T]
    stale_ok: bool = False
    service: str = "Storage"
    """The gRPC service of ``method``: "Storage" or "Sessions"."""


@dataclass(frozen=True)
class FanoutCall(Generic[T]):
    """A request about several shards, sent once per node leading some of them; the parts merged in order."""

    method: str
    shards: Sequence[int] | None
    """The shards to ask; None = every shard of the cluster."""
    request: Callable[[list[int]], Any]
    parse: Callable[[Any], list[T]]
    sort_key: Callable[[T], Any]
    stale_ok: bool = False
    service: str = "Storage"

    def shards_of(self, n_shards: int) -> list[int]:
        return list(range(n_shards)) if self.shards is None else list(self.shards)

    def merge(self, parts: Iterable[list[T]]) -> list[T]:
        return sorted(itertools.chain.from_iterable(parts), key=self.sort_key)


def _ranked(response: pb.GetStreamsResponse) -> list[tuple[Rank, Stream]]:
    return [(Rank(s.rank.shard, s.rank.generation), Stream.from_pb(s.stream)) for s in response.streams]


def get_streams(
    topic_filter: str, start_time_us: int, stale_ok: bool, shards: Sequence[int] | None = None
) -> FanoutCall[tuple[Rank, Stream]]:
    return FanoutCall(
        "GetStreams",
        shards,
        lambda shards: pb.GetStreamsRequest(
            topic_filter=topic_filter, start_time_us=start_time_us, shards=shards, stale_ok=stale_ok
        ),
        _ranked,
        lambda item: (item[0], item[1].id),
        stale_ok,
    )


def make_iterator(stream: Stream, topic_filter: str, start_time_us: int, stale_ok: bool) -> ShardCall[Iterator]:
    request = pb.MakeIteratorRequest(
        stream=stream.to_pb(), topic_filter=topic_filter, start_time_us=start_time_us, stale_ok=stale_ok
    )
    return ShardCall("MakeIterator", stream.shard, request, lambda r: Iterator.from_pb(r.iterator), stale_ok)


def _answered(result: NextResult) -> NextResult:
    """``Next``'s parse: the stubs' deserializer already made the result (``mqds.client.core.next_answer``)."""
    return result


def next_batch(
    iterator: Iterator, batch_size: int, stale_ok: bool, fence_us: int | None = None
) -> ShardCall[NextResult]:
    request = pb.NextRequest(
        iterator=iterator.to_pb(), batch_size=batch_size, stale_ok=stale_ok, fence_us=fence_us or 0
    )
    return ShardCall("Next", iterator.shard, request, _answered, stale_ok)


def first_batch(
    stream: Stream,
    topic_filter: str,
    start_time_us: int,
    batch_size: int,
    stale_ok: bool,
    fence_us: int | None = None,
    then: Sequence[Stream] = (),
) -> ShardCall[NextResult]:
    """``make_iterator`` and the first ``next_batch`` in one call (``NextRequest.start``), and on into ``then``."""

    def start(where: Stream) -> pb.IteratorStart:
        return pb.IteratorStart(stream=where.to_pb(), topic_filter=topic_filter, start_time_us=start_time_us)

    request = pb.NextRequest(
        start=start(stream),
        then=[start(where) for where in then],
        batch_size=batch_size,
        stale_ok=stale_ok,
        fence_us=fence_us or 0,
    )
    return ShardCall("Next", stream.shard, request, _answered, stale_ok)


def get_fences(shards: Sequence[int] | None, stale_ok: bool) -> FanoutCall[Fence]:
    return FanoutCall(
        "GetFences",
        shards,
        lambda group: pb.GetFencesRequest(shards=group, stale_ok=stale_ok),
        lambda response: [Fence.from_pb(f) for f in response.fences],
        lambda f: f.shard,
        stale_ok,
    )


def _generations(response: Any) -> list[Generation]:
    return [Generation.from_pb(g) for g in response.generations]


def add_generation(shard: int | None) -> FanoutCall[Generation]:
    return FanoutCall(
        "AddGeneration",
        None if shard is None else [shard],
        lambda shards: pb.AddGenerationRequest(shards=shards),
        _generations,
        lambda g: g.shard,
    )


def list_generations(shard: int | None, stale_ok: bool) -> FanoutCall[Generation]:
    return FanoutCall(
        "ListGenerations",
        None if shard is None else [shard],
        lambda shards: pb.ListGenerationsRequest(shards=shards, stale_ok=stale_ok),
        _generations,
        lambda g: (g.shard, g.generation),
        stale_ok,
    )


def drop_generation(shard: int, generation: int) -> ShardCall[Generation]:
    request = pb.DropGenerationRequest(shard=shard, generation=generation)
    return ShardCall("DropGeneration", shard, request, lambda r: Generation.from_pb(r.dropped))


def replay_order(found: Iterable[tuple[Rank, Stream]]) -> list[list[Stream]]:
    """The streams to replay, grouped by rank in rank order (a group's streams are merged by timestamp)."""
    by_rank: dict[Rank, list[Stream]] = {}
    for rank, stream in found:
        by_rank.setdefault(rank, []).append(stream)
    return [by_rank[rank] for rank in sorted(by_rank)]


def stream_exhausted(result: NextResult) -> bool:
    """Whether a replay stops reading a stream after this batch (closed and read, or nothing more yet)."""
    return result.end_of_stream or not result.messages


def timestamp(message: Message) -> int:
    return message.timestamp_us or 0


def check_sequence(sequence: int) -> int:
    if sequence < 1:
        raise ValueError(f"sequence must be 1 or more, got {sequence}")
    return sequence


class StoreBatch:
    """One ``store_batch`` call: the batch split by shard, each leader's request, and the outcome.

    ``request(shards)`` builds the request for the shards one node leads
    (every request of the call, retries included, carries the same producer
    id and sequence, so a shard stores its part once); ``record`` takes its
    answer (raising :class:`ShardFailures` for the shards it says failed);
    ``outcome`` turns what was recorded and the shards' final errors into
    the stored messages, or the error to raise. A message no node stores
    (:func:`~mqds.client.core.pipeline_calls.check_messages`) is not sent, and
    one a node refused fails alone: the others are stored.
    """

    def __init__(self, messages: Iterable[Message], n_shards: int, producer_id: str, sequence: int, sync: bool) -> None:
        self.batch = list(messages)
        self.n_shards = n_shards
        self.producer_id = producer_id
        self.sequence = check_sequence(sequence)
        self.sync = sync
        self.refused = check_messages(self.batch)
        """The messages that failed alone (index -> error): before sending, or refused by their node."""
        self.by_shard: dict[int, list[int]] = {}
        for index, message in enumerate(self.batch):
            if index not in self.refused:
                self.by_shard.setdefault(shard_of(message.sender, n_shards), []).append(index)
        self._encoded = [m.to_pb() for m in self.batch]
        self.positions: dict[int, tuple[int, int]] = {}

    @property
    def shards(self) -> list[int]:
        return sorted(self.by_shard)

    def request(self, shards: Sequence[int]) -> tuple[list[int], pb.StoreBatchRequest]:
        """The request for ``shards``' messages, and the batch indexes of its messages in order."""
        indexes = [i for shard in shards for i in self.by_shard[shard]]
        request = pb.StoreBatchRequest(
            messages=[self._encoded[i] for i in indexes],
            sync=self.sync,
            producer_id=self.producer_id,
            sequence=self.sequence,
        )
        return indexes, request

    def record(self, indexes: Sequence[int], response: pb.StoreBatchResponse) -> None:
        for index, position in zip(indexes, response.positions, strict=True):
            if position.timestamp_us:
                self.positions[index] = (position.timestamp_us, position.shard)
        for refused in response.message_failures:
            if refused.index < len(indexes):
                index = indexes[refused.index]
                self.positions.pop(index, None)
                self.refused[index] = errors.from_message_failure(refused, f"message {index}")
        if response.failures:
            raise ShardFailures({f.shard: errors.from_failure(f) for f in response.failures})

    def outcome(self, failures: dict[int, MqdsError]) -> list[Message]:
        """The stored messages (timestamp and shard set); raises when some or all were not stored."""
        stored: list[Message] = []
        failed: list[tuple[Message, MqdsError]] = []
        for index, m in enumerate(self.batch):
            if index in self.positions:
                ts, shard = self.positions[index]
                stored.append(m.at(ts, shard))
            else:
                shard = shard_of(m.sender, self.n_shards)
                err = self.refused[index] if index in self.refused else failures[shard]
                failed.append((m.at(None, shard), err))
        if not failed:
            return stored
        if not stored:
            err = failed[0][1]
            err.metadata["sequence"] = str(self.sequence)
            raise err
        raise PartialBatchError(stored, failed, self.sequence)


# -- broker state (the Sessions service) -----------------------------------------

MODES = {"pubsub": spb.PUBSUB, "queue": spb.QUEUE}
ACK_MODES = {**MODES, "delivery": spb.DELIVERY, "nack": spb.NACK, "release": spb.RELEASE}
"""An acknowledgement's modes: a fetch's, ``delivery`` (ends a delivery of ``Client.deliver``), ``nack``
(gives one back: due again at once) and ``release`` (gives back one that was never sent: not counted)."""


def _mode(mode: str, modes: dict[str, spb.DeliveryMode] = MODES) -> spb.DeliveryMode:
    try:
        return modes[mode]
    except KeyError:
        raise ValueError(f"mode must be {' or '.join(map(repr, modes))}, got {mode!r}") from None


def _client_state(response: spb.ClientStateResponse) -> ClientState | None:
    return ClientState.from_pb(response.state) if response.found else None


def _session_call(
    method: str, key: str, n_shards: int, request: Any, parse: Callable[[Any], T], stale_ok: bool = False
) -> ShardCall[T]:
    """A Sessions request kept in ``key``'s shard (a clientid's, or a retained topic's)."""
    return ShardCall(method, shard_of(key, n_shards), request, parse, stale_ok, "Sessions")


def check_session_expiry(session_expiry_s: int | None) -> None:
    """Refuse a Session Expiry Interval MQTT cannot carry (a four-byte integer of seconds)."""
    if session_expiry_s is None:
        return
    if isinstance(session_expiry_s, bool) or not isinstance(session_expiry_s, int):
        raise errors.error(
            Reason.INVALID_REQUEST, f"session_expiry_s must be a whole number of seconds, not {session_expiry_s!r}"
        )
    if not 0 <= session_expiry_s <= SESSION_NEVER_EXPIRES:
        raise errors.error(
            Reason.INVALID_REQUEST,
            f"session_expiry_s {session_expiry_s} is out of range: 0 (ends at the disconnect) to "
            f"{SESSION_NEVER_EXPIRES} (never), as MQTT 5 has it",
        )


def client_connected(
    clientid: str, node: str, n_shards: int, session_expiry_s: int | None = None
) -> ShardCall[ClientState | None]:
    check_session_expiry(session_expiry_s)
    request = spb.ClientConnectedRequest(clientid=clientid, node=node, session_expiry_s=session_expiry_s)
    return _session_call("ClientConnected", clientid, n_shards, request, _client_state)


def client_disconnected(
    clientid: str, node: str | None, n_shards: int, session_expiry_s: int | None = None
) -> ShardCall[ClientState | None]:
    check_session_expiry(session_expiry_s)
    request = spb.ClientDisconnectedRequest(clientid=clientid, node=node or "", session_expiry_s=session_expiry_s)
    return _session_call("ClientDisconnected", clientid, n_shards, request, _client_state)


def client_state(clientid: str, n_shards: int, stale_ok: bool) -> ShardCall[ClientState | None]:
    request = spb.GetClientStateRequest(clientid=clientid, stale_ok=stale_ok)
    return _session_call("GetClientState", clientid, n_shards, request, _client_state, stale_ok)


def clients_on_node(node: str, stale_ok: bool) -> FanoutCall[str]:
    return FanoutCall(
        "ClientsOnNode",
        None,
        lambda shards: spb.ClientsOnNodeRequest(node=node, shards=shards, stale_ok=stale_ok),
        lambda response: list(response.clientids),
        lambda clientid: clientid,
        stale_ok,
        "Sessions",
    )


def check_qos(qos: int) -> int:
    if qos not in (0, 1, 2):
        raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
    return qos


def subscribe(clientid: str, topic_filter: str, qos: int, n_shards: int) -> ShardCall[None]:
    request = spb.SubscribeRequest(clientid=clientid, topic_filter=topic_filter, qos=check_qos(qos))
    return _session_call("Subscribe", clientid, n_shards, request, lambda _: None)


def unsubscribe(clientid: str, topic_filter: str, n_shards: int) -> ShardCall[bool]:
    request = spb.UnsubscribeRequest(clientid=clientid, topic_filter=topic_filter)
    return _session_call("Unsubscribe", clientid, n_shards, request, lambda r: bool(r.existed))


def subscriptions(clientid: str, n_shards: int, stale_ok: bool) -> ShardCall[dict[str, int]]:
    request = spb.GetSubscriptionsRequest(clientid=clientid, stale_ok=stale_ok)
    return _session_call(
        "GetSubscriptions",
        clientid,
        n_shards,
        request,
        lambda r: {s.topic_filter: s.qos for s in r.subscriptions},
        stale_ok,
    )


def retain(message: Message, n_shards: int) -> ShardCall[Message | None]:
    request = spb.RetainRequest(message=message.to_pb())
    request.message.retain = True
    return _session_call(
        "Retain",
        message.topic,
        n_shards,
        request,
        lambda r: Message.from_pb(r.message) if r.HasField("message") else None,
    )


def _messages(response: Any) -> list[Message]:
    from_pb = Message.from_pb
    return [from_pb(m) for m in response.messages]


def retained(topic_filter: str, stale_ok: bool) -> FanoutCall[Message]:
    return FanoutCall(
        "GetRetained",
        None,
        lambda shards: spb.GetRetainedRequest(topic_filter=topic_filter, shards=shards, stale_ok=stale_ok),
        _messages,
        lambda m: m.topic,
        stale_ok,
        "Sessions",
    )


def _position(found: bool, position: spb.ReadPosition, started: bool = False) -> ReadPosition:
    return ReadPosition(dict(position.acked_us), position.start_us, found, started)


def read_position(clientid: str, topic_filter: str, n_shards: int) -> ShardCall[ReadPosition]:
    """The (clientid, filter) read position."""
    request = spb.GetReadPositionRequest(clientid=clientid, topic_filter=topic_filter)
    return _session_call("GetReadPosition", clientid, n_shards, request, lambda r: _position(r.found, r.position))


def start_read_position(clientid: str, topic_filter: str, n_shards: int) -> ShardCall[ReadPosition]:
    """Start the (clientid, filter) read position at the leader's clock unless it has one; the pair's position."""
    request = spb.StartReadPositionRequest(clientid=clientid, topic_filter=topic_filter)
    return _session_call(
        "StartReadPosition", clientid, n_shards, request, lambda r: _position(True, r.position, r.started)
    )


def forget_session(clientid: str, n_shards: int) -> ShardCall[tuple[int, int]]:
    """Delete the client's subscriptions and read positions: how many of each there were."""
    if not clientid:
        raise ValueError("clientid is empty")
    request = spb.ForgetSessionRequest(clientid=clientid)
    return _session_call(
        "ForgetSession", clientid, n_shards, request, lambda r: (int(r.subscriptions), int(r.read_positions))
    )


@dataclass(frozen=True)
class FetchOffline:
    """One ``fetch_offline`` call: its checked arguments and the per-shard request."""

    clientid: str
    topic_filter: str
    mode: spb.DeliveryMode
    max_count: int
    time_range_us: int
    include_qos0: bool
    start_now: bool = False
    """A pubsub pair without a read position gets one, started now (``start="now"``)."""

    @classmethod
    def check(
        cls,
        clientid: str,
        topic_filter: str,
        mode: str,
        max_count: int,
        time_range_s: float | None,
        include_qos0: bool,
        start: str = "earliest",
    ) -> FetchOffline:
        if start not in ("earliest", "now"):
            raise ValueError(f"start must be 'earliest' or 'now', got {start!r}")
        if not isinstance(max_count, int) or max_count < 1:
            raise ValueError(f"max_count must be 1 or more, got {max_count!r}")
        if time_range_s is not None and not time_range_s > 0:
            raise ValueError(f"time_range_s must be more than 0 (or None for no limit), got {time_range_s!r}")
        if not clientid:
            raise ValueError("clientid is empty")
        range_us = 0 if time_range_s is None else max(1, int(time_range_s * 1_000_000))
        return cls(clientid, topic_filter, _mode(mode), max_count, range_us, include_qos0, start == "now")

    @property
    def pubsub(self) -> bool:
        return self.mode == spb.PUBSUB

    def messages(
        self, position: ReadPosition | None = None, shards: Iterable[int] | None = None
    ) -> FanoutCall[Message]:
        """The call that reads matching messages after ``position`` (None: from the first) from ``shards``
        (None: every shard; each named once, in order, however often and in whatever order they are given)."""
        after_us = position.acked_us if position is not None else {}
        return FanoutCall(
            "FetchMessages",
            None if shards is None else sorted(set(shards)),
            lambda shards: spb.FetchMessagesRequest(
                topic_filter=self.topic_filter,
                shards=shards,
                after_us={shard: after_us[shard] for shard in shards if shard in after_us},
                after_all_us=position.start_us if position is not None else 0,
                time_range_us=self.time_range_us,
                max_count=self.max_count,
                include_qos0=self.include_qos0,
                skip_acked=not self.pubsub,
            ),
            _messages,
            lambda m: (m.timestamp_us, m.shard),
            service="Sessions",
        )

    def cut(self, merged: list[Message]) -> list[Message]:
        return merged[: self.max_count]


def ack(clientid: str, topic_filter: str, message: Message, mode: str, n_shards: int) -> ShardCall[None]:
    """Pubsub: logged in the clientid's shard (its read position); queue and delivery: in the message's shard."""
    if message.shard is None or not message.timestamp_us:
        raise ValueError(
            "ack needs the message's position (shard and timestamp_us): pass a message as fetch_offline "
            "or store_batch returned it"
        )
    code = _mode(mode, ACK_MODES)
    request = spb.AckRequest(
        clientid=clientid, topic_filter=topic_filter, mode=code, shard=message.shard, timestamp_us=message.timestamp_us
    )
    shard = shard_of(clientid, n_shards) if code == spb.PUBSUB else message.shard
    return ShardCall("Ack", shard, request, lambda _: None, service="Sessions")


def deliver(
    clientid: str,
    topic_filter: str,
    policy: Policy,
    max_count: int,
    queue: bool,
    include_qos0: bool,
    start_after_us: int,
    shards: Iterable[int] | None,
) -> FanoutCall[Delivered]:
    """The consumer's due redeliveries and new messages, from each node leading some of ``shards``."""
    if max_count < 1:
        raise ValueError(f"max_count must be at least 1, got {max_count}")
    wire_policy = spb.DeliveryPolicy(
        ack_wait_ms=policy.ack_wait_ms,
        max_deliveries=policy.max_deliveries,
        backoff_ms=policy.backoff_ms,
        max_unacked=policy.max_unacked,
        dead_letter_topic=policy.dead_letter_topic,
    )
    return FanoutCall(
        "Deliver",
        None if shards is None else sorted(set(shards)),
        lambda shards: spb.DeliverRequest(
            clientid=clientid,
            topic_filter=topic_filter,
            shards=shards,
            policy=wire_policy,
            max_count=max_count,
            queue=queue,
            include_qos0=include_qos0,
            start_after_us=start_after_us,
        ),
        lambda r: [Delivered.from_pb(r)],
        lambda d: 0,
        service="Sessions",
    )


def forget_acks(clientid: str, topic_filter: str, n_shards: int) -> ShardCall[bool]:
    request = spb.ForgetReadPositionRequest(clientid=clientid, topic_filter=topic_filter)
    return _session_call("ForgetReadPosition", clientid, n_shards, request, lambda r: bool(r.existed))
