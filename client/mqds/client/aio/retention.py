"""Sending the cluster's retention policy: the nodes in turn until one takes it.

``client/generate_sync.py`` writes the synchronous client's ``retention.py`` from this file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from mqds.client.aio.routing import AsyncRouter
from mqds.client.core.retention import LATE, rounds
from mqds.protocol.errors import MqdsError
from mqds.v1 import cluster_pb2 as clpb


async def set_policy(
    router: AsyncRouter,
    call_error: Callable[[grpc.RpcError], MqdsError],
    policy: clpb.RetentionPolicy,
    deadline: float,
) -> clpb.RetentionPolicy:
    """Send SetRetention to the nodes in turn (any node logs it on the metadata leader) until one takes it."""
    request = clpb.SetRetentionRequest(policy=policy)
    tries = rounds(deadline)
    while tries.going_on():
        for address in router.known_addresses():
            if (remaining := tries.remaining()) is None:
                break
            try:
                cmap = await router.cluster(address).SetRetention(request, timeout=remaining, metadata=router.metadata)
                return cmap.retention
            except grpc.RpcError as err:
                tries.failed(call_error(err))
        await asyncio.sleep(tries.pause_s())
    raise tries.error(LATE)
