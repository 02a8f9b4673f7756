"""The brokers' offline fetches coalesce (``OfflineFetches``), without a cluster: a fake ``fetch_offline_many``."""

from __future__ import annotations

import asyncio

import pytest

from mqds.broker.offline import OfflineFetches
from mqds.client import Message, OfflineFetch
from mqds.protocol import errors
from mqds.protocol.errors import Reason


class FakeClient:
    """Answers each request with one message naming it, after ``delay_s``; records the batches."""

    def __init__(self, delay_s: float = 0.01, fail: Exception | None = None) -> None:
        self.delay_s = delay_s
        self.fail = fail
        self.batches: list[list[OfflineFetch]] = []

    async def fetch_offline_many(self, requests: list[OfflineFetch]) -> list[list[Message]]:
        self.batches.append(list(requests))
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return [[Message(r.topic_filter, r.clientid.encode())] for r in requests]


def request(i: int) -> OfflineFetch:
    return OfflineFetch(f"c{i}", f"t/{i}/#", max_count=25, start="now")


def test_fetches_that_arrive_together_go_out_together_and_each_gets_its_own() -> None:
    async def scenario() -> tuple[list[list[Message]], FakeClient, OfflineFetches]:
        client = FakeClient()
        fetches = OfflineFetches(client)
        got = await asyncio.gather(*(fetches.fetch(request(i)) for i in range(50)))
        return got, client, fetches

    got, client, fetches = asyncio.run(scenario())
    assert [m.payload for (m,) in got] == [f"c{i}".encode() for i in range(50)]
    assert len(client.batches) == 1 and client.batches[0] == [request(i) for i in range(50)]
    assert (fetches.calls, fetches.fetches) == (1, 50)


def test_fetches_arriving_while_one_is_in_flight_go_out_next_and_the_window_gathers_stragglers() -> None:
    async def scenario() -> FakeClient:
        client = FakeClient(delay_s=0.05)
        fetches = OfflineFetches(client, window_s=0.02, max_batch=3)

        async def later(i: int, after_s: float) -> list[Message]:
            await asyncio.sleep(after_s)
            return await fetches.fetch(request(i))

        # 0 starts the window; 1 comes within it; 2..6 while the first call is in flight (3 at most per call).
        await asyncio.gather(later(0, 0), later(1, 0.01), *(later(i, 0.04) for i in range(2, 7)))
        return client

    client = asyncio.run(scenario())
    assert [[r.clientid for r in batch] for batch in client.batches] == [["c0", "c1"], ["c2", "c3", "c4"], ["c5", "c6"]]


def test_a_failed_call_fails_its_callers_and_a_bad_argument_fails_alone() -> None:
    refused = errors.error(Reason.UNAVAILABLE, "no node answered")

    async def scenario() -> list[object]:
        fetches = OfflineFetches(FakeClient(fail=refused))
        return await asyncio.gather(
            fetches.fetch(request(1)),
            fetches.fetch(OfflineFetch("", "t/#")),
            fetches.fetch(request(2)),
            return_exceptions=True,
        )

    first, bad, second = asyncio.run(scenario())
    assert first is refused and second is refused
    assert isinstance(bad, ValueError) and "clientid is empty" in str(bad)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="window_s must be 0 or more"):
        OfflineFetches(FakeClient(), window_s=-1)
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        OfflineFetches(FakeClient(), max_batch=0)
