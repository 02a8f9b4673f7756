"""``mqds``: the command line of an mqds cluster.

``mqds status`` shows nodes, vnodes, leaders and lag at a glance;
``mqds admin join|leave|forget|rebalance`` changes membership online. Every
command takes ``--endpoints`` (or ``MQDS_ENDPOINTS``): any node(s) of the
cluster; admin commands find the metadata leader themselves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from mqds.client import Client
from mqds.client.client import parse_endpoints
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc

ROLES = {clpb.RAFT_ROLE_LEADER: "leader", clpb.RAFT_ROLE_FOLLOWER: "follower", clpb.RAFT_ROLE_CANDIDATE: "candidate"}
META_GROUP = 0xFFFFFFFF


def _stub(address: str) -> clpb_grpc.ClusterStub:
    return clpb_grpc.ClusterStub(grpc.insecure_channel(address))


def _meta_call(endpoints: list[str], call: Callable[[clpb_grpc.ClusterStub, float], Any], timeout_s: float) -> Any:
    """Run an admin call on the metadata leader, following NOT_LEADER hints from any node."""
    deadline = time.monotonic() + timeout_s
    candidates = list(endpoints)
    last: MqdsError | None = None
    while time.monotonic() < deadline:
        address = candidates[0]
        try:
            return call(_stub(address), max(1.0, deadline - time.monotonic()))
        except grpc.RpcError as rpc_err:
            err = errors.from_rpc_error(rpc_err)
        last = err
        if not err.retriable:
            raise err
        hint = err.metadata.get("leader_address")
        if err.reason is Reason.NOT_LEADER and hint:
            candidates = [hint, *[c for c in candidates if c != hint]]
            continue
        candidates = candidates[1:] + candidates[:1]
        time.sleep(0.3)
    raise last or errors.error(Reason.DEADLINE_EXCEEDED, "no metadata leader answered in time")


def cmd_status(opts: argparse.Namespace) -> int:
    endpoints = parse_endpoints(opts.endpoints)
    with Client(endpoints, timeout_s=opts.timeout) as client:
        cmap = client.cluster_map()
    meta_leader = cmap.meta_leader or "?"
    print(f"cluster {cmap.cluster_id}: {len(cmap.nodes)} nodes, {cmap.n_shards} shards, metadata leader {meta_leader}")
    statuses: dict[str, clpb.NodeStatus | None] = {}
    for node in cmap.nodes:
        try:
            statuses[node.id] = _stub(node.address).GetNodeStatus(clpb.GetNodeStatusRequest(), timeout=5)
        except grpc.RpcError:
            statuses[node.id] = None
    print()
    print(f"{'node':<12} {'address':<24} {'state':<8} {'leads':>5} {'replicas':>8}  ready")
    for node in cmap.nodes:
        status = statuses[node.id]
        if status is None:
            print(f"{node.id:<12} {node.address:<24} {'DOWN':<8} {'-':>5} {'-':>8}  no")
            continue
        vnodes = [r for r in status.replicas if r.group != META_GROUP]
        leads = sum(1 for r in vnodes if r.role == clpb.RAFT_ROLE_LEADER)
        print(
            f"{node.id:<12} {node.address:<24} {'up':<8} {leads:>5} {len(vnodes):>8}  {'yes' if status.ready else 'no'}"
        )
    print()
    print(f"{'shard':>5} {'leader':<12} {'term':>5} {'applied':>9} {'replicas (lag in entries)'}")
    by_shard: dict[int, dict[str, clpb.ReplicaStatus]] = {}
    for node_id, status in statuses.items():
        for replica in status.replicas if status else []:
            by_shard.setdefault(replica.group, {})[node_id] = replica
    for vnode in cmap.vnodes:
        seen = by_shard.get(vnode.shard, {})
        leader = seen.get(vnode.leader) if vnode.leader else None
        parts = []
        for node_id in vnode.replicas:
            if node_id not in seen:
                parts.append(f"{node_id}(down)")
            elif leader is not None and node_id != vnode.leader:
                parts.append(f"{node_id}({leader.follower_lag.get(node_id, 0)})")
            else:
                parts.append(node_id)
        applied = leader.applied_index if leader else 0
        print(f"{vnode.shard:>5} {vnode.leader or 'NONE':<12} {vnode.term:>5} {applied:>9} {' '.join(parts)}")
    return 0


def _print_membership(response: clpb.MembershipResponse, what: str) -> None:
    print(what)
    for move in response.moves:
        print(f"  moved replica  {move}")
    for move in response.leader_moves:
        print(f"  moved leader   {move}")
    if not response.moves and not response.leader_moves:
        print("  nothing to move")
    nodes = ", ".join(n.id + (" (leaving)" if n.state == clpb.NODE_STATE_LEAVING else "") for n in response.map.nodes)
    print(f"members now: {nodes}")


def cmd_admin(opts: argparse.Namespace) -> int:
    endpoints = parse_endpoints(opts.endpoints)
    action = opts.action
    if action == "join":
        if not opts.address:
            print("mqds admin join: --address HOST:PORT of the new node is required", file=sys.stderr)
            return 2
        response = _meta_call(
            endpoints,
            lambda s, t: s.JoinNode(clpb.JoinNodeRequest(node_id=opts.node, address=opts.address), timeout=t),
            opts.timeout,
        )
        _print_membership(response, f"node {opts.node} joined; run 'mqds admin rebalance' to give it replicas")
    elif action == "leave":
        print(f"moving every replica off {opts.node}, then removing it (this may take a while) ...", flush=True)
        response = _meta_call(
            endpoints, lambda s, t: s.LeaveNode(clpb.LeaveNodeRequest(node_id=opts.node), timeout=t), opts.timeout
        )
        _print_membership(response, f"node {opts.node} left the cluster; it can be stopped now")
    elif action == "forget":
        print(f"replacing every replica {opts.node} held, then removing it ...", flush=True)
        response = _meta_call(
            endpoints, lambda s, t: s.ForgetNode(clpb.ForgetNodeRequest(node_id=opts.node), timeout=t), opts.timeout
        )
        _print_membership(response, f"node {opts.node} forgotten")
    else:
        print("moving replicas and leaders so every node has about the same number ...", flush=True)
        response = _meta_call(endpoints, lambda s, t: s.Rebalance(clpb.RebalanceRequest(), timeout=t), opts.timeout)
        _print_membership(response, "rebalanced")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mqds", description="Inspect and administer an mqds cluster.")
    parser.add_argument(
        "--endpoints",
        default=os.environ.get("MQDS_ENDPOINTS", "127.0.0.1:7101"),
        help="host:port of one or more nodes, comma-separated (default: $MQDS_ENDPOINTS or 127.0.0.1:7101)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the command (default 1800)")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="nodes, vnodes, leaders and replica lag at a glance")
    status.set_defaults(run=cmd_status)
    admin = sub.add_parser("admin", help="change membership online", description="Change the cluster's membership.")
    admin_sub = admin.add_subparsers(dest="action", required=True)
    join = admin_sub.add_parser("join", help="add a running node (started with --peers of current members)")
    join.add_argument("node", help="the new node's id (its --node-id)")
    join.add_argument("--address", help="host:port the new node listens on (its --advertise or --listen)")
    leave = admin_sub.add_parser("leave", help="move a node's replicas away, then remove it")
    leave.add_argument("node", help="the node's id")
    forget = admin_sub.add_parser("forget", help="remove a node that is gone for good, replacing its replicas")
    forget.add_argument("node", help="the node's id")
    admin_sub.add_parser("rebalance", help="even out replicas and leaders across the nodes")
    admin.set_defaults(run=cmd_admin)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        return int(opts.run(opts))
    except MqdsError as err:
        print(f"mqds {opts.command}: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"mqds {opts.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
