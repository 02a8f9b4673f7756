"""A node's Prometheus metrics, served over plain HTTP at ``metrics_listen`` (``GET /metrics``).

Each node has a registry of its own, not prometheus_client's global one: a
test may run several nodes in one process, and each must report only itself.

Most of what an operator wants is state the node already keeps: Raft role,
term, commit and applied index, the leader's view of each follower, journal
sizes, RocksDB's own size accounting, generation counts, the counters of
the transport, the groups and the replicas. :class:`_NodeCollector` reads
it when Prometheus scrapes, so none of it costs anything between scrapes.
The few things that are events with nowhere else to live (call latencies,
refused calls, snapshot transfers, retention drops) are counted here as
they happen, and never per message: the write path (StoreBatch, propose,
apply) pays one histogram observation per call, and the apply loop two
integer additions per batch, done inside the group's cycle (one thread at a time: the only writer)
on the replica's own counters.

Every metric is named ``mqds_*``, with its unit in the name. Raft and
storage metrics carry a ``shard`` label: the vnode's number, or ``meta`` for
the metadata group. The node's id is in ``mqds_node_info``; Prometheus adds
the scraped target as ``instance`` (join on it to show node ids).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol
from wsgiref.simple_server import WSGIServer

import grpc
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.api.consumer_metrics import ConsumerLagCollector
from mqds.server.api.methods import Lane
from mqds.server.raft.group import META_GROUP, ROLE_NAMES

if TYPE_CHECKING:
    from mqds.server.api.follow_registry import FollowCalls
    from mqds.server.api.guard import ApiGuard
    from mqds.server.cluster.vnode import Vnode
    from mqds.server.config import NodeConfig
    from mqds.server.diskusage import DiskUsage
    from mqds.server.raft.group import RaftGroup
    from mqds.server.raft.journal import NodeLog
    from mqds.server.raft.transport import PeerRouter

log = logging.getLogger(__name__)

REQUEST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds: a Next served from memory takes well under a millisecond, a StoreBatch across a failover seconds."""

CLIENT_WINDOW_S = 60.0
"""A client connection counts in ``mqds_client_connections`` for this long after its last call."""

PUBLIC_SERVICES = frozenset({"Storage", "Sessions", "Cluster"})
"""The services whose callers count as client connections (Raft is the nodes' own)."""

_MAX_TRACKED_PEERS = 10_000
"""Past this many remembered connections, the ones idle longer than the window are forgotten at once."""


class ObservedNode(Protocol):
    """What the scrape-time collector reads of the node (``mqds.server.node.node.Node``)."""

    @property
    def node_id(self) -> str: ...

    @property
    def config(self) -> NodeConfig: ...

    @property
    def guard(self) -> ApiGuard: ...

    @property
    def router(self) -> PeerRouter: ...

    @property
    def raft_log(self) -> NodeLog: ...

    @property
    def dropped_by_closed_groups(self) -> int:
        """Raft messages from non-members that groups since closed had dropped."""
        ...

    @property
    def disk_usage(self) -> DiskUsage: ...

    @property
    def follow_calls(self) -> FollowCalls:
        """The Follow calls open on the node (the consumer lag metrics measure them)."""
        ...

    def ready(self) -> bool: ...

    def groups(self) -> list[tuple[int, RaftGroup]]: ...

    def hosted_vnodes(self) -> list[tuple[int, Vnode]]: ...


DROP_REASONS = ("malformed_frame", "malformed_message", "unknown_group", "not_member", "queue_overflow", "overtaken")


def shard_label(group: int) -> str:
    """The ``shard`` label of a Raft group: its vnode number, or ``meta``."""
    return "meta" if group == META_GROUP else str(group)


class MethodMetrics:
    """The metrics of one gRPC method: what its handler calls on every call, cheap and lock-light."""

    __slots__ = ("_duration", "_in_flight", "_owner", "method", "service", "track_peer")

    def __init__(self, owner: RequestMetrics, service: str, method: str) -> None:
        self._owner = owner
        self.service = service
        self.method = method
        self.track_peer = service in PUBLIC_SERVICES
        self._in_flight = owner.in_flight.labels(service)
        # Created on the first call, so methods nobody calls export no buckets.
        self._duration: Any = None

    def started(self, context: grpc.ServicerContext) -> float:
        """A call began; the value to pass to :meth:`finished`."""
        self._in_flight.inc()
        if self.track_peer:
            self._owner.seen(context.peer())
        return time.perf_counter()

    def finished(self, started: float) -> None:
        """A call ended, answered or refused: its duration goes into the histogram."""
        self._in_flight.dec()
        duration = self._duration
        if duration is None:
            duration = self._duration = self._owner.duration.labels(self.service, self.method)
        duration.observe(time.perf_counter() - started)

    def rejected(self, reason: Reason) -> None:
        """A call was answered with an error (counted by reason)."""
        self._owner.count_rejected(self.service, self.method, reason.value)


class RequestMetrics:
    """Per-method call latency, calls in flight, refused calls by reason, and the client connections seen."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "mqds_request_duration_seconds",
            "Time to answer a gRPC call (unary methods; refused calls included), by service and method",
            ("service", "method"),
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "mqds_requests_in_flight", "gRPC calls being handled now, by service", ("service",), registry=registry
        )
        self._lock = threading.Lock()
        self._rejected: dict[tuple[str, str, str], int] = {}
        self._peers: dict[str, float] = {}

    def method(self, service: str, method: str) -> MethodMetrics:
        return MethodMetrics(self, service, method)

    def count_rejected(self, service: str, method: str, reason: str) -> None:
        # On the error path only: a lock here costs the calls that succeed nothing.
        key = (service, method, reason)
        with self._lock:
            self._rejected[key] = self._rejected.get(key, 0) + 1

    def rejected(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return dict(self._rejected)

    def seen(self, peer: str) -> None:
        """A call from ``peer`` (gRPC's ``ipv4:host:port`` of the client's end: one per connection)."""
        self._peers[peer] = time.monotonic()
        if len(self._peers) > _MAX_TRACKED_PEERS:
            self._forget_idle()

    def client_connections(self) -> int:
        """Connections that made a call in the last ``CLIENT_WINDOW_S`` seconds."""
        self._forget_idle()
        return len(self._peers)

    def _forget_idle(self) -> None:
        horizon = time.monotonic() - CLIENT_WINDOW_S
        # list() of a dict's items runs in C without releasing the GIL: a
        # consistent copy while calls keep adding peers.
        for peer, last in list(self._peers.items()):
            if last < horizon:
                self._peers.pop(peer, None)


class NodeMetrics:
    """Everything one node exports: the event metrics, the scrape-time collector, and the HTTP endpoint."""

    def __init__(self, node: ObservedNode) -> None:
        # No ``*_created`` series: they double every counter's series for a
        # timestamp nobody graphs. (A process-wide switch; this is the only
        # registry of the node's process.)
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(self.registry)
        r = self.registry
        self.snapshot_sends = Counter(
            "mqds_snapshot_sends", "Snapshots (RocksDB checkpoints) this node sent to a replica", ("shard",), registry=r
        )
        self.snapshot_sent_bytes = Counter(
            "mqds_snapshot_sent_bytes", "Bytes of the snapshots this node sent", ("shard",), registry=r
        )
        self.snapshot_send_seconds = Counter(
            "mqds_snapshot_send_seconds", "Time spent sending snapshots, checkpoint included", ("shard",), registry=r
        )
        self.snapshot_received_bytes = Counter(
            "mqds_snapshot_received_bytes",
            "Bytes of the snapshots this node fetched to install",
            ("shard",),
            registry=r,
        )
        self.retention_drops = Counter(
            "mqds_retention_dropped_generations",
            "Generations this node, as the vnode's leader, dropped because they were older than retention_period_s",
            ("shard",),
            registry=r,
        )
        self.expired = Counter(
            "mqds_expired",
            "What this node, as the vnode's leader, had removed because it ended: kind retained (a retained "
            "message's Message Expiry Interval ran out) or session (a client offline past its Session Expiry "
            "Interval: its state, subscriptions and read positions) or message (a stored message past its period under "
            "the cluster's retention rules) or limit (a stored message over its retention rule's max_msgs, "
            "max_bytes or per_topic, discard=old) or message_expiry (a stored message past its MQTT 5 Message Expiry "
            "Interval)",
            ("shard", "kind"),
            registry=r,
        )
        self.registry.register(_NodeCollector(node, self.requests))
        self.registry.register(ConsumerLagCollector(node, int(node.config.consumer_lag_metric_top)))
        self._http: WSGIServer | None = None

    def snapshot_sent(self, shard: int, sent_bytes: int, seconds: float) -> None:
        label = str(shard)
        self.snapshot_sends.labels(label).inc()
        self.snapshot_sent_bytes.labels(label).inc(sent_bytes)
        self.snapshot_send_seconds.labels(label).inc(seconds)

    def snapshot_received(self, shard: int, received_bytes: int) -> None:
        self.snapshot_received_bytes.labels(str(shard)).inc(received_bytes)

    def serve(self, listen: str) -> str:
        """Serve ``GET /metrics`` on ``listen`` (host:port; port 0 = any free one); the address bound.

        Raises OSError when the address cannot be bound.
        """
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")  # an IPv6 address in brackets
        server, _ = prometheus_client.start_http_server(int(port), addr=host, registry=self.registry)
        self._http = server
        return f"{host}:{server.server_port}"

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _NodeCollector(Collector):
    """Reads the node's state when scraped. Never raises for a group or replica closing meanwhile: skips it."""

    def __init__(self, node: ObservedNode, requests: RequestMetrics) -> None:
        self.node = node
        self.requests = requests

    def collect(self) -> Iterator[Metric]:
        node = self.node
        info = GaugeMetricFamily(
            "mqds_node_info", "This node: its id and advertised address (always 1)", labels=["node", "address"]
        )
        info.add_metric([node.node_id, node.config.advertised], 1.0)
        yield info
        yield GaugeMetricFamily(
            "mqds_node_ready",
            "1 when the node reports itself ready on the gRPC health service (joined, every replica led and caught up)",
            value=1.0 if node.ready() else 0.0,
        )
        yield GaugeMetricFamily(
            "mqds_client_connections",
            f"Client connections (peer address:port) that called the public API in the last {CLIENT_WINDOW_S:g} s",
            value=self.requests.client_connections(),
        )
        rejected = CounterMetricFamily(
            "mqds_rejected_requests",
            "Calls answered with an error, by reason (service and method empty: refused before reaching one, "
            "by authentication, role or the per-client call limit)",
            labels=["service", "method", "reason"],
        )
        for (service, method, reason), count in sorted(self.requests.rejected().items()):
            rejected.add_metric([service, method, reason], count)
        for reason, count in sorted(dict(node.guard.rejected).items()):
            rejected.add_metric(["", "", reason], count)
        yield rejected
        in_flight = GaugeMetricFamily(
            "mqds_calls_in_flight",
            "Calls in flight on this node by lane (unary and stream: public calls, bounded by max_public_calls and "
            "max_public_streams; internal and peer: the nodes'; observe and probe: status, map and health)",
            labels=["lane"],
        )
        for lane in Lane:
            in_flight.add_metric([lane.value], node.guard.in_flight(lane))
        yield in_flight
        yield from self._raft(node)
        yield from self._storage(node)
        yield from node.disk_usage.metrics()

    def _raft(self, node: ObservedNode) -> Iterator[Metric]:
        def gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["shard", *labels])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=["shard"])

        role = gauge("mqds_raft_role", "1 for the replica's current Raft role, 0 for the others", "role")
        has_leader = gauge("mqds_raft_has_leader", "1 when the replica knows a leader of its group")
        term = gauge("mqds_raft_term", "Current Raft term")
        commit = gauge("mqds_raft_commit_index", "Highest log index known committed")
        applied = gauge("mqds_raft_applied_index", "Highest log index applied to the state machine")
        last_log = gauge("mqds_raft_last_log_index", "Highest log index in the replica's log")
        catch_up = gauge(
            "mqds_raft_catch_up_lag_entries", "Entries the leader committed (as far as known here) not applied here"
        )
        follower_lag = gauge(
            "mqds_raft_follower_lag_entries",
            "On the leader: entries of its log each follower has not acknowledged",
            "follower",
        )
        members = gauge("mqds_raft_members", "Members (replicas) of the group, this one included")
        journal_bytes = gauge(
            "mqds_raft_journal_bytes", "Bytes of commands in the group's journal (compacted past raft_log_max_bytes)"
        )
        journal_entries = gauge("mqds_raft_journal_entries", "Entries in the group's journal")
        leader_changes = counter(
            "mqds_raft_leader_changes",
            "New leaders (term, node) this replica learned of, the first after start not counted",
        )
        elections = counter("mqds_raft_elections", "Elections this replica started (became a candidate)")
        grouped_entries = counter(
            "mqds_raft_group_commit_entries", "Log entries this replica proposed that held several commands"
        )
        grouped_commands = counter(
            "mqds_raft_group_commit_commands", "Commands proposed here that went into a log entry with others"
        )
        installing = gauge("mqds_snapshot_installing", "1 while the replica fetches and installs a snapshot")
        installs = counter("mqds_snapshot_installs", "Snapshots this replica installed")
        install_seconds = counter("mqds_snapshot_install_seconds", "Time spent fetching and installing snapshots")
        not_member = node.dropped_by_closed_groups
        overtaken = 0
        for group_id, group in node.groups():
            label = shard_label(group_id)
            try:
                st = group.status()
                lag = group.catch_up_lag()
            except Exception:  # closing while scraped: pysyncobj's state is gone
                continue
            for number, name in ROLE_NAMES.items():
                role.add_metric([label, name], 1.0 if st["role"] == number else 0.0)
            has_leader.add_metric([label], 1.0 if st["leader"] else 0.0)
            term.add_metric([label], st["term"])
            commit.add_metric([label], st["commit_index"])
            applied.add_metric([label], st["last_applied"])
            last_log.add_metric([label], st["last_log_index"])
            catch_up.add_metric([label], lag)
            for follower, entries in sorted(st["follower_lag"].items()):
                follower_lag.add_metric([label, follower], entries)
            members.add_metric([label], len(st["members"]))
            journal_bytes.add_metric([label], st["log_bytes"])
            journal_entries.add_metric([label], st["log_entries"])
            leader_changes.add_metric([label], group.leader_changes)
            elections.add_metric([label], group.elections)
            if group.proposals is not None:
                grouped_entries.add_metric([label], group.proposals.batched_entries)
                grouped_commands.add_metric([label], group.proposals.batched_commands)
            installing.add_metric([label], 1.0 if group.installing_snapshot else 0.0)
            installs.add_metric([label], group.snapshots_installed)
            install_seconds.add_metric([label], group.snapshot_install_seconds)
            not_member += group.dropped_messages
            overtaken += group.overtaken_messages
        yield from (role, has_leader, term, commit, applied, last_log, catch_up, follower_lag, members)
        yield from (journal_bytes, journal_entries, leader_changes, elections, grouped_entries, grouped_commands)
        yield from (installing, installs, install_seconds)

        router = node.router
        dropped = CounterMetricFamily(
            "mqds_raft_dropped_messages",
            "Raft traffic dropped, by reason: malformed_frame (frames), malformed_message, unknown_group (a group "
            "not hosted here), not_member (from a node outside the group), queue_overflow (outgoing, resent by Raft), "
            "overtaken (an append-entries that came after a newer one from the same leader)",
            labels=["reason"],
        )
        counts = (
            router.dropped_frames,
            router.dropped_malformed,
            router.dropped_unknown_group,
            not_member,
            router.dropped_overflow,
            overtaken,
        )
        for reason, count in zip(DROP_REASONS, counts, strict=True):
            dropped.add_metric([reason], count)
        yield dropped
        peers = GaugeMetricFamily("mqds_raft_peer_up", "1 while the Raft link to a peer node is up", labels=["peer"])
        for peer, up in sorted(router.peer_links().items()):
            peers.add_metric([peer], 1.0 if up else 0.0)
        yield peers
        yield CounterMetricFamily(
            "mqds_raft_connections_refused",
            "Raft TCP connections this node closed: a failed handshake (no cluster secret proof), a frame over "
            "the limit, or more connections still in their handshake than it takes",
            value=router.refused_connections,
        )
        wal = node.raft_log
        yield GaugeMetricFamily(
            "mqds_raft_wal_bytes", "Disk bytes of the node's Raft write-ahead log", value=_wal_bytes(wal.directory)
        )
        yield CounterMetricFamily(
            "mqds_raft_wal_written_bytes", "Bytes appended to the Raft write-ahead log", value=wal.bytes_written
        )
        yield CounterMetricFamily(
            "mqds_raft_wal_syncs", "fsyncs of the Raft write-ahead log (group commits)", value=wal.flushes
        )

    def _storage(self, node: ObservedNode) -> Iterator[Metric]:
        def family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, *labels: str) -> Any:
            return kind(name, doc, labels=["shard", *labels])

        stored = family(CounterMetricFamily, "mqds_stored_messages", "Messages this replica stored (applied)")
        stored_bytes = family(
            CounterMetricFamily,
            "mqds_stored_bytes",
            "Bytes of the stored batches as logged (protobuf-encoded messages)",
        )
        generations = family(GaugeMetricFamily, "mqds_storage_generations", "Generations the shard holds")
        generation_bytes = family(
            GaugeMetricFamily, "mqds_storage_generation_bytes", "SST file bytes of a generation", "generation"
        )
        metadata_bytes = family(
            GaugeMetricFamily, "mqds_storage_metadata_bytes", "SST file bytes of the shard's metadata and broker state"
        )
        memtable_bytes = family(
            GaugeMetricFamily, "mqds_storage_memtable_bytes", "Bytes in the shard's memtables, not yet in SST files"
        )
        follow_sent = family(
            CounterMetricFamily,
            "mqds_follow_sent_messages",
            "Messages push subscriptions (Follow) were sent, by where they were read: the replica's feed of what it "
            "just stored (shared by every subscriber) or disk (through shared catch-up reads)",
            "source",
        )
        feed_bytes = family(
            GaugeMetricFamily, "mqds_follow_feed_bytes", "Bytes of recent stores kept for push subscribers"
        )
        catchup_read = family(
            CounterMetricFamily,
            "mqds_follow_disk_read_messages",
            "Messages push subscribers' catch-up reads took from disk; subscribers of a filter at nearby positions "
            "share a read, so this grows slower than the messages sent from disk",
        )
        catchup_bytes = family(
            GaugeMetricFamily,
            "mqds_follow_catchup_bytes",
            "Bytes of recent catch-up reads kept for push subscribers at nearby positions",
        )
        fetch_scans = family(
            CounterMetricFamily,
            "mqds_offline_fetch_scans",
            "Scans of the shard for offline fetches (FetchMessages, FetchMessagesShared: one per topic filter "
            "however many sessions share it), since the replica opened its storage",
        )
        fetch_scanned = family(
            CounterMetricFamily,
            "mqds_offline_fetch_scanned_messages",
            "Stored messages the offline fetches' scans read, since the replica opened its storage",
        )
        for shard, vnode in node.hosted_vnodes():
            label = str(shard)
            replica = vnode.replica
            stored.add_metric([label], replica.stored_messages)
            stored_bytes.add_metric([label], replica.stored_bytes)
            follow_sent.add_metric([label, "feed"], replica.feed.read_from_ring)
            follow_sent.add_metric([label, "disk"], replica.feed.read_from_disk)
            feed_bytes.add_metric([label], replica.feed.size_bytes)
            catchup_read.add_metric([label], replica.catchup.read_from_disk)
            catchup_bytes.add_metric([label], replica.catchup.size_bytes)
            try:
                with replica.reading() as storage:
                    usage = storage.disk_usage()
                    scans, scanned = storage.sessions.fetch_scans, storage.sessions.fetch_scanned
            except MqdsError:  # closing
                continue
            generations.add_metric([label], len(usage.generation_bytes))
            for number, size in usage.generation_bytes.items():
                generation_bytes.add_metric([label, str(number)], size)
            metadata_bytes.add_metric([label], usage.metadata_bytes)
            memtable_bytes.add_metric([label], usage.memtable_bytes)
            fetch_scans.add_metric([label], scans)
            fetch_scanned.add_metric([label], scanned)
        yield from (stored, stored_bytes, generations, generation_bytes, metadata_bytes, memtable_bytes)
        yield from (follow_sent, feed_bytes, catchup_read, catchup_bytes, fetch_scans, fetch_scanned)


def _wal_bytes(directory: str) -> int:
    total = 0
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith("wal-"):
                with contextlib.suppress(OSError):  # a segment removed meanwhile
                    total += entry.stat().st_size
    return total
