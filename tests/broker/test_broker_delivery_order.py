"""The amqtt plugin's per-client queue: live messages older than a fetch's are merged into it in order; a slow
step is logged."""

from __future__ import annotations

import asyncio
import collections
import logging
from types import SimpleNamespace

import pytest

from mqds.broker.amqtt import delivery
from mqds.broker.amqtt.delivery import _Connection, _Live, _Out, _Subscribe, _Unsubscribe
from mqds.client.model import Message


def stored(shard: int, ts: int) -> Message:
    return Message(f"t/{shard}", f"{shard}:{ts}".encode(), sender="p", qos=1, shard=shard, timestamp_us=ts)


def merge(
    outs: list[_Out], items: list[object], seen: tuple[tuple[int, int], ...] = ()
) -> tuple[list[str], list[object]]:
    connection = SimpleNamespace(
        _items=collections.deque(items),
        _seen=collections.OrderedDict((key, None) for key in seen),
        _key=_Connection._key,
    )
    merged = _Connection._with_older_live(connection, outs)  # type: ignore[arg-type]
    return [m.message.payload.decode() for m in merged], list(connection._items)


def test_live_messages_older_than_a_fetched_one_of_their_shard_join_the_fetch_in_order() -> None:
    fetched = [_Out(stored(0, 10), 1, "offline", ack=True), _Out(stored(1, 15), 1, "offline", ack=True)]
    fetched.append(_Out(stored(0, 20), 1, "offline", ack=True))
    subscribe = _Subscribe("other/#", 1)
    newer = _Live(stored(0, 30), 1, True)
    other_shard = _Live(stored(2, 1), 1, True)
    unstored = _Live(Message("t/x", b"x"), 1, False)
    queue = [
        _Live(stored(0, 5), 1, True),  # stored between the filter going live and its start
        subscribe,
        _Live(stored(0, 10), 1, True),  # the live copy of a fetched one: dropped
        newer,
        _Live(stored(1, 3), 1, True),  # already sent
        other_shard,
        unstored,
    ]
    order, left = merge(fetched, queue, seen=((1, 3),))
    assert order == ["0:5", "0:10", "1:15", "0:20"]
    # What is not older than the fetch in its shard stays queued, in its order.
    assert left == [subscribe, newer, other_shard, unstored]


def test_nothing_to_merge_leaves_the_fetch_and_the_queue_alone() -> None:
    fetched = [_Out(stored(0, 10), 1, "offline", ack=True)]
    later = _Live(stored(0, 11), 1, True)
    assert merge(fetched, [later]) == (["0:10"], [later])
    assert merge([], [later]) == ([], [later])


def test_a_slow_step_of_a_connection_is_logged_with_what_it_held_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's items run one at a time: one whose mqds calls are slow delays its later ones (its disconnect's
    record too), and the broker says so rather than leaving a silent wait."""
    monkeypatch.setattr(delivery, "SLOW_ITEM_S", 0.05)
    counted: collections.Counter[str] = collections.Counter()
    recorded: list[str] = []

    class Hooks:
        async def session_unsubscribed(self, clientid: str, topic_filter: str) -> None:
            await asyncio.sleep(0.2)

        async def client_disconnected(self, clientid: str) -> None:
            recorded.append(clientid)

    plugin = SimpleNamespace(hooks=Hooks(), count=lambda what, n=1: counted.update({what: n}))
    session = SimpleNamespace(clean_session=True, parent=0, attributes={})

    async def run() -> None:
        connection = _Connection(plugin, "slow-client", session, None, None)  # type: ignore[arg-type]
        connection.put(_Unsubscribe("a/#"))
        connection.close(record=True)
        await asyncio.wait_for(connection.task, 5)

    with caplog.at_level(logging.WARNING, logger="mqds.broker.amqtt"):
        asyncio.run(run())
    assert recorded == ["slow-client"]  # the disconnect is still recorded, after the slow step
    assert counted["slow_items"] == 1
    (warning,) = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert warning.startswith("client slow-client: unsubscribe took 0.")
    assert "what came after it waited" in warning
