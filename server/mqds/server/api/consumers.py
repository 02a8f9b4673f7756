"""Sessions.ListConsumers and Sessions.ConsumerLag: who reads, from where, and how far behind (``mqds consumers``).

ListConsumers lists one kind of consumer (``ConsumerKind``) from the shards
the request names, which this node must lead (any replica with
``stale_ok``), in shard order, each shard page by page
(``storage/consumers.py``): an answer holds at most ``max_count`` entries
and says, per shard that has more, where to go on (``unfinished``). Push
subscriptions are this node's own Follow calls (``follow_registry.py``),
listed from memory with their lag, which the node measures in the shard each
is served from.

A read position's lag needs every shard (the messages of a filter are in
all of them) while the position lives in its clientid's shard only:
ConsumerLag measures given positions in the shards this node leads, and the
client asks each shard's leader and adds the answers up
(``mqds.client.core.consumers``). Counting stops at a cap per item and shard
and at :data:`LAG_SCAN_BUDGET` messages a call, beyond which a count says
"at least"; the time lag costs one message (the oldest unread).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from google.protobuf.message import Message

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.share_groups import MAX_NAME_BYTES, position_client
from mqds.protocol.topics import MAX_TOPIC_BYTES
from mqds.server.api import shared_fetch
from mqds.server.api.follow_registry import FollowCalls, place_key
from mqds.server.storage.consumers import ConsumerListing, ConsumerQuery
from mqds.server.storage.lag import Lag, measure
from mqds.v1 import sessions_pb2 as spb

if TYPE_CHECKING:
    from mqds.server.api.shards_api import ShardsAPI

MAX_PAGE = 1000
"""The most entries one ListConsumers answer holds (``max_count``)."""
DEFAULT_LAG_CAP = 10_000
"""Messages counted per consumer and shard when the request names no cap."""
MAX_LAG_CAP = 100_000
"""The largest cap a request may name."""
LAG_SCAN_BUDGET = 200_000
"""Messages one call counts at most, over all its items and shards; counts past it say "at least"."""

_PUSH_KEY = struct.Struct(">QIQ")


def _bad(message: str) -> MqdsError:
    return errors.error(Reason.INVALID_REQUEST, message)


def lag_cap(cap: int, field: str) -> int:
    """The cap a request's ``field`` names (0: the default), refused past :data:`MAX_LAG_CAP`."""
    if cap > MAX_LAG_CAP:
        raise _bad(f"{field} is {cap:,}; at most {MAX_LAG_CAP:,} messages are counted per consumer and shard")
    return cap or DEFAULT_LAG_CAP


def _query(request: spb.ListConsumersRequest) -> ConsumerQuery:
    if request.kind not in spb.ConsumerKind.values():
        raise _bad(f"kind {request.kind} is not a ConsumerKind (0 to {max(spb.ConsumerKind.values())})")
    if not 1 <= request.max_count <= MAX_PAGE:
        raise _bad(f"max_count is {request.max_count:,}; ask for 1 to {MAX_PAGE:,} entries a page")
    for field, value in (("clientid", request.clientid), ("clientid_prefix", request.clientid_prefix)):
        if len(value.encode("utf-8")) > MAX_TOPIC_BYTES or "\x00" in value:
            raise errors.error(
                Reason.INVALID_CLIENTID, f"{field} {value[:40]!r}: at most {MAX_TOPIC_BYTES:,} bytes, without NUL"
            )
    group = request.group
    if group and (any(c in group for c in "/+#") or len(group.encode("utf-8")) > MAX_NAME_BYTES):
        raise _bad(f"group {group[:40]!r}: 1 to {MAX_NAME_BYTES} bytes, without '/', '+' or '#' (MQTT's ShareName)")
    return ConsumerQuery(request.max_count, request.clientid, request.clientid_prefix, group)


def _starts(request: spb.ListConsumersRequest, shards: list[int]) -> dict[int, bytes]:
    starts: dict[int, bytes] = {}
    for i, start in enumerate(request.starts):
        if start.shard in starts:
            raise _bad(f"starts[{i}] names shard {start.shard} again; one start per shard")
        if request.kind != spb.PUSH_SUBSCRIPTIONS and start.shard not in shards:
            raise _bad(f"starts[{i}] is for shard {start.shard}, which the request's shards do not list")
        starts[start.shard] = start.start
    return starts


def list_consumers(
    api: ShardsAPI, calls: FollowCalls, request: spb.ListConsumersRequest, clock: Callable[[], int]
) -> spb.ListConsumersResponse:
    """Answer ListConsumers (see the module); ``clock`` is the node's (microseconds).

    The shards are listed in order, each from its start, until ``max_count`` entries or a shard's page
    stopped short (``MAX_KEYS``), or the answer reached ``max_answer_bytes``: that shard and the ones after
    it are ``unfinished``, each with where it goes on.
    """
    query = _query(request)
    if request.kind == spb.PUSH_SUBSCRIPTIONS:
        return _push(api, calls, request, query, clock)
    now_us = clock()
    shards = api._shard_numbers(0, True, request.shards)
    starts = _starts(request, shards)
    response = spb.ListConsumersResponse()
    field = {spb.SESSIONS: "sessions", spb.READ_POSITIONS: "positions"}.get(request.kind, "share_groups")
    added = getattr(response, field)
    budget = api.max_answer_bytes
    used = 0
    left = query.max_count
    for vnode in api._read(shards, request.stale_ok):
        start = starts.get(vnode.shard, b"")
        if left == 0:  # the shards after one that stopped wait for the next page: the listing keeps shard order
            response.unfinished.add(shard=vnode.shard, start=start)
            continue
        with vnode.replica.reading() as storage:
            listing = storage.consumers
            if not listing.valid_start(request.kind, start):
                raise _bad(f"the start of shard {vnode.shard} is not one a ListConsumers answer gave for this kind")
            page_query = ConsumerQuery(left, query.clientid, query.clientid_prefix, query.group)
            entries, page_starts, next_start = _page(listing, request.kind, start, page_query, now_us, vnode.shard)
        for entry, entry_start in zip(entries, page_starts, strict=True):
            size = entry.ByteSize() + _ENTRY_OVERHEAD
            if budget is not None and used + size > budget:
                if not added:
                    api._check_answer(size, "one consumer's entry", "narrow the listing (clientid)")
                next_start = entry_start  # what did not fit comes on the next page
                break
            added.add().CopyFrom(entry)
            used += size
            left -= 1
        if next_start is not None:
            response.unfinished.add(shard=vnode.shard, start=next_start)
            left = 0
    return response


_ENTRY_OVERHEAD = 16
"""What an entry adds to an answer beyond its own bytes (its tag and length), with room to spare."""


def _page(
    listing: ConsumerListing, kind: int, start: bytes, query: ConsumerQuery, now_us: int, shard: int
) -> tuple[list[Message], list[bytes], bytes | None]:
    """One shard's page of ``kind``: the entries as the answer carries them, where each starts, where the next
    page starts."""
    entries: list[Message] = []
    if kind == spb.SESSIONS:
        sessions = listing.sessions(start, query)
        for session in sessions.entries:
            session.shard = shard
            entries.append(session)
        return entries, sessions.starts, sessions.next_start
    if kind == spb.READ_POSITIONS:
        positions = listing.positions(start, query)
        for clientid, topic_filter, position in positions.entries:
            entries.append(
                spb.ConsumerPosition(clientid=clientid, topic_filter=topic_filter, position=position, shard=shard)
            )
        return entries, positions.starts, positions.next_start
    groups = listing.share_groups(start, query, now_us)
    for group in groups.entries:
        entry = spb.ConsumerShareGroup(
            group=group.group,
            topic_filter=group.topic_filter,
            members=group.members,
            position_clientid=position_client(group.group),
            has_position=group.position is not None,
            shard=shard,
        )
        if group.position is not None:
            entry.position.CopyFrom(group.position)
        entries.append(entry)
    return entries, groups.starts, groups.next_start


def _push_key(place: spb.ConsumerPush) -> bytes:
    return _PUSH_KEY.pack(place.call, place.shard, place.position_us) + place.topic_filter.encode("utf-8")


def _push_start(raw: bytes) -> tuple[int, int, str, int]:
    if len(raw) < _PUSH_KEY.size:
        raise _bad("the start of the push subscriptions is not one a ListConsumers answer gave")
    call, shard, position = _PUSH_KEY.unpack_from(raw)
    try:
        topic_filter = raw[_PUSH_KEY.size :].decode("utf-8")
    except UnicodeDecodeError:
        raise _bad("the start of the push subscriptions is not one a ListConsumers answer gave") from None
    return (call, shard, topic_filter, position)


def _push(
    api: ShardsAPI,
    calls: FollowCalls,
    request: spb.ListConsumersRequest,
    query: ConsumerQuery,
    clock: Callable[[], int],
) -> spb.ListConsumersResponse:
    """The push subscriptions this node serves, from the request's start on, with their lag here."""
    starts = _starts(request, [])
    if set(starts) - {0}:
        raise _bad("push subscriptions are listed per node: a start names shard 0")
    start = _push_start(starts[0]) if starts.get(0) else None
    cap = lag_cap(request.lag_cap, "lag_cap")
    budget = LAG_SCAN_BUDGET
    response = spb.ListConsumersResponse()
    places = [place for place in calls.snapshot() if start is None or place_key(place) >= start]
    answer_budget = api.max_answer_bytes
    used = 0
    for i, place in enumerate(places):
        size = place.ByteSize() + _ENTRY_OVERHEAD + 64  # the lag's fields: a few varints
        if i == query.max_count or (answer_budget is not None and used + size > answer_budget and i):
            response.unfinished.add(shard=0, start=_push_key(place))
            break
        now = clock()
        lag = push_lag(api, place, max(1, min(cap, budget)), now)
        if lag is not None:
            budget -= lag.messages
            place.lag.CopyFrom(shard_lag(place.shard, lag, now))
        response.push_subscriptions.append(place)
        used += size
    return response


def push_lag(api: ShardsAPI, place: spb.ConsumerPush, cap: int, now_us: int) -> Lag | None:
    """How far a push subscription is behind in its shard, read on this node's replica; None: not hosted here."""
    try:
        vnode = api.shards.vnode(place.shard)
        with vnode.replica.reading() as storage:
            return measure(storage, place.topic_filter, place.position_us, cap, now_us)
    except MqdsError:
        return None


def shard_lag(shard: int, lag: Lag, now: int) -> spb.ShardLag:
    return spb.ShardLag(shard=shard, messages=lag.messages, at_least=lag.at_least, oldest_us=lag.oldest_us, now_us=now)


def consumer_lag(api: ShardsAPI, request: spb.ConsumerLagRequest, clock: Callable[[], int]) -> spb.ConsumerLagResponse:
    """Answer ConsumerLag: each item's lag in each of the request's shards (see the module)."""
    items = request.items
    shared_fetch.check_not_empty(len(items), "items")
    for i, item in enumerate(items):
        shared_fetch.check_filter(item.topic_filter, f"items[{i}]")
        api._shard_numbers(0, False, list(item.after_us), field=f"items[{i}].after_us")
    cap = lag_cap(request.cap, "cap")
    shards = api._shard_numbers(0, True, request.shards)
    response = spb.ConsumerLagResponse()
    answers = [response.items.add() for _ in items]
    budget = LAG_SCAN_BUDGET
    for vnode in api._read(shards, request.stale_ok):
        now = clock()
        measured: dict[tuple[str, int, bool], Lag] = {}  # items at one place of one filter are counted once
        with vnode.replica.reading() as storage:
            for item, answer in zip(items, answers, strict=True):
                after = max(item.after_us.get(vnode.shard, 0), item.after_all_us)
                place = (item.topic_filter, after, item.include_qos0)
                lag = measured.get(place)
                if lag is None:
                    lag = measure(storage, item.topic_filter, after, max(1, min(cap, budget)), now, item.include_qos0)
                    measured[place] = lag
                    budget -= lag.messages
                answer.shards.append(shard_lag(vnode.shard, lag, now))
    api._check_answer(response.ByteSize(), f"the lag of {len(items):,} items", "ask for fewer items or shards")
    return response
