"""``mqds status``: nodes, vnodes, leaders, follower lag and generations at a glance."""

from __future__ import annotations

import argparse
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from mqds.cli import consumers
from mqds.cli.console import EXIT_DEGRADED, EXIT_OK, connection, table
from mqds.cli.secret import cluster_secret_options, with_cluster_secret
from mqds.client import Client
from mqds.client.connection import ConnectionSettings
from mqds.protocol.cluster_view import META_GROUP
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc

NODE_STATUS_TIMEOUT_S = 5.0


@dataclass
class VnodeView:
    """One vnode as the live nodes report it."""

    shard: int
    replicas: list[str]
    leader: str | None
    term: int | None
    applied: int | None
    generations: int | None
    # Follower -> entries behind the leader's last log index (from the leader).
    lag: dict[str, int] = field(default_factory=dict)
    # Bytes the largest replica takes on disk (None: no node reported it).
    disk_bytes: int | None = None


@dataclass
class ClusterReport:
    """What ``mqds status`` shows: the map, each node's status (None: did not answer) and every vnode."""

    cmap: clpb.ClusterMap
    statuses: dict[str, clpb.NodeStatus | None]
    vnodes: list[VnodeView]

    @property
    def down(self) -> list[str]:
        return [node_id for node_id, status in self.statuses.items() if status is None]

    @property
    def leaderless(self) -> list[int]:
        return [v.shard for v in self.vnodes if v.leader is None]

    @property
    def refusing(self) -> dict[str, str]:
        """Nodes that refuse new messages for their disk's usage, and why."""
        return {node_id: s.writes_refused for node_id, s in self.statuses.items() if s and s.writes_refused}

    @property
    def healthy(self) -> bool:
        return not self.down and not self.leaderless and not self.refusing


def _node_status(settings: ConnectionSettings, address: str, timeout_s: float) -> clpb.NodeStatus | None:
    with settings.open_channel(address) as channel:
        try:
            return clpb_grpc.ClusterStub(channel).GetNodeStatus(
                clpb.GetNodeStatusRequest(), timeout=timeout_s, metadata=settings.call_metadata()
            )
        except grpc.RpcError:
            return None


def gather(client: Client, timeout_s: float = NODE_STATUS_TIMEOUT_S) -> ClusterReport:
    """The cluster map and every member's status, asked in parallel."""
    cmap = client.cluster_map()
    with futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(cmap.nodes)))) as pool:
        asked = {n.id: pool.submit(_node_status, client.settings, n.address, timeout_s) for n in cmap.nodes}
        statuses = {node_id: job.result() for node_id, job in asked.items()}
    # Each shard's replicas as the nodes report them; the leader is the
    # replica that says it leads, in the highest term (a deposed leader that
    # has not heard of the new term yet loses to it).
    reported: dict[int, dict[str, clpb.ReplicaStatus]] = {}
    for node_id, status in statuses.items():
        for replica in status.replicas if status else []:
            reported.setdefault(replica.group, {})[node_id] = replica
    vnodes = []
    for info in cmap.vnodes:
        seen = reported.get(info.shard, {})
        leaders = sorted(
            ((r.term, node_id) for node_id, r in seen.items() if r.role == clpb.RAFT_ROLE_LEADER), reverse=True
        )
        leader = leaders[0][1] if leaders else None
        source = seen.get(leader) if leader else next(iter(seen.values()), None)
        gens = max((r.generations for r in seen.values()), default=0)
        vnodes.append(
            VnodeView(
                shard=info.shard,
                replicas=list(info.replicas),
                leader=leader,
                term=source.term if source else None,
                applied=seen[leader].applied_index if leader else None,
                # 0 is "not reported" (a node from before the field existed).
                generations=gens or None,
                lag=dict(seen[leader].follower_lag) if leader else {},
                disk_bytes=max((r.disk_bytes for r in seen.values()), default=0) or None,
            )
        )
    return ClusterReport(cmap, statuses, vnodes)


def render(report: ClusterReport) -> str:
    """The report as text: a summary line, a node table, a vnode table and a verdict."""
    cmap, statuses = report.cmap, report.statuses
    up = len(cmap.nodes) - len(report.down)
    led = len(cmap.vnodes) - len(report.leaderless)
    per_vnode = max((len(v.replicas) for v in report.vnodes), default=0)
    lines = [
        f"cluster {cmap.cluster_id or '?'}: {len(cmap.nodes)} nodes ({up} up), {cmap.n_shards} vnodes "
        f"({led} with a leader), {per_vnode} replicas each, metadata leader {cmap.meta_leader or 'NONE'}",
        "",
    ]
    node_rows: list[list[object]] = []
    for node in cmap.nodes:
        status = statuses.get(node.id)
        leaving = " (leaving)" if node.state == clpb.NODE_STATE_LEAVING else ""
        if status is None:
            node_rows.append([node.id + leaving, node.address, "DOWN", "-", "-", "-", "-", "-", "-"])
            continue
        vnodes = [r for r in status.replicas if r.group != META_GROUP]
        leads = sum(1 for r in vnodes if r.role == clpb.RAFT_ROLE_LEADER)
        ready = "yes" if status.ready else "no"
        writes = "REFUSED" if status.writes_refused else "yes"
        node_rows.append(
            [node.id + leaving, node.address, "up", ready, leads, len(vnodes), *_disk_cells(status), writes]
        )
    lines.append(
        table(
            ["NODE", "ADDRESS", "STATE", "READY", "LEADS", "REPLICAS", "DATA", "FREE", "WRITES"],
            node_rows,
            right=(4, 5, 6, 7),
        )
    )
    lines.append(
        "  (DATA: the data directory on disk, / its disk_quota_bytes; FREE: free on its disk, / of its size; "
        "WRITES: REFUSED past a limit)"
    )
    lines.append("")
    vnode_rows = []
    for v in report.vnodes:
        parts = []
        for node_id in v.replicas:
            if statuses.get(node_id) is None:
                parts.append(f"{node_id}:down")
            elif node_id == v.leader:
                parts.append(f"{node_id}*")
            elif v.leader is not None and node_id in v.lag:
                parts.append(f"{node_id}:{v.lag[node_id]}")
            else:
                parts.append(f"{node_id}:?")
        vnode_rows.append(
            [
                v.shard,
                v.leader or "NONE",
                "-" if v.term is None else v.term,
                "-" if v.applied is None else v.applied,
                "?" if v.generations is None else v.generations,
                "?" if v.disk_bytes is None else human_bytes(v.disk_bytes),
                "  ".join(parts),
            ]
        )
    lines.append(
        table(["VNODE", "LEADER", "TERM", "APPLIED", "GENS", "DISK", "REPLICAS"], vnode_rows, right=(0, 2, 3, 4, 5))
    )
    lines.append("  (REPLICAS: * the leader; node:N a follower N log entries behind it; node:down not answering)")
    lines.append("")
    lags = [lag for v in report.vnodes for lag in v.lag.values()]
    if report.healthy:
        behind = max(lags, default=0)
        lines.append(f"OK: every node is up and every vnode has a leader; followers at most {behind} entries behind")
    else:
        problems = []
        if report.down:
            problems.append(f"node{'s' if len(report.down) > 1 else ''} {', '.join(report.down)} not answering")
        if report.leaderless:
            shards = ", ".join(map(str, report.leaderless))
            problems.append(f"vnode{'s' if len(report.leaderless) > 1 else ''} {shards} without a leader")
        problems.extend(f"new messages refused: {why}" for why in report.refusing.values())
        lines.append("DEGRADED: " + "; ".join(problems))
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    """A size for people: ``812 KiB``, ``1.5 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _disk_cells(status: clpb.NodeStatus) -> list[str]:
    """The DATA and FREE cells of a node's row ("?" from a node that does not report them)."""
    if not status.disk_total_bytes:
        return ["?", "?"]
    data = human_bytes(status.data_dir_bytes)
    if status.disk_quota_bytes:
        data += f" / {human_bytes(status.disk_quota_bytes)}"
    return [data, f"{human_bytes(status.disk_free_bytes)} / {human_bytes(status.disk_total_bytes)}"]


def run(opts: argparse.Namespace) -> int:
    # An operator's command: where the nodes check tokens, the cluster secret (in a pod's environment, or of a
    # local cluster) proves it as well as a token does.
    with Client(opts.endpoints, settings=with_cluster_secret(connection(opts, 15.0), opts)) as client:
        report = gather(client)
        print(render(report))
        if opts.consumers:  # an admin call: it names every client (mqds consumers lists them all)
            print()
            print(consumers.summary(client.consumers(lag_cap=opts.lag_cap)))
    return EXIT_OK if report.healthy else EXIT_DEGRADED


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "status",
        parents=[connection, cluster_secret_options()],
        help="nodes, vnodes, leaders, follower lag and generations at a glance",
        description=(
            "Show the cluster: every node (up or not answering, ready, how many vnodes it leads and holds, its "
            "data directory's size on disk against its quota, its disk's free space, whether it takes new "
            "messages) and every vnode (leader, Raft term, applied log index, number of generations, the size "
            "of its largest replica on disk, and how many log entries each follower is behind its leader). "
            "Exits 0 when every node is up, takes new messages and every vnode has a leader, 3 when the "
            "cluster answers but is degraded, 1 when no node answers."
        ),
    )
    parser.add_argument(
        "--consumers",
        action="store_true",
        help="also summarise the consumers (an admin call): how many sessions, read positions, share groups and "
        f"push subscriptions, and the {consumers.SUMMARY_TOP} furthest behind with their lag ('mqds consumers' "
        "lists them all)",
    )
    parser.add_argument(
        "--lag-cap",
        type=consumers.lag_cap_arg,
        default=10_000,
        metavar="N",
        help="with --consumers: count at most N messages behind per consumer and shard (default 10,000)",
    )
    parser.set_defaults(run=run)
