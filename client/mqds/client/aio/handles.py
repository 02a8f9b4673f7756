"""What the asyncio client's ``store_async`` gives: the call itself, an ``asyncio.Future``.

The call's state (:class:`~mqds.client.core.pipeline_calls.CallState`) and
its future are one object, as in the synchronous client
(:mod:`mqds.client.sync.handles`, whose docstring says why). The pipeline
settles a call; :func:`publish` then completes the settled futures in the
order they settled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from mqds.client.core.pipeline_calls import CALL_SLOTS, CallState
from mqds.client.model import Message
from mqds.protocol.errors import MqdsError

__all__ = ["AsyncStoreFuture", "publish", "stored"]


class AsyncStoreFuture(CallState, asyncio.Future[list[Message]]):
    """A pipelined call of the asyncio client, and its ``asyncio.Future`` (one object).

    Built with :meth:`create` (``asyncio.Future`` 's own constructor, then
    the call's state).
    """

    __slots__ = CALL_SLOTS

    @classmethod
    def create(
        cls, loop: asyncio.AbstractEventLoop, messages: Message | Sequence[Message], n_shards: int, deadline: float
    ) -> AsyncStoreFuture:
        handle = cls(loop=loop)
        handle.setup(messages, n_shards, deadline)
        return handle

    @classmethod
    def failed_with(cls, err: MqdsError) -> AsyncStoreFuture:
        """A future that failed before it was a call (no map in time), of the running loop."""
        handle = cls.create(asyncio.get_running_loop(), [], 1, 0.0)
        handle.error = handle.error or err
        handle.set_exception(handle.error)
        return handle


def publish(calls: Iterable[CallState]) -> None:
    """Complete settled calls' asyncio futures, in order; a future its caller cancelled stays cancelled."""
    for call in calls:
        handle: AsyncStoreFuture = call  # type: ignore[assignment]
        if handle.done():
            continue
        try:
            result = handle.outcome()
        except MqdsError as err:
            handle.set_exception(err)
            continue
        handle.set_result(result)


async def stored(future: AsyncStoreFuture) -> list[Message]:
    """The stored messages of a pipelined call, once it is done (its error raised)."""
    return await future
