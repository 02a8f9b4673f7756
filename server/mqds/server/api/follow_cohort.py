"""A Follow call's cohorts: subscriptions at one place that are served as one, with their credit counted lazily.

A cohort is a call's subscriptions of one topic filter on one shard that
stand at the same position and take shared answers
(``FollowStart.shared_answers``): the node reads for it once and sends it
one answer, whose ``also`` names every member. A subscription that did not
ask for shared answers is a cohort of its own; members whose credit fell
short of an answer split off into a cohort for each credit they hold.

Credit is kept so that an answer costs a cohort one addition whatever its
size: the cohort counts the messages it ``sent``, and each member holds
``limit_at``, the value of that count at which its credit runs out. A
member's credit is ``limit_at - cohort.sent``; a grant adds to ``limit_at``;
moving to another cohort keeps the credit. The least and the most
``limit_at`` are kept too, and found again only when a grant or a departure
may have moved them. A grant of the same messages to every member (what a
client sends back for a shared answer) takes from ``sent`` instead
(:meth:`Cohort.grant_all`): one subtraction, every credit up by as much, the
least and the most kept. The call's lock guards ``sent``
and ``limit_at`` (the reader thread grants, the answering thread sends).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from mqds.v1 import storage_pb2 as pb

_LIMIT_AT = attrgetter("limit_at")


class FollowSub:
    """One subscription on a call: its id, the start it asked for, and its credit (see the module)."""

    __slots__ = ("cohort", "id", "limit_at", "start")

    def __init__(self, start: pb.FollowStart, sub_id: int) -> None:
        self.id = sub_id
        """Its id: the start's ``id`` or one of its ``also``."""
        self.start = start
        self.limit_at = start.credit
        """The cohort's ``sent`` at which this subscription's credit runs out (its credit, before it has one)."""
        self.cohort: Cohort | None = None


class Cohort:
    """Subscriptions served as one: one filter, one shard, one position (see the module)."""

    __slots__ = (
        "_ids",
        "_limits",
        "_others",
        "filed_at",
        "key",
        "levels",
        "listening",
        "members",
        "position",
        "reported",
        "reported_at",
        "sent",
        "shard",
        "shared",
        "stale_ok",
        "start_us",
        "topic_filter",
    )

    def __init__(self, start: pb.FollowStart, levels: list[str], position: int, shared: bool) -> None:
        self.topic_filter = start.topic_filter
        self.levels = levels
        self.shard = start.shard
        self.start_us = start.start_time_us
        self.stale_ok = start.stale_ok
        self.shared = shared
        self.key = (self.shard, self.topic_filter, self.start_us, self.stale_ok)
        """What members must have in common besides the position."""
        self.position = position
        self.reported = position
        self.reported_at = time.monotonic()
        self.members: dict[int, FollowSub] = {}
        self.sent = 0
        self.listening: Any = None
        """The feed this cohort is registered with (a replica's)."""
        self._ids: tuple[int, int, bytes] | None = None
        """Kept until the members change: how many, the first's id, the others' as an answer's ``also`` field."""
        self._others: list[int] = []
        """The members' ids but the first, in order (kept with ``_ids``)."""
        self._limits: tuple[int, int] | None = None
        """The least and the most ``limit_at`` of the members, kept between answers (None: to be found again)."""
        self.filed_at: int | None = None
        """The position the call filed it under to meet others (shared cohorts; the call's serving thread's)."""

    def add(self, sub: FollowSub, credit: int) -> None:
        """``sub`` joins with ``credit`` (under the call's lock)."""
        sub.cohort = self
        limit = sub.limit_at = self.sent + credit
        self.members[sub.id] = sub
        self._ids = None
        if self._limits is not None:
            low, high = self._limits
            self._limits = (min(low, limit), max(high, limit))

    def remove(self, sub: FollowSub) -> int:
        """``sub`` leaves; its credit (under the call's lock)."""
        credit = sub.limit_at - self.sent
        del self.members[sub.id]
        sub.cohort = None
        self._ids = None
        if self._limits is not None and sub.limit_at in self._limits:
            self._limits = None
        return credit

    def grant(self, sub: FollowSub, messages: int) -> None:
        """``sub``, a member, is granted ``messages`` more (under the call's lock)."""
        old = sub.limit_at
        sub.limit_at = old + messages
        if self._limits is not None:
            low, high = self._limits
            # The least may have been this member's alone: found again when next asked.
            self._limits = None if old == low else (low, max(high, sub.limit_at))

    def names_all(self, first: int, others: Sequence[int]) -> bool:
        """Whether ``first`` and ``others`` are this cohort's members, each once, in any order.

        A client grants a shared answer back naming its ids in the answer's
        order, which is the members' while they stay: that is one comparison
        in C (56 µs for 1,667 ids), not a set of the ids built and compared
        (181 µs), which stays the way for any other order.
        """
        if len(others) + 1 != len(self.members):
            return False
        _, head, _ = self.ids()
        if first == head and others == self._others:  # a protobuf repeated field compares with a list in C
            return True
        return self.members.keys() == {first, *others}

    def grant_all(self, messages: int) -> bool:
        """Every member is granted ``messages`` more (under the call's lock); whether one had no credit left.

        ``sent``, which every credit is counted from, goes back by as much,
        so the grant costs the same whatever the cohort's size.
        """
        waited = self.credits()[0] <= 0
        self.sent -= messages
        return waited

    def credits(self) -> tuple[int, int]:
        """The least and the most credit a member has (under the call's lock).

        The members' limits are walked only after a change that may have
        moved the least or the most (a grant to the member with the least, a
        member leaving), not for every answer: an answer moves ``sent``, which
        all credits are counted from.
        """
        limits = self._limits
        if limits is None:
            every = list(map(_LIMIT_AT, self.members.values()))
            limits = self._limits = (min(every), max(every))
        return limits[0] - self.sent, limits[1] - self.sent

    def short_of(self, count: int) -> list[FollowSub]:
        """The members with less credit than ``count`` (under the call's lock)."""
        floor = self.sent + count
        return [sub for sub in self.members.values() if sub.limit_at < floor]

    def ids(self) -> tuple[int, int, bytes]:
        """How many members, the first one's id, and the others' (in the order they joined) encoded as a
        ``FollowResponse.also`` field, which the answer's head is followed by: encoded once while the members
        stay, not for every answer (ten thousand ids take about 0.1 ms to encode).
        """
        if self._ids is None:
            ids = list(self.members)
            self._others = ids[1:]
            self._ids = (len(ids), ids[0], pb.FollowResponse(also=self._others).SerializeToString())
        return self._ids
