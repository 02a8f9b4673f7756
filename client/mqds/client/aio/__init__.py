"""The asyncio mqds client: :class:`Client`, the same methods as :class:`mqds.client.Client`, as coroutines.

>>> from mqds.client import Message
>>> from mqds.client.aio import Client
>>> async def main() -> None:
...     async with Client(["127.0.0.1:7101"]) as c:
...         await c.store_batch([Message(topic="t/1", payload=b"x", sender="pub-1", qos=1)])
...         async for m in c.replay("t/#"):
...             print(m.topic, m.payload)

This package is the asyncio driver; ``mqds.client.sync`` is the synchronous
one, with the same module names. The client's methods are written once, here
(``client.py``), and the synchronous client's are generated from them; see
``client/mqds/client/DESIGN.md``, "Two drivers, one client".
"""

from mqds.client.aio.client import Client
from mqds.client.aio.follow import AsyncSubscription
from mqds.client.aio.handles import AsyncStoreFuture
from mqds.client.aio.routing import AsyncRouter
from mqds.client.aio.share_members import AsyncSharedSubscription

__all__ = ["AsyncRouter", "AsyncSharedSubscription", "AsyncStoreFuture", "AsyncSubscription", "Client"]
