"""The cluster's retention policy through the client: set it (an admin call), read it from the map.

The policy is checked and built once (:func:`policy_message`) and read from
a map once (:func:`policy_of`); sending it is written once per flavour, side
by side (:func:`set_policy` with a thread, :func:`set_policy_aio` with a
task), both asking the nodes in turn by the same rules
(:class:`~mqds.client.retry.NodeRounds`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import grpc

from mqds.client.aio_routing import AsyncRouter
from mqds.client.retry import NodeRounds
from mqds.client.routing import Router
from mqds.protocol.errors import MqdsError
from mqds.protocol.retention import check_rules
from mqds.v1 import cluster_pb2 as clpb

PAUSE_S = 0.3
"""The pause after a round of the nodes in which none took the policy (an election of the metadata group)."""


def policy_message(rules: Sequence[tuple[str, int]], default_s: int) -> clpb.RetentionPolicy:
    """A checked ``RetentionPolicy``: (filter, seconds) rules in order, the default in seconds (0: keep)."""
    check_rules(rules, default_s)
    return clpb.RetentionPolicy(
        rules=[clpb.RetentionRule(topic_filter=f, period_s=p) for f, p in rules], default_s=default_s
    )


def policy_of(cmap: clpb.ClusterMap) -> clpb.RetentionPolicy | None:
    """The policy a cluster map carries, or None when none was set (each node's retention_period_s applies)."""
    return cmap.retention if cmap.HasField("retention") else None


def _rounds(deadline: float) -> NodeRounds:
    return NodeRounds(deadline, first_pause_s=PAUSE_S, max_pause_s=PAUSE_S)


_LATE = "no node took the retention policy in time"


def set_policy(
    router: Router,
    call_error: Callable[[grpc.RpcError], MqdsError],
    policy: clpb.RetentionPolicy,
    deadline: float,
) -> clpb.RetentionPolicy:
    """Send SetRetention to the nodes in turn (any node logs it on the metadata leader) until one takes it."""
    request = clpb.SetRetentionRequest(policy=policy)
    rounds = _rounds(deadline)
    while rounds.going_on():
        for address in router.known_addresses():
            if (remaining := rounds.remaining()) is None:
                break
            try:
                cmap = router.cluster(address).SetRetention(request, timeout=remaining, metadata=router.metadata)
                return cmap.retention
            except grpc.RpcError as err:
                rounds.failed(call_error(err))
        time.sleep(rounds.pause_s())
    raise rounds.error(_LATE)


async def set_policy_aio(
    router: AsyncRouter,
    call_error: Callable[[grpc.RpcError], MqdsError],
    policy: clpb.RetentionPolicy,
    deadline: float,
) -> clpb.RetentionPolicy:
    """:func:`set_policy` over ``grpc.aio``: the nodes in turn until one takes the policy."""
    request = clpb.SetRetentionRequest(policy=policy)
    rounds = _rounds(deadline)
    while rounds.going_on():
        for address in router.known_addresses():
            if (remaining := rounds.remaining()) is None:
                break
            try:
                cmap = await router.cluster(address).SetRetention(request, timeout=remaining, metadata=router.metadata)
                return cmap.retention
            except grpc.RpcError as err:
                rounds.failed(call_error(err))
        await asyncio.sleep(rounds.pause_s())
    raise rounds.error(_LATE)
