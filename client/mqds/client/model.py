"""The values the client API takes and returns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

Properties = tuple[tuple[str, str], ...]


def _properties(value: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Properties:
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    return tuple((str(k), str(v)) for k, v in items)


@dataclass(slots=True)
class Message:
    """An MQTT message.

    ``properties`` are MQTT 5 user properties; pass a dict or a sequence of
    ``(name, value)`` pairs (names may repeat, order is kept); they are kept
    as a tuple of pairs. ``timestamp_us`` and ``shard`` are set on messages
    the client returns, and ignored when storing. ``message_expiry_s`` is
    MQTT 5's Message Expiry Interval (0: none): a retained message with one
    is returned until that long after it was retained, then removed; a stored
    one is returned by offline fetches and push subscriptions until that long
    after it was stored, carrying what is left of it (whole seconds, rounded
    up), which is what a broker forwards; replay returns it as stored
    (``docs/client.md``, "Message expiry"). (A plain, not frozen,
    dataclass: replay builds one per message and frozen ones cost 4x more.)
    """

    topic: str
    payload: bytes = b""
    sender: str = ""
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default=())
    timestamp_us: int | None = None
    shard: int | None = None
    message_expiry_s: int = 0

    def __post_init__(self) -> None:
        if type(self.payload) is not bytes:
            if not isinstance(self.payload, (bytes, bytearray, memoryview)):
                raise TypeError(f"payload must be bytes, not {type(self.payload).__name__}; encode text first")
            self.payload = bytes(self.payload)
        if type(self.properties) is not tuple:
            self.properties = _properties(self.properties)

    def at(self, timestamp_us: int | None, shard: int | None) -> Message:
        """This message with its position (``timestamp_us``, ``shard``) set and every other field as it is."""
        return Message(
            self.topic,
            self.payload,
            self.sender,
            self.qos,
            self.retain,
            self.properties,
            timestamp_us,
            shard,
            self.message_expiry_s,
        )

    def to_pb(self) -> pb.Message:
        return pb.Message(
            topic=self.topic,
            payload=self.payload,
            sender=self.sender,
            qos=self.qos,
            retain=self.retain,
            properties=[pb.UserProperty(key=k, value=v) for k, v in self.properties],
            message_expiry_s=self.message_expiry_s,
        )

    @classmethod
    def from_pb(cls, m: pb.Message) -> Message:
        props = m.properties
        return cls(
            m.topic,
            m.payload,
            m.sender,
            m.qos,
            m.retain,
            tuple((p.key, p.value) for p in props) if props else (),
            m.timestamp_us,
            m.shard,
            m.message_expiry_s,
        )


class Rank(NamedTuple):
    """The rank of a stream: replay different shards in parallel, generations of one shard in order."""

    shard: int
    generation: int


@dataclass(frozen=True)
class Stream:
    """A stream of one generation of one shard; ``pattern`` is its topic structure."""

    shard: int
    generation: int
    id: int
    pattern: str

    def to_pb(self) -> pb.Stream:
        return pb.Stream(shard=self.shard, generation=self.generation, id=self.id, pattern=self.pattern)

    @classmethod
    def from_pb(cls, s: pb.Stream) -> Stream:
        return cls(s.shard, s.generation, s.id, s.pattern)

    @property
    def rank(self) -> Rank:
        return Rank(self.shard, self.generation)


@dataclass(frozen=True)
class Iterator:
    """A serialisable position in a stream: save ``to_bytes()``, resume with ``Iterator.from_bytes``."""

    shard: int
    generation: int
    state: bytes

    def to_bytes(self) -> bytes:
        return self.to_pb().SerializeToString()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Iterator:
        token = pb.IteratorToken.FromString(raw)
        return cls(token.shard, token.generation, token.state)

    def to_pb(self) -> pb.IteratorToken:
        return pb.IteratorToken(shard=self.shard, generation=self.generation, state=self.state)

    @classmethod
    def from_pb(cls, token: pb.IteratorToken) -> Iterator:
        return cls(token.shard, token.generation, token.state)


@dataclass(frozen=True)
class Generation:
    """A generation of a shard; ``until_us`` is None for the current one."""

    shard: int
    generation: int
    since_us: int
    until_us: int | None
    created_at_us: int

    @property
    def current(self) -> bool:
        return self.until_us is None

    @classmethod
    def from_pb(cls, g: pb.Generation) -> Generation:
        return cls(g.shard, g.generation, g.since_us, None if g.current else g.until_us, g.created_at_us)


@dataclass(frozen=True)
class Fence:
    """Where a shard stands: the last timestamp it assigned, its applied index and its generations.

    Reading a shard up to ``timestamp_us`` (``Client.next(..., fence_us=...)``)
    returns the same messages from any replica, at any later time (until
    retention drops a generation): a consistent snapshot of the shard.
    """

    shard: int
    timestamp_us: int
    applied_index: int
    generations: tuple[Generation, ...]
    estimated_keys: tuple[int, ...] = ()
    """Per generation, RocksDB's estimate of its keys (messages and index entries): a size hint."""

    @classmethod
    def from_pb(cls, f: pb.Fence) -> Fence:
        generations = tuple(Generation.from_pb(g) for g in f.generations)
        return cls(f.shard, f.timestamp_us, f.applied_index, generations, tuple(f.estimated_keys))


@dataclass(frozen=True)
class ClientState:
    """What mqds knows of a client's connection: online or not, on which broker node, since when.

    Times are microseconds since the Unix epoch; 0 means never (``offline_at_us``
    is 0 while the client has not disconnected since it last connected).
    ``session_expiry_s`` is the session's expiry interval (0: it ends at the
    disconnect, :data:`SESSION_NEVER_EXPIRES`: never); ``expires_at_us``,
    while the client is offline and its session expires, says when its
    state, subscriptions and read positions are removed (0 otherwise).
    """

    clientid: str
    online: bool
    node: str
    online_at_us: int
    offline_at_us: int
    session_expiry_s: int = 0
    expires_at_us: int = 0

    @classmethod
    def from_pb(cls, s: spb.ClientState) -> ClientState:
        return cls(s.clientid, s.online, s.node, s.online_at_us, s.offline_at_us, s.session_expiry_s, s.expires_at_us)


@dataclass(frozen=True)
class ReadPosition:
    """How far a (clientid, topic filter) pair has read, for offline delivery in pubsub mode.

    ``acked_us``: per shard, the timestamp of the last acknowledged message;
    ``start_us``: only messages stored after it are the pair's to read, in
    every shard (the subscription began then; 0: the whole stored history);
    ``found``: mqds has a position for the pair (False: it reads from the first message);
    ``started``: ``start_read_position`` started it with this call (the pair had none).
    """

    acked_us: dict[int, int]
    start_us: int = 0
    found: bool = False
    started: bool = False


@dataclass(frozen=True)
class Delivered:
    """What ``Client.deliver`` gave a consumer: its messages, each with its delivery count, oldest first per shard.

    ``messages[i]`` has been delivered ``deliveries[i]`` times (1 the first
    time, more for a redelivery); acknowledge each with ``ack(..., mode="delivery")``
    (or ``"queue"`` for a queue reader). ``dead_lettered``: messages the call
    ended after their last delivery (stored on the policy's dead-letter
    topic when it has one); ``unacked``: the consumer's messages delivered and
    not acknowledged in the shards asked, after the call.
    """

    messages: list[Message]
    deliveries: list[int]
    dead_lettered: int = 0
    unacked: int = 0

    @classmethod
    def from_pb(cls, r: spb.DeliverResponse) -> Delivered:
        return cls([Message.from_pb(m) for m in r.messages], list(r.deliveries), r.dead_lettered, r.unacked)

    @classmethod
    def merged(cls, parts: list[Delivered]) -> Delivered:
        """The answers of several nodes as one, messages ordered by (timestamp, shard)."""
        pairs = sorted(
            ((m, n) for part in parts for m, n in zip(part.messages, part.deliveries, strict=True)),
            key=lambda pair: (pair[0].timestamp_us or 0, pair[0].shard or 0),
        )
        return cls(
            [m for m, _ in pairs],
            [n for _, n in pairs],
            sum(p.dead_lettered for p in parts),
            sum(p.unacked for p in parts),
        )
