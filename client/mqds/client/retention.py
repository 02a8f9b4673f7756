"""The cluster's retention policy through the client: set it (an admin call), read it from the map."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import grpc

from mqds.client.routing import Router
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.retention import check_rules
from mqds.v1 import cluster_pb2 as clpb


def policy_message(rules: Sequence[tuple[str, int]], default_s: int) -> clpb.RetentionPolicy:
    """A checked ``RetentionPolicy``: (filter, seconds) rules in order, the default in seconds (0: keep)."""
    check_rules(rules, default_s)
    return clpb.RetentionPolicy(
        rules=[clpb.RetentionRule(topic_filter=f, period_s=p) for f, p in rules], default_s=default_s
    )


def set_policy(
    router: Router,
    call_error: Callable[[grpc.RpcError], MqdsError],
    policy: clpb.RetentionPolicy,
    deadline: float,
) -> clpb.RetentionPolicy:
    """Send SetRetention to the nodes in turn (any node logs it on the metadata leader) until one takes it."""
    last: MqdsError | None = None
    request = clpb.SetRetentionRequest(policy=policy)
    while time.monotonic() < deadline:
        for address in router.known_addresses():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                cmap = router.cluster(address).SetRetention(request, timeout=remaining, metadata=router.metadata)
                return cmap.retention
            except grpc.RpcError as err:
                last = call_error(err)
                if not last.retriable:
                    raise last from None
        time.sleep(0.3)
    raise last or errors.error(Reason.DEADLINE_EXCEEDED, "no node took the retention policy in time")
