"""Inspecting consumers, without I/O: the requests of ``Client.consumers`` and how their answers add up.

A listing (``Sessions.ListConsumers``) goes to each shard's leader for the
shards it leads, page by page: :class:`ConsumerPages` keeps, per shard,
where its next page starts, and each round asks the leaders of the shards
that have more (a leader change regroups them, as any fan-out call). Push
subscriptions are each node's own and are asked of each node.

A read position's lag is in every shard (a filter's messages are in all of
them) while the position lives in its clientid's shard: :class:`LagPlan`
sends the positions listed to every shard's leader (``ConsumerLag``, up to
1,000 a call) and adds each consumer's shards up: the messages behind (a sum that
says "at least" when a shard's count stopped at its cap) and the time behind
(the age of the oldest unread message of any shard).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mqds.client.core.operations import FanoutCall
from mqds.client.model import ClientState, ReadPosition
from mqds.protocol.limits import MAX_SESSIONS_PER_CALL
from mqds.v1 import sessions_pb2 as spb

KINDS = {
    "sessions": spb.SESSIONS,
    "read_positions": spb.READ_POSITIONS,
    "share_groups": spb.SHARE_GROUPS,
    "push_subscriptions": spb.PUSH_SUBSCRIPTIONS,
}
"""The kinds of consumer ``Client.consumers`` lists, by the names it takes."""
PAGE = 500
"""Entries a ListConsumers call asks for."""
LAG_FIGURES_PER_CALL = 400_000
"""(item, shard) figures one ConsumerLag answer may hold (about 10 MiB: under a node's default 16 MiB answers)."""


@dataclass(frozen=True)
class Lag:
    """How far a consumer is behind its filter's head, over the shards measured.

    ``messages``: the matching messages after its position (the QoS 1 and 2
    ones for a read position or share group, as offline delivery reads;
    every one for a push subscription); ``at_least``: the count stopped at
    its cap somewhere, there are more; ``seconds``: how long the oldest of
    them has waited (0 when there is none).
    """

    messages: int = 0
    at_least: bool = False
    seconds: float = 0.0

    @classmethod
    def of(cls, shards: Iterable[spb.ShardLag]) -> Lag:
        messages, at_least, seconds = 0, False, 0.0
        for shard in shards:
            messages += shard.messages
            at_least = at_least or shard.at_least
            if shard.oldest_us:
                seconds = max(seconds, max(0, shard.now_us - shard.oldest_us) / 1e6)
        return cls(messages, at_least, seconds)

    def text(self) -> str:
        """``"12"``, ``"at least 10,000"``."""
        return f"at least {self.messages:,}" if self.at_least else f"{self.messages:,}"


@dataclass(frozen=True)
class SessionInfo:
    """A client session: its state (None: mqds has its subscriptions but it never connected) and subscriptions."""

    clientid: str
    state: ClientState | None
    subscriptions: dict[str, int]
    """Topic filter -> QoS, the filters sorted."""


@dataclass(frozen=True)
class PositionInfo:
    """A read position of a (clientid, topic filter) pair and its lag."""

    clientid: str
    topic_filter: str
    position: ReadPosition
    lag: Lag = field(default_factory=Lag)


@dataclass(frozen=True)
class ShareGroupInfo:
    """A share group: its live members, the read position they share (``position_clientid``'s) and its lag."""

    group: str
    topic_filter: str
    members: list[str]
    position_clientid: str
    position: ReadPosition
    lag: Lag = field(default_factory=Lag)


@dataclass(frozen=True)
class PushInfo:
    """Push subscriptions of one Follow call at one position of one filter and shard, on ``node``."""

    node: str
    call: int
    peer: str
    shard: int
    topic_filter: str
    position_us: int
    subscriptions: int
    first_id: int
    lag: Lag = field(default_factory=Lag)


@dataclass
class Consumers:
    """What ``Client.consumers`` found, each list sorted (None: that kind was not asked for);
    ``unreachable``: nodes whose push subscriptions are missing (they did not answer)."""

    sessions: list[SessionInfo] | None = None
    read_positions: list[PositionInfo] | None = None
    share_groups: list[ShareGroupInfo] | None = None
    push_subscriptions: list[PushInfo] | None = None
    unreachable: list[str] = field(default_factory=list)


def check_kinds(kinds: Iterable[str] | None) -> list[str]:
    chosen = list(KINDS) if kinds is None else list(dict.fromkeys(kinds))
    unknown = [kind for kind in chosen if kind not in KINDS]
    if unknown:
        raise ValueError(f"unknown consumer kind {unknown[0]!r}; the kinds are {', '.join(KINDS)}")
    return chosen


def _position(position: spb.ReadPosition, found: bool = True) -> ReadPosition:
    return ReadPosition(dict(position.acked_us), position.start_us, found)


def _state(entry: spb.ConsumerSession) -> ClientState | None:
    if not entry.has_state:
        return None
    state = spb.ClientState()
    state.CopyFrom(entry.state)
    state.clientid = entry.clientid
    return ClientState.from_pb(state)


class ConsumerPages:
    """One kind's listing over the shards, page by page (see the module)."""

    def __init__(
        self, kind: str, clientid: str = "", clientid_prefix: str = "", group: str = "", stale_ok: bool = False
    ) -> None:
        self.kind = KINDS[kind]
        self.template = spb.ListConsumersRequest(
            kind=self.kind,
            max_count=PAGE,
            clientid=clientid,
            clientid_prefix=clientid_prefix,
            group=group,
            stale_ok=stale_ok,
        )
        self.stale_ok = stale_ok
        self.starts: dict[int, bytes] = {}
        self.pending: list[int] | None = None
        """The shards with more to list (None: all of them, before the first round)."""
        self.answers: list[spb.ListConsumersResponse] = []

    def next_call(self) -> FanoutCall[spb.ListConsumersResponse] | None:
        """The next round's call, or None when every shard was listed."""
        if self.pending is not None and not self.pending:
            return None
        return FanoutCall(
            "ListConsumers",
            self.pending,
            self._request,
            lambda response: [response],
            lambda response: 0,
            self.stale_ok,
            "Sessions",
        )

    def _request(self, shards: list[int]) -> spb.ListConsumersRequest:
        request = spb.ListConsumersRequest()
        request.CopyFrom(self.template)
        request.shards.extend(shards)
        for shard in shards:
            if self.starts.get(shard):
                request.starts.add(shard=shard, start=self.starts[shard])
        return request

    def record(self, answers: Sequence[spb.ListConsumersResponse]) -> None:
        """A round's answers: the entries kept, the shards that have more asked again from where they stopped."""
        self.answers.extend(answers)
        pending: list[int] = []
        for answer in answers:
            for more in answer.unfinished:
                self.starts[more.shard] = more.start
                pending.append(more.shard)
        self.pending = sorted(set(pending))

    def sessions(self) -> list[SessionInfo]:
        found = [
            SessionInfo(e.clientid, _state(e), {s.topic_filter: s.qos for s in e.subscriptions})
            for answer in self.answers
            for e in answer.sessions
        ]
        return sorted(found, key=lambda s: s.clientid)

    def positions(self) -> list[PositionInfo]:
        found = [
            PositionInfo(e.clientid, e.topic_filter, _position(e.position))
            for answer in self.answers
            for e in answer.positions
        ]
        return sorted(found, key=lambda p: (p.clientid, p.topic_filter))

    def share_groups(self) -> list[ShareGroupInfo]:
        found = [
            ShareGroupInfo(
                e.group,
                e.topic_filter,
                list(e.members),
                e.position_clientid,
                _position(e.position, e.has_position),
            )
            for answer in self.answers
            for e in answer.share_groups
        ]
        return sorted(found, key=lambda g: (g.group, g.topic_filter))


def push_request(start: bytes, lag_cap: int) -> spb.ListConsumersRequest:
    """A page of a node's push subscriptions, from ``start`` (empty: the first)."""
    request = spb.ListConsumersRequest(kind=spb.PUSH_SUBSCRIPTIONS, max_count=PAGE, lag_cap=lag_cap)
    if start:
        request.starts.add(shard=0, start=start)
    return request


def push_page(node: str, answer: spb.ListConsumersResponse) -> tuple[list[PushInfo], bytes]:
    """A node's page of push subscriptions, and where the next starts (empty: it was the last)."""
    found = [
        PushInfo(
            node,
            e.call,
            e.peer,
            e.shard,
            e.topic_filter,
            e.position_us,
            e.subscriptions,
            e.first_id,
            Lag.of([e.lag]) if e.HasField("lag") else Lag(),
        )
        for e in answer.push_subscriptions
    ]
    more = next((u.start for u in answer.unfinished), b"")
    return found, more


class LagPlan:
    """The lag of listed read positions: ConsumerLag calls of up to 1,000 items to every shard's leader."""

    def __init__(
        self, places: Sequence[tuple[str, ReadPosition]], cap: int, n_shards: int, stale_ok: bool = False
    ) -> None:
        self.items = [
            spb.LagItem(topic_filter=topic_filter, after_us=position.acked_us, after_all_us=position.start_us)
            for topic_filter, position in places
        ]
        self.cap = cap
        self.stale_ok = stale_ok
        self.shards: list[list[spb.ShardLag]] = [[] for _ in self.items]
        self.chunk = min(MAX_SESSIONS_PER_CALL, max(1, LAG_FIGURES_PER_CALL // max(1, n_shards)))
        """Items per call: an answer holds a figure per item and shard, and stays well within a node's bound."""

    def calls(self) -> list[tuple[int, FanoutCall[spb.ConsumerLagResponse]]]:
        """(first item's index, call) per chunk of items."""
        return [
            (first, self._call(self.items[first : first + self.chunk]))
            for first in range(0, len(self.items), self.chunk)
        ]

    def _call(self, chunk: list[spb.LagItem]) -> FanoutCall[spb.ConsumerLagResponse]:
        def request(shards: list[int]) -> spb.ConsumerLagRequest:
            return spb.ConsumerLagRequest(shards=shards, items=chunk, cap=self.cap, stale_ok=self.stale_ok)

        return FanoutCall("ConsumerLag", None, request, lambda r: [r], lambda r: 0, self.stale_ok, "Sessions")

    def record(self, first: int, answers: Iterable[spb.ConsumerLagResponse]) -> None:
        for answer in answers:
            for offset, item in enumerate(answer.items):
                self.shards[first + offset].extend(item.shards)

    def lags(self) -> list[Lag]:
        return [Lag.of(shards) for shards in self.shards]
