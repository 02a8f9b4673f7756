"""Storing publishes: each shard's messages in waves, one ``store_batch`` call per wave, in arrival order.

The order of the waves is what makes acknowledgements safe (see ``DESIGN.md``
next to this package, "Publishes"): the plugin learns a shard's positions in
timestamp order, and acknowledging a message moves its shard's read position
past every earlier message of that shard.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import TYPE_CHECKING, Protocol

from mqds.client.model import Message
from mqds.protocol.sharding import shard_of

if TYPE_CHECKING:
    from mqds.client import aio

# At most this many concurrent stores of one shard (see _ShardWriter).
_WAVE_LIMIT = 64
# The writer used while the cluster's shard count is unknown.
_ANY_SHARD = -1


class _Plugin(Protocol):
    """What the writers need of the plugin (:class:`~mqds.broker.amqtt.plugin.MqdsPlugin`)."""

    @property
    def client(self) -> aio.Client: ...

    async def store(self, messages: list[Message]) -> list[Message | None] | None: ...

    def stores(self, message: Message) -> bool: ...

    def hand_on(self, message: Message, stored: bool) -> None: ...


class _ShardWriter:
    """Stores one shard's messages in waves: one store call per wave, one wave after another.

    A wave takes the oldest waiting messages (``_WAVE_LIMIT`` at most) and
    stores them with one ``store_batch`` call, in arrival order; the next wave
    starts when this one finished. So every message of a wave gets a later
    timestamp than every message of the waves before it, and a publisher's
    messages are stored in the order it sent them; the plugin hands a wave on
    sorted by timestamp, which is the order acknowledgements must follow. One
    call per wave is one Raft write for the shard, however many messages it
    holds (about 7 ms each one by one).
    """

    def __init__(self, plugin: _Plugin) -> None:
        self.plugin = plugin
        self.waiting: collections.deque[tuple[Message, asyncio.Future[bool]]] = collections.deque()
        self.task: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or (self.task is not None and not self.task.done())

    def add(self, message: Message) -> asyncio.Future[bool]:
        """Queue ``message``; the future is done once it was stored (or failed) and handed on.

        Its result: False when mqds should have stored or retained the message
        and did not (the store failed), else True (stored, or nothing to store).
        """
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.waiting.append((message, done))
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name="mqds-amqtt-store")
        return done

    def _wave(self) -> list[tuple[Message, asyncio.Future[bool]]]:
        return [self.waiting.popleft() for _ in range(min(_WAVE_LIMIT, len(self.waiting)))]

    async def _run(self) -> None:
        while self.waiting:
            wave = self._wave()
            oks = [False] * len(wave)
            try:
                answer = await self.plugin.store([message for message, _ in wave])
                results = answer if answer is not None else [None] * len(wave)
                oks = [
                    answer is not None and (result is not None or not self.plugin.stores(message))
                    for (message, _), result in zip(wave, results, strict=True)
                ]
                stored = sorted((s for s in results if s is not None), key=lambda s: s.timestamp_us or 0)
                for (message, _), result in zip(wave, results, strict=True):
                    if result is None:
                        self.plugin.hand_on(message, stored=False)
                for message in stored:
                    self.plugin.hand_on(message, stored=True)
            finally:
                for (_, done), ok in zip(wave, oks, strict=True):
                    if not done.done():
                        done.set_result(ok)


class _Writers:
    """The shard writers: a publisher's messages go to the writer of its shard (by its client id)."""

    def __init__(self, plugin: _Plugin) -> None:
        self.plugin = plugin
        self.n_shards: int | None = None
        self._writers: dict[int, _ShardWriter] = {}
        self._learning: asyncio.Task[None] | None = None

    def of(self, sender: str) -> _ShardWriter:
        """The writer for the messages of ``sender`` (a client id)."""
        key = _ANY_SHARD
        if self.n_shards is not None and not (_ANY_SHARD in self._writers and self._writers[_ANY_SHARD].busy):
            key = shard_of(sender, self.n_shards)
        elif self.n_shards is None and (self._learning is None or self._learning.done()):
            # Shard count unknown (mqds did not answer at start): one writer for all, until it is learnt
            # and that writer has drained (its messages may share shards with the new ones).
            self._learning = asyncio.create_task(self._learn_shards())
        writer = self._writers.get(key)
        if writer is None:
            writer = self._writers[key] = _ShardWriter(self.plugin)
        return writer

    async def _learn_shards(self) -> None:
        while self.n_shards is None:
            try:
                self.n_shards = (await self.plugin.client.cluster_map()).n_shards or None
            except Exception:
                await asyncio.sleep(1.0)

    async def close(self) -> None:
        """Stop learning the shard count."""
        if self._learning is not None:
            self._learning.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._learning
