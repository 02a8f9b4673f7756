"""``Sessions.FetchMessagesShared``: the offline messages of many sessions, one scan per topic filter and shard.

A broker whose persistent sessions reconnect together asks for all their
backlogs in one call per node. The sessions of one topic filter form a group;
each shard the call reads is scanned once per group
(``SessionState.fetch_shared``, the scan ``FetchMessages`` uses too), from the
lowest of the group's positions until every session has its ``max_count`` or
the data ends. Each session's messages are then merged across the shards
oldest first and cut to its ``max_count``, as one ``FetchMessages`` would
return them; the answer carries every message once and, per session, the
indexes of its own.

**Bounded.** The answer stays within ``max_answer_bytes`` (one message at
least): the groups are served in the order they first appear, each shard's
scan of a group stops at what is left of the budget, and a group's messages
are added oldest first while they fit. A session whose list was cut by any of
this says so (``more``) and keeps an exact prefix of its messages: in each
shard, everything up to its last message there, so the client continues with
``after_us`` at those messages (``SharedFetchResult`` in sessions.proto).
Each answer holds at least the oldest message of the first group that has
any, so continuing always ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.topics import TopicError, validate_filter
from mqds.protocol.wire import varint
from mqds.server.storage.sessions import FetchFilter
from mqds.server.wire import FETCH_MESSAGES_SHARED_RESPONSE_MESSAGES_TAG, encode_messages
from mqds.v1 import sessions_pb2 as spb

_U64_MAX = (1 << 64) - 1
# What a session's entry in the answer takes besides its indexes (field tags, lengths, `more`).
_PER_SESSION_BYTES = 12
# What one index of a session takes at least (a varint of two bytes once the answer holds 128 messages):
# the scans count it per session taking a message, so many sessions sharing few messages stay bounded too.
_REF_BYTES = 2

Key = tuple[int, int]
"""A message's place in a session's order: (timestamp_us, shard)."""


def check_not_empty(count: int, what: str) -> None:
    """Refuse an empty list of the sessions or pairs a call names (the guard refused one over
    MAX_SESSIONS_PER_CALL before the call got here: ``api/methods.py``)."""
    if count == 0:
        raise errors.error(Reason.INVALID_REQUEST, f"{what} is empty: name at least one")


def check_filter(topic_filter: str, where: str) -> list[str]:
    try:
        return validate_filter(topic_filter)
    except TopicError as err:
        raise errors.error(Reason.INVALID_TOPIC_FILTER, f"{where}: {err}") from None


@dataclass
class _Session:
    """One session of the call while it is served."""

    spec: spb.SharedFetchSession
    max_count: int
    since_us: int
    shards: frozenset[int]
    entries: list[tuple[int, int, bytes]] = field(default_factory=list)
    """(timestamp_us, shard, stored bytes) of its messages found so far."""
    known_to: Key | None = None
    """Set when a shard's scan stopped at the budget before the session was full: its order is exact only up
    to this key."""
    more: bool = False
    indexes: list[int] = field(default_factory=list)


class _Answer:
    """The answer being built: each message once, the budget left."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.parts: list[bytes] = []
        self.index: dict[Key, int] = {}

    @property
    def spent(self) -> bool:
        """Nothing more fits (once the answer holds a message)."""
        return self.budget is not None and self.budget <= 0 and bool(self.parts)

    def scan_budget(self) -> int | None:
        return None if self.budget is None else max(0, self.budget)

    def add_group(self, members: list[_Session]) -> None:
        """Settle a group's sessions: each one's messages in order and cut, added to the answer while they fit."""
        refs: dict[Key, int] = {}
        stored: dict[Key, bytes] = {}
        for session in members:
            session.entries.sort(key=lambda entry: (entry[0], entry[1]))
            entries = session.entries
            if session.known_to is not None:
                limit = session.known_to
                entries = [e for e in entries if (e[0], e[1]) <= limit]
                session.more = len(entries) < session.max_count
            session.entries = entries[: session.max_count]
            for ts, shard, message in session.entries:
                key = (ts, shard)
                refs[key] = refs.get(key, 0) + 1
                stored[key] = message
        stop: Key | None = None
        for key in sorted(refs):
            index = self.index.get(key)
            part = b""
            if index is None:
                part = encode_messages(FETCH_MESSAGES_SHARED_RESPONSE_MESSAGES_TAG, [(key[0], stored[key])], key[1])
                index = len(self.parts)
            cost = len(part) + refs[key] * len(varint(index))
            if self.budget is not None and self.parts and cost > self.budget:
                stop = key
                self.budget = 0
                break
            if part:
                self.index[key] = index
                self.parts.append(part)
            if self.budget is not None:
                self.budget -= cost
        for session in members:
            entries = session.entries
            if stop is not None:
                kept = [e for e in entries if (e[0], e[1]) < stop]
                if len(kept) < len(entries):
                    session.more = True
                    entries = kept
            session.indexes = [self.index[(ts, shard)] for ts, shard, _ in entries]
            session.entries = []


def serve(api: Any, request: spb.FetchMessagesSharedRequest) -> bytes:
    """Answer one FetchMessagesShared call; ``api`` is the ``SessionService`` (its shards, limits and clock)."""
    check_not_empty(len(request.sessions), "sessions")
    numbers: list[int] = api._shard_numbers(0, True, request.shards)
    allowed = set(numbers)
    now = api.clock()
    sessions: list[_Session] = []
    groups: dict[str, list[_Session]] = {}
    for i, spec in enumerate(request.sessions):
        where = f"sessions[{i}]"
        check_filter(spec.topic_filter, where)
        if spec.max_count < 1:
            raise errors.error(Reason.INVALID_REQUEST, f"{where}: max_count must be at least 1, got {spec.max_count}")
        api._shard_numbers(0, False, list(spec.after_us), field=f"{where}.after_us")
        own = allowed
        if spec.shards:
            own = set(api._shard_numbers(0, False, list(spec.shards), field=f"{where}.shards"))
            outside = sorted(own - allowed)
            if outside:
                raise errors.error(
                    Reason.INVALID_REQUEST,
                    f"{where}.shards names shard {outside[0]}, which the request's shards do not: a session reads "
                    "only shards the call reads",
                )
        since = max(0, now - spec.time_range_us) if spec.time_range_us else 0
        session = _Session(spec, min(spec.max_count, api.max_fetch), since, frozenset(own))
        sessions.append(session)
        groups.setdefault(spec.topic_filter, []).append(session)
    vnodes = api._read(numbers, request.stale_ok)
    budget = api.max_answer_bytes
    answer = _Answer(None if budget is None else budget - _PER_SESSION_BYTES * len(sessions) - 8 * len(numbers))
    for topic_filter, members in groups.items():
        if answer.spent:
            for session in members:
                session.more = True
            continue
        for vnode in vnodes:
            shard = vnode.shard
            wanted: list[FetchFilter] = []
            readers: list[_Session] = []
            for session in members:
                if shard not in session.shards:
                    continue
                spec = session.spec
                after = max(spec.after_us.get(shard, 0), spec.after_all_us)
                if after >= _U64_MAX:
                    continue  # no timestamp comes after it
                wanted.append(
                    FetchFilter(
                        topic_filter=topic_filter,
                        after_us=after,
                        since_us=session.since_us,
                        max_count=session.max_count,
                        include_qos0=spec.include_qos0,
                        skip_acked=spec.skip_acked,
                    )
                )
                readers.append(session)
            if not wanted:
                continue
            with vnode.replica.reading() as storage:
                scan = storage.sessions.fetch_shared(wanted, answer.scan_budget(), ref_bytes=_REF_BYTES, now_us=now)
            found = scan.found
            last = (found[-1][0], shard) if found else None
            for session, taken in zip(readers, scan.taken, strict=True):
                session.entries.extend((found[k][0], shard, found[k][1]) for k in taken)
                if scan.cut and last is not None and len(taken) < session.max_count:
                    known = session.known_to
                    session.known_to = last if known is None else min(known, last)
        answer.add_group(members)
    response = spb.FetchMessagesSharedResponse(shards=numbers)
    for session in sessions:
        response.sessions.add(indexes=session.indexes, more=session.more)
    return b"".join(answer.parts) + response.SerializeToString()
