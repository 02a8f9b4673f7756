"""The routers build each node's stubs once: a stub makes a callable per method (a tenth of a millisecond)."""

from __future__ import annotations

import asyncio

from mqds.client import ConnectionSettings
from mqds.client.aio.routing import AsyncRouter
from mqds.client.sync.routing import Router

A, B = "127.0.0.1:1", "127.0.0.1:2"  # nothing listens: a stub is made without connecting


def test_the_sync_router_keeps_one_stub_per_service_and_node_until_it_closes() -> None:
    router = Router([A, B])
    storage = router.storage(A)
    assert router.storage(A) is storage and router.storage(B) is not storage
    assert router.sessions(A) is router.sessions(A) and router.cluster(A) is router.cluster(A)
    router.close()
    assert router.storage(A) is not storage  # a new channel, a new stub
    router.close()


def test_the_asyncio_router_keeps_one_stub_per_service_and_node_until_it_closes() -> None:
    async def run() -> None:
        router = AsyncRouter([A, B], settings=ConnectionSettings())
        storage = router.storage(A)
        assert router.storage(A) is storage and router.storage(B) is not storage
        assert router.sessions(A) is router.sessions(A) and router.cluster(A) is router.cluster(A)
        await router.close()
        assert router.storage(A) is not storage
        await router.close()

    asyncio.run(run())
