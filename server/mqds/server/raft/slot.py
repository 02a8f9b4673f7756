"""A group's place in the node's scheduler: whether it is queued, and its timer.

Each ``RaftGroup`` holds one (``group.slot``) and only the scheduler
(``scheduler.py``) reads and writes it, under the scheduler's lock: kept on the
group so that finding a group's slot costs an attribute read, not a lookup.
"""

from __future__ import annotations


class Slot:
    """The scheduler's bookkeeping for one group: whether it is queued, and its timer."""

    __slots__ = ("attached", "failed_until", "heap_due", "long_queued", "next_due", "queued")

    def __init__(self) -> None:
        self.attached = False
        self.queued = False
        self.long_queued = False
        self.heap_due = float("inf")
        """The due time of this group's live entry in the heap (inf: none)."""
        self.next_due = float("inf")
        """When the group's next timer is due, as its last cycle said."""
        self.failed_until = 0.0
