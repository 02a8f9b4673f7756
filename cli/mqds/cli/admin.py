"""``mqds admin join|leave|forget|rebalance``: change membership online, on the metadata leader.

Admin calls need proof: an admin token (``--token``) on nodes with a tokens
file, else the cluster secret, found by :mod:`mqds.cli.secret`
(``--cluster-secret-file``, ``$MQDS_CLUSTER_SECRET``, or the local cluster of
``--data-dir``; never printed). Every command making admin calls takes it the
same way.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import grpc

from mqds.cli.console import EXIT_OK, connection
from mqds.cli.secret import cluster_secret_options, with_cluster_secret
from mqds.client.connection import ConnectionSettings, parse_endpoints
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc

# Membership changes move data; they may take a long time.
DEFAULT_TIMEOUT_S = 1800.0


def _meta_call(
    endpoints: list[str],
    call: Callable[[clpb_grpc.ClusterStub, dict[str, Any]], Any],
    settings: ConnectionSettings,
    timeout_s: float,
) -> Any:
    """Run an admin call on the metadata leader, following NOT_LEADER hints from any node.

    ``call(stub, kwargs)`` makes the call with ``**kwargs`` (its timeout and metadata).
    """
    deadline = time.monotonic() + timeout_s
    candidates = list(endpoints)
    last: MqdsError | None = None
    while time.monotonic() < deadline:
        address = candidates[0]
        with settings.open_channel(address) as channel:
            kwargs = {"timeout": max(1.0, deadline - time.monotonic()), "metadata": settings.call_metadata()}
            try:
                return call(clpb_grpc.ClusterStub(channel), kwargs)
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
    if last is not None and last.reason is Reason.UNAVAILABLE:
        raise errors.error(Reason.UNAVAILABLE, f"no mqds node answered at {', '.join(endpoints)}; is it running?")
    raise last or errors.error(Reason.DEADLINE_EXCEEDED, "no metadata leader answered in time")


def _print_membership(response: clpb.MembershipResponse, what: str) -> None:
    print(what)
    for move in response.moves:
        # A move cut short earlier and finished now reads "repaired shard ...".
        print(f"  {move}" if move.startswith("repaired ") else f"  moved replica  {move}")
    for move in response.leader_moves:
        print(f"  moved leader   {move}")
    if not response.moves and not response.leader_moves:
        print("  nothing to move")
    nodes = ", ".join(n.id + (" (leaving)" if n.state == clpb.NODE_STATE_LEAVING else "") for n in response.map.nodes)
    print(f"members now: {nodes}")


def run(opts: argparse.Namespace) -> int:
    endpoints = parse_endpoints(opts.endpoints)
    timeout_s = opts.timeout or DEFAULT_TIMEOUT_S
    settings = with_cluster_secret(connection(opts, timeout_s), opts)
    action = opts.action
    if action == "join":
        response = _meta_call(
            endpoints,
            lambda s, kw: s.JoinNode(clpb.JoinNodeRequest(node_id=opts.node, address=opts.address), **kw),
            settings,
            timeout_s,
        )
        _print_membership(response, f"node {opts.node} joined; run 'mqds admin rebalance' to give it replicas")
    elif action == "leave":
        print(f"moving every replica off {opts.node}, then removing it (this may take a while) ...", flush=True)
        response = _meta_call(
            endpoints, lambda s, kw: s.LeaveNode(clpb.LeaveNodeRequest(node_id=opts.node), **kw), settings, timeout_s
        )
        _print_membership(response, f"node {opts.node} left the cluster; it can be stopped now")
    elif action == "forget":
        print(f"replacing every replica {opts.node} held, then removing it ...", flush=True)
        response = _meta_call(
            endpoints, lambda s, kw: s.ForgetNode(clpb.ForgetNodeRequest(node_id=opts.node), **kw), settings, timeout_s
        )
        _print_membership(response, f"node {opts.node} forgotten")
    else:
        print("moving replicas and leaders so every node has about the same number ...", flush=True)
        response = _meta_call(endpoints, lambda s, kw: s.Rebalance(clpb.RebalanceRequest(), **kw), settings, timeout_s)
        _print_membership(response, "rebalanced")
    return EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    admin = sub.add_parser(
        "admin",
        parents=[connection],
        help="change membership online: join, leave, forget, rebalance",
        description=(
            "Change the cluster's membership. Each command runs on the metadata leader, wherever it is, and "
            f"returns once the change is done (default --timeout {DEFAULT_TIMEOUT_S:g} s: moving replicas copies data)."
        ),
    )
    actions = admin.add_subparsers(dest="action", required=True, metavar="{join,leave,forget,rebalance}")
    secret = cluster_secret_options()
    join = actions.add_parser(
        "join",
        parents=[connection, secret],
        help="add a running node (started with --peers of current members)",
        description="Add a running node to the cluster; it takes no replicas until 'mqds admin rebalance'.",
    )
    join.add_argument("node", metavar="NODE_ID", help="the new node's id (its --node-id)")
    join.add_argument(
        "--address", required=True, metavar="HOST:PORT", help="where the new node listens (its --advertise or --listen)"
    )
    leave = actions.add_parser(
        "leave",
        parents=[connection, secret],
        help="move a node's replicas away, then remove it",
        description="Move every replica off a node (never fewer than the replication factor), then remove it.",
    )
    leave.add_argument("node", metavar="NODE_ID", help="the node's id")
    forget = actions.add_parser(
        "forget",
        parents=[connection, secret],
        help="remove a node that is gone for good, replacing its replicas",
        description="Remove a node that is gone for good, re-creating each of its replicas on another node.",
    )
    forget.add_argument("node", metavar="NODE_ID", help="the node's id")
    actions.add_parser(
        "rebalance",
        parents=[connection, secret],
        help="even out replicas and leaders across the nodes",
        description="Move replicas and preferred leaders until every node holds about the same number.",
    )
    admin.set_defaults(run=run)
