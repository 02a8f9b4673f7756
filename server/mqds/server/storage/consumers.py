"""Listing a shard's consumers page by page: client sessions, read positions, share groups (``mqds consumers``).

Each listing walks one kind of key of the shard's metadata family in key
order (``keys.py`` has the layout) and stops at a page's ``max_count``
entries or after :data:`MAX_KEYS` keys looked at, whichever comes first; it
returns where the next page starts (a key, inclusive), so a listing goes on
exactly where it stopped, each entry once, however the family changed in
between (an entry added behind the point reached is not listed; none is
listed twice). A page may hold fewer than ``max_count`` entries and still
have a next one: a filter that matches few keys walks many.

Sessions are the clients with a state (``c:`` keys, by clientid), then the
clients that have proxy subscriptions but no state (``s:`` keys); read
positions are the ``a:`` keys, share groups the ``h:`` keys grouped by
(group, topic filter), with the members whose lease has not ended.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from mqds.protocol.share_groups import position_client
from mqds.server.storage import keys
from mqds.server.storage.metadata import MetadataFamily
from mqds.v1 import sessions_pb2 as spb

MAX_KEYS = 10_000
"""Keys one page of one shard looks at, at most (a filter matching few of many keys returns short pages)."""

_START_PREFIXES: dict[int, tuple[bytes, ...]] = {
    spb.SESSIONS: (keys.CLIENT_PREFIX, keys.SUBSCRIPTION_PREFIX),
    spb.READ_POSITIONS: (keys.POSITION_PREFIX,),
    spb.SHARE_GROUPS: (keys.SHARE_MEMBER_PREFIX,),
}
"""Where a page of each kind may start: the key prefixes it walks."""

T = TypeVar("T")
_U16 = struct.Struct(">H")


@dataclass(frozen=True)
class ConsumerQuery:
    """What a page asks for: how many entries at most, and which clients or group."""

    max_count: int
    clientid: str = ""
    """Only this clientid (sessions, read positions)."""
    clientid_prefix: str = ""
    """Only clientids starting with this (sessions, read positions)."""
    group: str = ""
    """Only this share group (share groups; read positions: the group's)."""

    def wants(self, clientid: str) -> bool:
        if self.clientid and clientid != self.clientid:
            return False
        return clientid.startswith(self.clientid_prefix)


@dataclass
class Page(Generic[T]):
    entries: list[T]
    next_start: bytes | None
    """Where the next page starts (a key, inclusive); None: this was the last page."""
    starts: list[bytes]
    """Where each entry starts (a key, inclusive): a caller that keeps only the first entries of the page (an
    answer's byte bound) goes on from the first one it left out."""


@dataclass(frozen=True)
class GroupEntry:
    group: str
    topic_filter: str
    members: list[str]
    """The members whose lease has not ended, in name order."""
    position: spb.ReadPosition | None


def _sized(raw: bytes, at: int) -> tuple[str, int]:
    """The length-prefixed name at ``raw[at:]`` (``keys._sized``) and where it ends."""
    (length,) = _U16.unpack_from(raw, at)
    end = at + 2 + length
    return raw[at + 2 : end].decode("utf-8"), end


class ConsumerListing:
    """The consumers kept in one shard (its metadata family), listed page by page."""

    def __init__(
        self,
        metadata: MetadataFamily,
        read_position: Callable[[str, str], spb.ReadPosition | None],
        subscriptions: Callable[[str], list[tuple[str, int]]],
    ) -> None:
        self._meta = metadata
        self._read_position = read_position
        self._subscriptions = subscriptions

    @staticmethod
    def valid_start(kind: int, start: bytes) -> bool:
        """Whether ``start`` is a place a page of ``kind`` can begin (one a previous page returned)."""
        if not start:
            return True
        prefixes: tuple[bytes, ...] = _START_PREFIXES.get(kind, ())
        return any(start.startswith(prefix) for prefix in prefixes)

    # -- sessions -----------------------------------------------------------------

    def sessions(self, start: bytes, query: ConsumerQuery) -> Page[spb.ConsumerSession]:
        """Client sessions: those with a state by clientid, then those with subscriptions only."""
        found: list[spb.ConsumerSession] = []
        starts: list[bytes] = []
        looked = 0
        if not start.startswith(keys.SUBSCRIPTION_PREFIX):
            prefix = keys.client_key(query.clientid or query.clientid_prefix)
            for key, value in self._meta.scan(prefix, start or None):
                looked += 1
                if len(found) == query.max_count or looked > MAX_KEYS:
                    return Page(found, key, starts)
                clientid = key[len(keys.CLIENT_PREFIX) :].decode("utf-8")
                if not query.wants(clientid):
                    continue
                state = spb.ClientState.FromString(value)
                state.clientid = clientid
                found.append(self._session(clientid, state))
                starts.append(key)
            start = b""
        # The clients with proxy subscriptions but no state (a caller that subscribed without connecting).
        prefix = keys.subscriptions_prefix(query.clientid) if query.clientid else keys.SUBSCRIPTION_PREFIX
        for key, _ in self._meta.scan(prefix, start or None):
            looked += 1
            clientid, _end = _sized(key, len(keys.SUBSCRIPTION_PREFIX))
            if found and not found[-1].has_state and found[-1].clientid == clientid:
                continue  # another subscription of the client just listed (a page never starts inside one)
            if len(found) == query.max_count or looked > MAX_KEYS:
                return Page(found, key, starts)
            if not query.wants(clientid) or self._meta.get(keys.client_key(clientid)) is not None:
                continue
            found.append(self._session(clientid, None))
            starts.append(key)
        return Page(found, None, starts)

    def _session(self, clientid: str, state: spb.ClientState | None) -> spb.ConsumerSession:
        entry = spb.ConsumerSession(clientid=clientid, has_state=state is not None)
        if state is not None:
            entry.state.CopyFrom(state)
        for topic_filter, qos in self._subscriptions(clientid):
            entry.subscriptions.add(topic_filter=topic_filter, qos=qos)
        return entry

    # -- read positions -----------------------------------------------------------

    def positions(self, start: bytes, query: ConsumerQuery) -> Page[tuple[str, str, spb.ReadPosition]]:
        """Read positions as (clientid, topic filter, position), in key order."""
        if query.clientid:
            prefix = keys.positions_prefix(query.clientid)
        elif query.group:
            prefix = keys.positions_prefix(position_client(query.group))
        else:
            prefix = keys.POSITION_PREFIX
        found: list[tuple[str, str, spb.ReadPosition]] = []
        starts: list[bytes] = []
        for looked, (key, value) in enumerate(self._meta.scan(prefix, start or None), 1):
            if len(found) == query.max_count or looked > MAX_KEYS:
                return Page(found, key, starts)
            clientid, end = _sized(key, len(keys.POSITION_PREFIX))
            if query.wants(clientid):
                found.append((clientid, key[end:].decode("utf-8"), spb.ReadPosition.FromString(value)))
                starts.append(key)
        return Page(found, None, starts)

    # -- share groups -------------------------------------------------------------

    def share_groups(self, start: bytes, query: ConsumerQuery, now_us: int) -> Page[GroupEntry]:
        """Share groups by (group, topic filter), each whole on one page (a group has at most 1,024 members)."""
        prefix = keys.SHARE_MEMBER_PREFIX
        if query.group:
            prefix += keys.u16(len(query.group.encode("utf-8"))) + query.group.encode("utf-8")
        found: list[GroupEntry] = []
        starts: list[bytes] = []
        looked = 0
        for group_start, group, topic_filter, members in self._groups(prefix, start, now_us):
            if len(found) == query.max_count or looked > MAX_KEYS:
                return Page(found, group_start, starts)
            looked += len(members) + 1
            position = self._read_position(position_client(group), topic_filter)
            found.append(GroupEntry(group, topic_filter, [m for m, live in members if live], position))
            starts.append(group_start)
        return Page(found, None, starts)

    def _groups(
        self, prefix: bytes, start: bytes, now_us: int
    ) -> Iterator[tuple[bytes, str, str, list[tuple[str, bool]]]]:
        """Each group from ``start`` on: (its first key, group, topic filter, [(member, lease not ended)])."""
        current: tuple[bytes, str, str] | None = None
        members: list[tuple[str, bool]] = []
        for key, value in self._meta.scan(prefix, start or None):
            group, end = _sized(key, len(keys.SHARE_MEMBER_PREFIX))
            topic_filter, end = _sized(key, end)
            if current is None or (group, topic_filter) != current[1:]:
                if current is not None:
                    yield (*current, members)
                current, members = (key, group, topic_filter), []
            members.append((key[end:].decode("utf-8"), keys.read_u64(value) > now_us))
        if current is not None:
            yield (*current, members)
