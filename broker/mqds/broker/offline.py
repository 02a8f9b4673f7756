"""Offline fetches that arrive together go out together: one ``fetch_offline_many`` for many sessions.

When a broker restarts or its network comes back, thousands of persistent
sessions reconnect within seconds, and each one's subscriptions ask for their
offline messages. One ``fetch_offline`` each would cost a read-position call
and a call to every node per session, and a scan of the same data per
session. :class:`OfflineFetches` queues the fetches instead: the first one
waits ``window_s`` (2 ms by default) for company, then everything queued goes
out as one ``fetch_offline_many`` (at most ``max_batch`` sessions, by default
the 1,000 one shared call carries, so each has the client's whole deadline;
the rest go next); the fetches that arrive while it is in flight wait for it
to finish and go out together next. Each caller gets its
own list, exactly what ``fetch_offline`` would have returned, or the call's
error. A lone fetch costs ``window_s`` more than before.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from mqds.client.core.offline import OfflineFetch
from mqds.client.model import Message
from mqds.protocol.limits import MAX_SESSIONS_PER_CALL

__all__ = ["DEFAULT_MAX_BATCH", "DEFAULT_WINDOW_S", "OfflineFetches"]

DEFAULT_WINDOW_S = 0.002
"""How long the first fetch of a quiet moment waits for others before it goes out."""
DEFAULT_MAX_BATCH = MAX_SESSIONS_PER_CALL
"""The most sessions one shared fetch carries (the rest go out next): what one call per node carries."""


class OfflineFetches:
    """Coalesces concurrent offline fetches of one asyncio client into shared ``fetch_offline_many`` calls.

    ``client`` is an :class:`mqds.client.aio.Client` (anything with its ``fetch_offline_many``). Use it from
    the event loop the client belongs to. ``calls`` and ``fetches`` count the shared calls made and the
    fetches they carried.
    """

    def __init__(self, client: Any, *, window_s: float = DEFAULT_WINDOW_S, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must be 0 or more, got {window_s!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch!r}")
        self.client = client
        self.window_s = window_s
        self.max_batch = max_batch
        self.calls = 0
        self.fetches = 0
        self._queue: collections.deque[tuple[OfflineFetch, asyncio.Future[list[Message]]]] = collections.deque()
        self._sender: asyncio.Task[None] | None = None

    async def fetch(self, request: OfflineFetch) -> list[Message]:
        """``fetch_offline`` for ``request``, sent with whatever other fetches are waiting."""
        # A bad argument fails its own caller at once, not the batch it would have joined.
        request.checked()
        future: asyncio.Future[list[Message]] = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send())
        return await future

    async def _send(self) -> None:
        try:
            if self.window_s:
                await asyncio.sleep(self.window_s)
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch))]
                waiting = [(request, future) for request, future in batch if not future.done()]
                if not waiting:
                    continue
                self.calls += 1
                self.fetches += len(waiting)
                try:
                    results = await self.client.fetch_offline_many([request for request, _ in waiting])
                except Exception as err:  # every caller of the batch gets the call's failure
                    for _, future in waiting:
                        if not future.done():
                            future.set_exception(err)
                    continue
                except BaseException:  # cancelled (the loop is closing): so are the callers
                    for _, future in waiting:
                        future.cancel()
                    raise
                for (_, future), messages in zip(waiting, results, strict=True):
                    if not future.done():
                        future.set_result(messages)
        finally:
            self._sender = None
            if self._queue:  # cancelled with callers waiting: they fail rather than wait forever
                for _, future in self._queue:
                    if not future.done():
                        future.cancel()
                self._queue.clear()
