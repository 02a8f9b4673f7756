"""``fetch_offline_many``: the offline messages of many sessions in shared calls; no I/O.

A broker whose persistent sessions reconnect together (a restart, a network
blip) fetches every session's backlog at once. One ``fetch_offline`` each
costs a read-position call to the session's shard and a ``FetchMessages``
call to every node, and each of those scans the shards for that session
alone. :class:`SharedFetch` plans the same work in shared calls, which both
clients run with their own I/O:

1. **Read positions** (pubsub sessions): one ``GetReadPositions`` call per
   node for all the pairs whose clientid shards it leads
   (``StartReadPositions`` for the pairs fetched with ``start="now"``), in
   chunks of at most ``MAX_SESSIONS_PER_CALL`` pairs, sorted by shard.
2. **Messages**: one ``FetchMessagesShared`` call per node for all the
   sessions (chunks of at most ``MAX_SESSIONS_PER_CALL``, sorted by topic
   filter so a filter's sessions share a call): the node scans each shard
   once per topic filter and sends a message several sessions need once.
3. **Continuation**: a session cut short by a node's answer bound
   (``more``) is asked again, in those shards only, after the last message
   it got in each and for what is left of its ``max_count``, until none is.

Each session then gets its messages merged oldest first ((timestamp, shard)
order) and cut to its ``max_count``: exactly what ``fetch_offline`` returns
for it. The ``Message`` objects of a message that several sessions get are
one object: do not modify them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from mqds.client.core.operations import FanoutCall, FetchOffline
from mqds.client.model import Message, ReadPosition
from mqds.protocol.limits import MAX_SESSIONS_PER_CALL
from mqds.protocol.sharding import shard_of
from mqds.v1 import sessions_pb2 as spb

__all__ = ["MAX_SESSIONS_PER_CALL", "OfflineFetch", "SharedFetch"]


@dataclass(frozen=True)
class OfflineFetch:
    """One session's request in ``fetch_offline_many``: the arguments ``fetch_offline`` takes, for one pair."""

    clientid: str
    topic_filter: str
    mode: str = "pubsub"
    max_count: int = 500
    time_range_s: float | None = None
    include_qos0: bool = False
    start: str = "earliest"

    def checked(self) -> FetchOffline:
        """The arguments checked as ``fetch_offline`` checks them (ValueError says what is wrong)."""
        return FetchOffline.check(
            self.clientid,
            self.topic_filter,
            self.mode,
            self.max_count,
            self.time_range_s,
            self.include_qos0,
            self.start,
        )


Pair = tuple[str, str]
T = TypeVar("T")


@dataclass
class _Session:
    """One request while it is fetched."""

    fetch: FetchOffline
    after_us: dict[int, int] = field(default_factory=dict)
    after_all_us: int = 0
    got: list[Message] = field(default_factory=list)
    received: dict[int, int] = field(default_factory=dict)
    """Per shard: messages got from it."""
    shards: set[int] | None = None
    """The shards still to read: None, all of them (the first round); else those a node's answer cut short."""


@dataclass(frozen=True)
class _Part:
    """One node's answer to a FetchMessagesShared request."""

    shards: tuple[int, ...]
    response: spb.FetchMessagesSharedResponse


def _position(entry: spb.PairReadPosition) -> ReadPosition:
    return ReadPosition(dict(entry.position.acked_us), entry.position.start_us, entry.found, entry.started)


def _chunks(items: Sequence[T], size: int = MAX_SESSIONS_PER_CALL) -> list[list[T]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


class SharedFetch:
    """One ``fetch_offline_many`` call: its checked requests, the calls to make in turn, and the results.

    ``requests`` are :class:`OfflineFetch` values, or ``(clientid, topic_filter)`` pairs that take
    ``defaults``' other fields. A bad argument is a ``ValueError`` here, before any call.
    """

    def __init__(self, requests: Iterable[OfflineFetch | Pair], defaults: OfflineFetch, n_shards: int) -> None:
        self.n_shards = n_shards
        self.sessions: list[_Session] = []
        for request in requests:
            if not isinstance(request, OfflineFetch):
                clientid, topic_filter = request
                request = dataclasses.replace(defaults, clientid=clientid, topic_filter=topic_filter)
            self.sessions.append(_Session(request.checked()))

    # -- 1. read positions ---------------------------------------------------------

    def position_calls(self) -> list[FanoutCall[tuple[Pair, ReadPosition]]]:
        """The calls that read (or start) the pubsub pairs' read positions, at most MAX_SESSIONS_PER_CALL each."""
        starting: dict[Pair, None] = {}
        reading: dict[Pair, None] = {}
        for session in self.sessions:
            fetch = session.fetch
            if fetch.pubsub:
                (starting if fetch.start_now else reading)[(fetch.clientid, fetch.topic_filter)] = None
        calls: list[FanoutCall[tuple[Pair, ReadPosition]]] = []
        for method, pairs in (
            ("StartReadPositions", starting),
            ("GetReadPositions", [p for p in reading if p not in starting]),
        ):
            homes = {pair: shard_of(pair[0], self.n_shards) for pair in pairs}
            ordered = sorted(homes, key=lambda pair: homes[pair])
            calls.extend(self._position_call(method, chunk, homes) for chunk in _chunks(ordered))
        return calls

    @staticmethod
    def _position_call(method: str, pairs: list[Pair], homes: dict[Pair, int]) -> FanoutCall[tuple[Pair, ReadPosition]]:
        def request(group: list[int]) -> spb.ReadPositionsRequest:
            wanted = set(group)
            return spb.ReadPositionsRequest(
                pairs=[
                    spb.ReadPositionPair(clientid=clientid, topic_filter=topic_filter)
                    for clientid, topic_filter in pairs
                    if homes[(clientid, topic_filter)] in wanted
                ]
            )

        def parse(response: spb.ReadPositionsResponse) -> list[tuple[Pair, ReadPosition]]:
            return [((p.clientid, p.topic_filter), _position(p)) for p in response.positions]

        return FanoutCall(
            method, sorted({homes[pair] for pair in pairs}), request, parse, lambda _: 0, service="Sessions"
        )

    def record_positions(self, found: Iterable[tuple[Pair, ReadPosition]]) -> None:
        """Take the positions read; every pubsub session reads after its own (a new pair's ``start="now"``)."""
        positions = dict(found)
        for session in self.sessions:
            fetch = session.fetch
            if not fetch.pubsub:
                continue
            position = positions.get((fetch.clientid, fetch.topic_filter))
            # A pair another request of this call started reads, with "earliest", as it would have before.
            if position is None or (position.started and not fetch.start_now):
                continue
            session.after_us = dict(position.acked_us)
            session.after_all_us = position.start_us

    # -- 2. and 3. messages ------------------------------------------------------------

    def fetch_rounds(self) -> list[FetchRound]:
        """The next round's FetchMessagesShared calls, one per chunk of sessions ([]: every session is done).

        Run each round's ``call`` (a fan-out over the nodes) and give its parts to ``record``, then ask again.
        """
        pending = [i for i, s in enumerate(self.sessions) if s.shards is None or s.shards]
        pending.sort(key=lambda i: self.sessions[i].fetch.topic_filter)
        rounds = [FetchRound(self, chunk) for chunk in _chunks(pending)]
        for i in pending:
            self.sessions[i].shards = set()  # until an answer says more
        return rounds

    def results(self) -> list[list[Message]]:
        """Each request's messages, in the order of the requests: oldest first, at most its ``max_count``."""
        out = []
        for session in self.sessions:
            got = sorted(session.got, key=_order)
            out.append(got[: session.fetch.max_count])
        return out


def _order(message: Message) -> tuple[int, int]:
    return (message.timestamp_us or 0, message.shard or 0)


class FetchRound:
    """One FetchMessagesShared fan-out over some sessions (``SharedFetch.fetch_rounds``) and what it got."""

    def __init__(self, plan: SharedFetch, chunk: list[int]) -> None:
        self.plan = plan
        self.chunk = chunk
        # The shards each session reads in this round (None: all), fixed for the round's requests and answers.
        self.reads: dict[int, frozenset[int] | None] = {}
        for i in chunk:
            wanted = plan.sessions[i].shards
            self.reads[i] = None if wanted is None else frozenset(wanted)
        shards: list[int] | None = None
        if any(reads is not None for reads in self.reads.values()):
            every = range(plan.n_shards)
            shards = sorted({shard for reads in self.reads.values() for shard in (every if reads is None else reads)})
        self.call: FanoutCall[_Part] = FanoutCall(
            "FetchMessagesShared",
            shards,
            self._request,
            lambda response: [_Part(tuple(response.shards), response)],
            lambda part: part.shards,
            service="Sessions",
        )

    def _members(self, group: Sequence[int]) -> list[tuple[int, list[int]]]:
        """The sessions a request for ``group`` carries, in order, each with the shards it reads there ([]: all)."""
        members: list[tuple[int, list[int]]] = []
        for i in self.chunk:
            reads = self.reads[i]
            if reads is None:
                members.append((i, []))
                continue
            mine = [shard for shard in group if shard in reads]
            if mine:
                members.append((i, [] if len(mine) == len(group) else mine))
        return members

    def _request(self, group: list[int]) -> spb.FetchMessagesSharedRequest:
        out = spb.FetchMessagesSharedRequest(shards=group)
        for i, mine in self._members(group):
            session = self.plan.sessions[i]
            fetch = session.fetch
            read = mine or group
            out.sessions.add(
                topic_filter=fetch.topic_filter,
                after_us={shard: session.after_us[shard] for shard in read if shard in session.after_us},
                after_all_us=session.after_all_us,
                time_range_us=fetch.time_range_us,
                # What is left of it in these shards: what the session got from them is a prefix of its order.
                max_count=max(1, fetch.max_count - sum(session.received.get(shard, 0) for shard in read)),
                include_qos0=fetch.include_qos0,
                skip_acked=not fetch.pubsub,
                shards=mine,
            )
        return out

    def record(self, parts: Iterable[_Part]) -> None:
        """Take the nodes' answers: each session's messages, and where one was cut short, what to read next."""
        sessions = self.plan.sessions
        from_pb = Message.from_pb
        for part in parts:
            response = part.response
            messages = [from_pb(m) for m in response.messages]
            members = self._members(list(part.shards))
            for (i, mine), result in zip(members, response.sessions, strict=True):
                session = sessions[i]
                for index in result.indexes:
                    message = messages[index]
                    shard = message.shard or 0
                    session.got.append(message)
                    session.received[shard] = session.received.get(shard, 0) + 1
                    if message.timestamp_us and message.timestamp_us > session.after_us.get(shard, 0):
                        session.after_us[shard] = message.timestamp_us
                if result.more:
                    assert session.shards is not None
                    session.shards.update(mine or part.shards)
