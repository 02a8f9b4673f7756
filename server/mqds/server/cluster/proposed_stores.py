"""Store commands this node proposed, kept as their proposer parsed them: applying one here parses it no more.

A message on its way to storage was parsed three times on the leader: by the
handler (the request: topics, senders, the rules), then twice when its
command was applied, as a ``VnodeCommand`` (the topics the storage routes by)
and as a ``VnodeCommandEncoded`` (each message's bytes, stored as logged).
The leader proposed the command itself, from a request it had parsed: the
proposer (``StorageService.start_store``) hands that parse with the
command's bytes to the replica (:meth:`ProposedStores.remember`) before
proposing, and applying the entry takes it (:meth:`ProposedStores.take`)
when the logged bytes are equal to the remembered ones, and parses
otherwise (a follower, a replay after a restart, a command another leader
logged, one forgotten meanwhile). What is remembered is exactly what those
two parses give for those bytes (``StorageService._store_part`` says why),
so a replica stores the same either way: determinism does not depend on
what happened to be remembered, only on the log.

Remembered commands are taken when applied, forgotten when their proposal
is refused at once, and dropped when one remembered after them is taken
(Raft applies a leader's commands in the order it logged them: those were
never logged, or are applied parsed, which is only slower), after ``KEEP_S``,
or past ``MAX_BYTES`` of commands (oldest first).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from mqds.server.storage import StorePart

KEEP_S = 60.0
"""How long a remembered command waits to be applied (longer than a write waits, ``write_timeout_s``)."""
MAX_BYTES = 64 * 1024 * 1024
"""The commands remembered at once, in bytes (the newest is kept whatever its size)."""
_TAIL = 16
"""Bytes of a command's end in its key (a store command ends with its own ``now_us``)."""


def _key(body: bytes) -> tuple[int, bytes]:
    tail = body[-_TAIL:]
    return len(body), tail if type(tail) is bytes else bytes(tail)


class ProposedStores:
    """One replica's store commands proposed here and not yet applied, each with its parse (thread-safe)."""

    def __init__(
        self, keep_s: float = KEEP_S, max_bytes: int = MAX_BYTES, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._keep_s = keep_s
        self._max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (command, its parse, when remembered, order remembered); in the order remembered.
        self._items: dict[tuple[int, bytes], tuple[bytes, StorePart, float, int]] = {}
        self._bytes = 0
        self._count = 0

    def __len__(self) -> int:
        return len(self._items)

    def remember(self, body: bytes, part: StorePart) -> None:
        """``body``, a store command about to be proposed, is ``part`` when parsed."""
        key = _key(body)
        now = self._clock()
        with self._lock:
            items = self._items
            self._drop(key)
            self._count += 1
            items[key] = (body, part, now, self._count)
            self._bytes += len(body)
            if self._bytes > self._max_bytes or now - next(iter(items.values()))[2] > self._keep_s:
                self._expire(now)

    def forget(self, body: bytes) -> None:
        """``body`` was not proposed after all."""
        key = _key(body)
        with self._lock:
            found = self._items.get(key)
            if found is not None and found[0] is body:
                self._drop(key)

    def take(self, body: bytes) -> StorePart | None:
        """The parse of ``body`` remembered by its proposer, or None (parse it); forgets it either way."""
        items = self._items
        if not items:  # a follower's apply: nothing proposed here
            return None
        key = _key(body)
        with self._lock:
            found = self._drop(key)
            if found is None:
                if items and self._clock() - next(iter(items.values()))[2] > self._keep_s:
                    self._expire(self._clock())
                return None
            while items:  # remembered before it: never logged, or applied parsed
                oldest = next(iter(items))
                if items[oldest][3] > found[3]:
                    break
                self._drop(oldest)
        if found[0] != body:  # another command of the same length and end: parsed like any other
            return None
        return found[1]

    def _drop(self, key: tuple[int, bytes]) -> tuple[bytes, StorePart, float, int] | None:
        found = self._items.pop(key, None)
        if found is not None:
            self._bytes -= len(found[0])
        return found

    def _expire(self, now: float) -> None:
        """Drop the oldest while they are too old or too many bytes, keeping the newest unless it is too old."""
        items = self._items
        while items:
            oldest = next(iter(items))
            when = items[oldest][2]
            if now - when <= self._keep_s and (self._bytes <= self._max_bytes or len(items) == 1):
                break
            self._drop(oldest)
