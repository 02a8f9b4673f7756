"""Answer parts kept for push subscribers whose messages carry a Message Expiry Interval, made fresh when served.

The feed (``feed.py``) and the catch-up reads (``catchup.py``) encode each
message once, as a ``FollowResponse`` carries it, and serve those bytes to
every subscriber, possibly much later. A message with an expiry interval
cannot be served so: MQTT 5 wants what is left of its interval, and nothing
once it ended. So where a kept list of parts holds such messages, an
``Expiring`` beside it names them (by their index in the list), and the parts
a subscriber takes are made again at its read's clock (``fresh``): the
interval left, or left out once it ended (``storage.expiry.message_left``,
which offline fetches use too). Most messages have none: a list without any
has no ``Expiring`` and is served as it is.

A kept part of such a message holds its whole interval appended (the field
again, last wins): what is left is never longer, so a fresh part is never
longer than the one the byte budgets counted.
"""

from __future__ import annotations

from collections.abc import Sequence

from mqds.server.storage.expiry import message_left
from mqds.server.wire import encode_messages, message_expiry_s, with_expiry


class Expiring:
    """The messages with an expiry interval in a kept list of answer parts: index -> (timestamp, stored bytes)."""

    __slots__ = ("entries", "exact_until", "shard", "tag")

    def __init__(self, tag: bytes, shard: int) -> None:
        self.tag = tag
        self.shard = shard
        self.entries: dict[int, tuple[int, bytes]] = {}
        self.exact_until = 0
        """Until this time the kept parts are what ``fresh`` would make: less than a second after the oldest of
        them was stored, each one's whole interval is what is left of it (rounded up), as a real-time
        subscriber takes them."""

    def add(self, index: int, ts: int, stored: bytes) -> None:
        self.entries[index] = (ts, stored)
        until = ts + 1_000_000
        if not self.exact_until or until < self.exact_until:
            self.exact_until = until

    def fresh(self, pieces: Sequence[bytes], first: int, now_us: int, *, keep_places: bool = False) -> list[bytes]:
        """``pieces`` (the kept list's parts from index ``first`` on) as served at ``now_us``: each of a
        message with an interval made again with what is left of it; those whose interval ended left out
        (with ``keep_places``, an empty part each instead, so the list keeps its indexes)."""
        entries = self.entries
        out: list[bytes] = []
        for index, piece in enumerate(pieces, first):
            entry = entries.get(index)
            if entry is None:
                out.append(piece)
                continue
            ts, stored = entry
            left = message_left(ts, stored, now_us)
            if left is not None:
                out.append(encode_messages(self.tag, [(ts, left)], self.shard))
            elif keep_places:
                out.append(b"")
        return out


def encode_kept(tag: bytes, entries: Sequence[tuple[int, bytes]], shard: int) -> tuple[list[bytes], Expiring | None]:
    """Messages (timestamp, stored bytes) as kept answer parts, one each, and the ``Expiring`` naming those with
    an interval (None when none has one): one scan of each message's tags (``wire.message_expiry_s``)."""
    pieces: list[bytes] = []
    expiring: Expiring | None = None
    for index, (ts, stored) in enumerate(entries):
        interval = message_expiry_s(stored)
        if interval:
            if expiring is None:
                expiring = Expiring(tag, shard)
            expiring.add(index, ts, stored)
            stored = with_expiry(stored, interval)
        pieces.append(encode_messages(tag, [(ts, stored)], shard))
    return pieces, expiring
