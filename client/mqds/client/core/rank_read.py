"""A replay's read of one rank's streams in few calls: answers that go on from stream to stream, cut into runs.

A replay merges the streams of a generation of a shard by time
(:mod:`mqds.client.core.merge`), so each sender's order holds across its topics.
Read stream by stream, every stream costs a call at least, and a call costs
a node about a millisecond of CPU before it reads anything: 704 streams of
1,400 messages replayed at half the speed of 64 long ones. With a fence, a
``Next`` that starts a stream goes on into the next ones
(``NextRequest.then``); its answer holds them one after the other, each in
time order, so it is cut into runs of increasing timestamps
(:func:`mqds.client.core.merge.runs`), each a source of the merge. A stream the
answer stopped inside is read on with its iterator, a source of its own.
What the merge holds is what it held before: the first batch of every
stream of the rank.

:class:`RankCalls` is the bookkeeping, the same for the sync and the
asyncio client and the Spark source (which reads a slice's streams the
same way, without the merge); they make the calls.
"""

from __future__ import annotations

from collections.abc import Sequence

from mqds.client.batch import NextResult
from mqds.client.model import Stream

MAX_THEN = 999
"""Streams a call goes on into after the one it starts (a node takes at most 1,000: ``NextRequest.then``)."""


class RankCalls:
    """Which stream the next call starts and which it goes on into; what an answer leaves to read on.

    >>> from mqds.client.batch import MessageBatch
    >>> from mqds.client.model import Iterator
    >>> s = [Stream(shard=0, generation=1, id=i, pattern="a/+") for i in range(5)]
    >>> calls = RankCalls(s)
    >>> first, then = calls.next_call()
    >>> first.id, [t.id for t in then]
    (0, [1, 2, 3, 4])
    >>> it = Iterator(shard=0, generation=1, state=b"")
    >>> calls.answered(NextResult(MessageBatch(), it, end_of_stream=False, streams_done=2)).id
    2
    >>> [t.id for t in calls.remaining()]
    [3, 4]
    >>> calls.answered(NextResult(MessageBatch(), it, end_of_stream=True, streams_done=2)) is None
    True
    >>> calls.next_call() is None
    True
    """

    __slots__ = ("_at", "_streams")

    def __init__(self, streams: Sequence[Stream]) -> None:
        self._streams = streams
        self._at = 0

    def next_call(self) -> tuple[Stream, Sequence[Stream]] | None:
        """The stream the next call starts and the ones it may go on into; None once every stream is read."""
        if self._at >= len(self._streams):
            return None
        return self._streams[self._at], self._streams[self._at + 1 : self._at + 1 + MAX_THEN]

    def answered(self, result: NextResult) -> Stream | None:
        """Move past the streams ``result`` read to their end; the stream it stopped inside (None: none).

        That stream goes on from ``result.iterator``, and the next call
        starts at the one after it. A node older than ``then`` reads only
        the stream a call starts and says nothing of the streams done.
        """
        if result.end_of_stream:
            self._at += max(result.streams_done, 1)
            return None
        stopped = self._streams[self._at + result.streams_done]
        self._at += result.streams_done + 1
        return stopped

    def remaining(self) -> Sequence[Stream]:
        """The streams no call has started yet."""
        return self._streams[self._at :]
