"""The push subscriptions a node serves, as ``mqds consumers`` and the lag metrics see them.

Every Storage.Follow call registers here while it lasts (``follow.serve``)
and is numbered from 1 as calls come. :meth:`FollowCalls.snapshot` reads,
under each call's lock, where its subscriptions stand: one place
(``ConsumerPush``, as ListConsumers answers it) for the subscriptions of a call at one position of one
filter and shard (a cohort, or one subscription), so a call carrying ten
thousand subscribers of one topic at its head is one line, not ten thousand.
Nothing is kept per message; the registry costs a dictionary entry per call.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Protocol

from mqds.v1 import sessions_pb2 as spb


class _Sub(Protocol):
    """What the snapshot reads of a subscription (``follow_cohort.FollowSub``)."""

    id: int
    start: Any
    cohort: Any


class _Call(Protocol):
    lock: threading.Lock
    subs: dict[int, Any]


def place_key(place: spb.ConsumerPush) -> tuple[int, int, str, int]:
    """A place's order in a listing (call, shard, filter, position): the order pages follow."""
    return (place.call, place.shard, place.topic_filter, place.position_us)


class FollowCalls:
    """The node's open Follow calls (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._calls: dict[int, tuple[_Call, str]] = {}

    def add(self, call: _Call, peer: str) -> int:
        """Register a call that began; its number (to pass to :meth:`remove` when it ends)."""
        with self._lock:
            number = next(self._numbers)
            self._calls[number] = (call, peer)
        return number

    def remove(self, number: int) -> None:
        with self._lock:
            self._calls.pop(number, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)

    def snapshot(self) -> list[spb.ConsumerPush]:
        """Where every subscription of every open call stands, grouped by place, in :func:`place_key` order
        (each as ListConsumers answers it, without its lag)."""
        with self._lock:
            calls = sorted(self._calls.items(), key=lambda item: item[0])
        places: list[spb.ConsumerPush] = []
        for number, (call, peer) in calls:
            grouped: dict[tuple[int, str, int], list[int]] = {}
            with call.lock:  # the call's reader and answering threads change them under it
                for sub in call.subs.values():
                    start = sub.start
                    cohort = sub.cohort
                    position = start.after_us if cohort is None else cohort.position
                    grouped.setdefault((start.shard, start.topic_filter, position), []).append(sub.id)
            for (shard, topic_filter, position), ids in grouped.items():
                places.append(
                    spb.ConsumerPush(
                        call=number,
                        peer=peer,
                        shard=shard,
                        topic_filter=topic_filter,
                        position_us=position,
                        subscriptions=len(ids),
                        first_id=min(ids),
                    )
                )
        places.sort(key=place_key)
        return places
