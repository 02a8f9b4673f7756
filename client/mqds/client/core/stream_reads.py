"""What a replay reads of each rank (a generation of a shard), and how far it reads ahead.

A replay reads each rank up to its shard's fence (:class:`RankRead`); each
driver's ``reads`` module reads it, each driver's ``replay`` module reads
up to ``read_ahead`` ranks ahead of the caller within the bounds below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Generic, TypeVar

from mqds.client.batch import MessageBatch
from mqds.client.model import Stream
from mqds.protocol.errors import GenerationDroppedError

T = TypeVar("T")

GROUP_DEPTH = 64
"""Batches a replay keeps ready ahead of the caller, per rank group read ahead (at most)."""
GROUP_BYTES = 16 * 1024 * 1024
"""Bytes of answers a replay keeps ready ahead of the caller, per rank group read ahead (at most, one batch
more if a single batch is larger): with ``read_ahead`` 4, 64 MiB and the batches being read. Before, four
batches a group: read call by call once the caller reached it; groups of 61,000 messages in eleven
streams replayed 388,000-438,000 msg/s against 531,000-543,000 (docs/performance.md)."""
WEIGH_BATCH: Callable[[MessageBatch], int] = attrgetter("nbytes")


@dataclass(frozen=True)
class RankRead:
    """What a replay reads of each stream of a rank, and what it does when the generation is dropped."""

    topic_filter: str
    start_time_us: int
    batch_size: int
    fence_us: int
    on_dropped: Callable[[Stream], None] | None
    """Handed each stream a dropped generation leaves unread; None: the ``GenerationDroppedError`` is raised."""

    def dropped(self, streams: Sequence[Stream], error: GenerationDroppedError) -> None:
        """The generation is gone: hand ``streams`` to ``on_dropped``, or raise ``error`` without it."""
        if self.on_dropped is None:
            raise error
        for stream in streams:
            self.on_dropped(stream)


@dataclass(frozen=True)
class ReadAhead(Generic[T]):
    """How far a driver's ``read_ahead`` reads: ``ahead`` sources at once, each keeping at most ``depth``
    items waiting and, with ``max_bytes`` and ``weigh``, items weighing at most ``max_bytes`` together
    (one at least)."""

    ahead: int
    depth: int
    max_bytes: int | None = None
    weigh: Callable[[T], int] | None = None

    def __post_init__(self) -> None:
        if self.ahead < 1 or self.depth < 1:
            raise ValueError(f"read-ahead needs ahead and depth of 1 or more, got {self.ahead} and {self.depth}")

    def weight(self, item: T) -> int:
        """What ``item`` counts against ``max_bytes`` (0 without ``weigh``)."""
        return 0 if self.weigh is None else self.weigh(item)
