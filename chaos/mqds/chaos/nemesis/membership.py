"""The membership fault: a node joins and leaves through the admin API while the workload runs."""

from __future__ import annotations

import random

from mqds.chaos.nemesis.base import ADMIN_TIMEOUT_S, START_TIMEOUT_S, Env, Injection, Nemesis, node_order
from mqds.v1 import cluster_pb2 as clpb


class Membership(Nemesis):
    name = "membership"
    description = (
        "join a new node and rebalance onto it, then make it leave (replicas move off) and stop it, "
        "all through the admin API while the workload runs"
    )

    def __init__(self) -> None:
        self.joined = 0

    def inject(self, env: Env, rng: random.Random) -> Injection:
        cluster = env.cluster
        taken = {*cluster.nodes, *env.members()}
        number = max(node_order(n)[0] for n in taken) + 1
        node_id = f"n{number}"
        proc = cluster.add_node(node_id, timeout_s=START_TIMEOUT_S)
        cluster.admin("JoinNode", clpb.JoinNodeRequest(node_id=node_id, address=proc.address), ADMIN_TIMEOUT_S)
        joined = cluster.admin("Rebalance", clpb.RebalanceRequest(), ADMIN_TIMEOUT_S)
        env.log(f"membership: {node_id} joined, {len(joined.moves)} replica moves onto it")
        left = cluster.admin("LeaveNode", clpb.LeaveNodeRequest(node_id=node_id), ADMIN_TIMEOUT_S)
        proc.stop(timeout_s=20)
        cluster.nodes.pop(node_id)
        self.joined += 1
        return Injection(
            [node_id],
            f"{node_id} joined ({len(joined.moves)} replicas moved onto it) and left ({len(left.moves)} moved off)",
            [],
        )
