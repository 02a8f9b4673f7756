"""The pubsub consumers (``chaos-sub-<n>``): each with its own read position on ``chaos/#``, must get every message."""

from __future__ import annotations

from mqds.chaos.history import PUBSUB
from mqds.chaos.workload.consumer import FetchAckConsumer
from mqds.client import Message


class PubsubConsumer(FetchAckConsumer):
    """A subscriber with its own read position on ``chaos/#``: it must get every stored message.

    It acknowledges the last message of each shard in a fetch, as a broker
    does once the client acknowledged everything delivered: the read
    position is per shard, and acknowledging a message acknowledges the
    earlier ones of its shard. All of a consumer's acknowledgements go to the
    shard of its clientid, so after the first one fails the others would
    wait out the same missing leader: it stops there, and the rest come
    again with the next fetch.
    """

    mode = PUBSUB

    def _ack(self, messages: list[Message]) -> None:
        last: dict[int | None, Message] = {}
        for m in messages:  # oldest first: the last of each shard is the furthest
            last[m.shard] = m
        for m in last.values():
            if self._stop.is_set():
                return
            err = self._ack_one(m)
            if err is not None:
                self._error(err)
                return
            self.log.acks += 1
