"""The node's settings: one frozen dataclass, loaded from defaults < file < environment < flags.

Every field documents its unit. ``load_config`` reads the settings with
pydantic-settings (flags, then ``MQDS_<NAME>`` environment variables, then a
TOML file given with ``--config`` or ``MQDS_CONFIG``, then the defaults) and
builds the command line from the fields, grouped by topic (``cli``), so
``mqds-server --help`` explains every option. Sizes (``*_bytes``) and
durations (``*_s``) take a plain number or one with a unit (``units``):
``MQDS_RAFT_LOG_MAX_BYTES=16MiB``, ``--write-timeout-s 500ms``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mqds.protocol.addresses import is_loopback
from mqds.server.config import cli
from mqds.server.config.settings import ENV_PREFIX, ConfigError, SettingsReader
from mqds.server.config.units import parse_bool

__all__ = ["ENV_PREFIX", "ConfigError", "NodeConfig", "build_parser", "load_config", "parse_bool", "parse_peers"]


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class NodeConfig:
    """Settings of one mqds node."""

    node_id: str = _opt("n1", "this node's id: letters, digits, '-', '_' or '.'")
    listen: str = _opt(
        "127.0.0.1:7101", "host:port the gRPC server binds (public API, cluster API, Raft, health, reflection)"
    )
    advertise: str = _opt("", "host:port other nodes and clients dial to reach this node; empty = listen")
    metrics_listen: str = _opt(
        "",
        "host:port of the plain-HTTP Prometheus endpoint (GET /metrics); empty = no endpoint, port 0 = any free "
        "port (logged). It is unauthenticated: bind it to a private address (e.g. 0.0.0.0:9101 in a pod)",
    )
    data_dir: str = _opt("data", "directory for this node's databases; created if missing")
    peers: str = _opt(
        "",
        "the founding nodes of the cluster as id=host:port,... (e.g. n1=10.0.0.1:7101,n2=10.0.0.2:7101); "
        "empty = a cluster of this node alone. A node not in the list joins an existing cluster "
        "(after 'mqds admin join')",
    )
    n_shards: int = _opt(16, "number of shards (vnodes), fixed when the cluster is created")
    replication_factor: int = _opt(3, "replicas per vnode, on distinct nodes (fewer while the cluster is smaller)")
    cluster_secret: str = _opt(
        "", "shared secret nodes present to each other on every internal call; required with peers unless dev_mode"
    )
    dev_mode: bool = _opt(False, "allow internal calls without a cluster_secret (development only)")
    tls_cert_file: str = _opt(
        "",
        "PEM certificate (chain) of this node: with tls_key_file, the gRPC port serves TLS only, and the node "
        "dials its peers with TLS, presenting this certificate; empty = plaintext",
    )
    tls_key_file: str = _opt("", "PEM private key of tls_cert_file")
    tls_ca_file: str = _opt(
        "",
        "PEM CA certificate(s) that signed the nodes' certificates; the node checks its peers' certificates "
        "against them. Empty = tls_client_ca_file when set, else the system's trusted roots",
    )
    tls_client_ca_file: str = _opt(
        "",
        "PEM CA certificate(s) for client certificates: when set, every client and peer must present a "
        "certificate they signed (mutual TLS); empty = no client certificate required",
    )
    auth_tokens_file: str = _opt(
        "",
        "file of '<role> <token>' lines (roles: reader, broker, admin): clients must send one of these tokens "
        "as 'authorization: Bearer <token>', and may make the calls of its role; empty = no client "
        "authentication (every caller may do everything)",
    )
    insecure_open_api: bool = _opt(
        False,
        "serve the public API without auth_tokens_file on a listen address other machines can reach: anyone "
        "who reaches the port may read and write every message. Without it (or dev_mode) such a node refuses "
        "to start",
    )
    max_calls_per_client: int = _opt(
        48,
        "calls and streams one client connection may have in flight on this node; more get OVERLOADED at once; "
        "at most max_public_calls; 0 = only max_public_calls and max_public_streams apply",
    )
    max_public_calls: int = _opt(
        56,
        "public unary calls in flight on this node from all clients; more get OVERLOADED at once. At least 8 "
        "below grpc_workers, so workers stay free for internal calls; refusals, health checks, streams and the "
        "peers' Raft streams have threads of their own",
    )
    max_public_streams: int = _opt(
        64,
        "streams held open on this node from all clients (Follow, StoreStream, ExportShard, health Watch, server "
        "reflection); more get OVERLOADED at once. Each runs on a thread of the streams' own pool, so held "
        "streams never take the workers unary calls and peers need",
    )
    max_concurrent_rpcs: int = _opt(
        1024,
        "calls in flight or queued on this node in all (Raft streams included); more are refused with "
        "RESOURCE_EXHAUSTED instead of queueing without bound",
    )
    digest_rate_bytes: int = _opt(
        32 * 1024 * 1024,
        "bytes a second the replica digests on this node (GetReplicaDigest, an admin call) hash, all together "
        "(each key counts 64 bytes more); at most 2 run at once, more get OVERLOADED",
    )
    raft_transport: str = _opt(
        "tcp",
        "how this node sends Raft messages to its peers: tcp = on a TCP connection of its own to each peer "
        "(raft_listen), written by the thread that produced them, TLS when the node serves TLS, the peer "
        "proving the cluster secret in a handshake; grpc = on a gRPC stream over the peers' gRPC port "
        "(more thread hand-offs per message). Either way the node also takes Raft traffic on its gRPC "
        "port, and a peer that takes no TCP gets gRPC",
    )
    raft_listen: str = _opt(
        "",
        "host:port where this node takes Raft messages over TCP from its peers (they ask for the port over "
        "gRPC); empty = the host of listen, any free port. Set a fixed port where a firewall or a network "
        "policy lists the ports nodes may use between them (the images use 7201)",
    )
    raft_heartbeat_s: float = _opt(0.2, "how often a Raft leader sends heartbeats, in seconds")
    raft_heartbeat_linger_s: float = _opt(
        0.1,
        "how long a heartbeat, or a follower's answer that only repeats its last one, may wait to leave in "
        "the same frame as other Raft messages to that peer, in seconds (0 = send each at once); anything "
        "a commit, a read or an election waits for is sent at once and takes the waiting ones with it",
    )
    raft_pass_threads: int = _opt(
        1,
        "threads that step the node's Raft groups (every group with work in one pass: one log write and "
        "fdatasync, one frame per peer), however many groups the node hosts",
    )
    raft_long_step_threads: int = _opt(
        4,
        "threads for the Raft steps that may take long and must not hold up the others: the metadata group, "
        "receiving and installing a snapshot, a stopping group; each runs one group at a time",
    )
    raft_election_timeout_s: float = _opt(
        1.0, "a follower that hears no leader for this long (to twice as long, at random) starts an election, seconds"
    )
    raft_log_max_bytes: int = _opt(
        16 * 1024 * 1024, "snapshot a group and compact its Raft journal once the journal holds this many bytes"
    )
    raft_segment_bytes: int = _opt(
        256 * 1024 * 1024,
        "start a new segment of the node's Raft log past this many bytes; older segments are deleted once "
        "every entry in them is compacted",
    )
    raft_compaction_interval_s: float = _opt(
        600.0,
        "compact each Raft group's log (a snapshot manifest, the entries before it dropped) at least this often, "
        "in seconds, when anything was applied since the last time",
    )
    write_timeout_s: float = _opt(10.0, "how long a write waits to be committed before DEADLINE_EXCEEDED, seconds")
    read_timeout_s: float = _opt(5.0, "how long a read waits to confirm leadership, seconds")
    leader_balance_interval_s: float = _opt(
        5.0,
        "how often a leader hands leadership back to its vnode's preferred replica when that one is caught up; "
        "0 = never",
    )
    placement_repair_interval_s: float = _opt(
        10.0,
        "how often the metadata leader checks that every vnode's Raft group holds the replicas its placement "
        "names, and finishes a replica move that was cut short when two checks in a row find them apart; 0 = never",
    )
    ready_max_lag_entries: int = _opt(
        100,
        "readiness: a hosted replica counts as caught up while it has applied all but at most this many of the "
        "entries its leader committed (an entry is one logged batch); 0 = must have applied everything",
    )
    ready_max_apply_stall_s: float = _opt(
        10.0,
        "readiness: a hosted replica with committed entries it has not applied is not ready once none of them "
        "was applied for this many seconds (its apply keeps failing, or its Raft thread is stuck)",
    )
    consumer_lag_metric_top: int = _opt(
        20,
        "the consumer lag metrics: how many share groups and how many push subscriptions each get series of their "
        'own (those furthest behind); the rest are summed into consumer="_other"; 0 = only the sums',
    )
    fault_injection: bool = _opt(False, "accept InjectFault calls that drop Raft traffic (tests and chaos runs only)")
    fault_clock_offset_s: float = _opt(
        0.0,
        "fault injection only (needs fault_injection): seconds added to this node's clock where it assigns "
        "timestamps and runs the generation timer, to test clock skew; 0 = the real clock",
    )
    generation_interval_s: float = _opt(
        3600.0, "start a new generation in each shard this many seconds after the current one began; 0 = never"
    )
    retention_period_s: float = _opt(
        0.0, "drop generations that ended more than this many seconds ago; 0 = keep everything"
    )
    retention_check_interval_s: float = _opt(
        60.0,
        "how often, in seconds, the vnodes this node leads remove what the cluster's retention rules "
        "(mqds retention set) ended: closed generations dropped whole, older messages of a stream deleted",
    )
    maintenance_interval_s: float = _opt(
        1.0,
        "how often, in seconds, generation rotation, retention and expiry (sessions, retained messages) are checked",
    )
    session_expiry_default_s: float = _opt(
        7200.0,
        "the session expiry interval of a client whose broker reports none (MQTT 3.1.1): its state, proxy "
        "subscriptions and read positions are removed this long after it disconnects; 0 = at the disconnect; "
        "4294967295 or more = never (MQTT 5 clients bring their own)",
    )
    lts_threshold_top: int = _opt(
        100, "distinct values of a topic's first level before the level becomes a wildcard in a stream"
    )
    lts_threshold: int = _opt(10, "distinct values of a deeper topic level before it becomes a wildcard in a stream")
    disk_quota_bytes: int = _opt(
        0,
        "refuse new messages (RESOURCE_EXHAUSTED, STORAGE_FULL) on the vnodes this node leads once its data "
        "directory takes this many bytes on disk; taken again below 95% of it. Reads, deletes, dropped "
        "generations and broker state go on. 0 = no quota",
    )
    disk_min_free_bytes: int = _opt(
        256 * 1024 * 1024,
        "refuse new messages the same way once the data directory's filesystem has less than this many bytes "
        "free; taken again above it plus 5%. 0 = no floor",
    )
    disk_check_interval_s: float = _opt(
        2.0,
        "how often the node measures its disk, in seconds: free space every time; the data directory, each "
        "vnode and the Raft log every time with a quota, else every 30 s",
    )
    max_payload_bytes: int = _opt(1024 * 1024, "largest payload accepted, in bytes")
    max_batch_messages: int = _opt(10_000, "most messages accepted in one StoreBatch call")
    store_stream_window: int = _opt(
        256,
        "batches one StoreStream call may have unanswered on this node; the node reads the next batch only "
        "once an earlier one is answered, so a client that does not read its acknowledgements is held back "
        "by flow control instead of buffered for",
    )
    store_stream_idle_s: float = _opt(
        300.0, "a StoreStream call that sends no batch for this long is ended (DEADLINE_EXCEEDED, STREAM_IDLE), seconds"
    )
    follow_feed_bytes: int = _opt(
        4 * 1024 * 1024,
        "per shard replica with push subscribers (Follow): the recent stores kept in memory for them, in bytes; "
        "a subscriber further behind reads from disk, and as many bytes again keep recent disk reads for "
        "subscribers at nearby positions",
    )
    follow_max_subscriptions: int = _opt(
        10_000, "push subscriptions one Follow call may carry; one more ends the call with INVALID_ARGUMENT"
    )
    follow_max_batch: int = _opt(1_000, "most messages one Follow answer carries (and at most max_answer_bytes)")
    max_next_batch: int = _opt(10_000, "most messages one Next call returns; larger batch_size values are capped")
    max_request_bytes: int = _opt(
        64 * 1024 * 1024,
        "largest request a client may send, in bytes; a larger one is refused with INVALID_ARGUMENT before it is "
        "parsed (Raft traffic between nodes may be larger: the port itself accepts twice this plus 4 MiB)",
    )
    max_answer_bytes: int = _opt(
        16 * 1024 * 1024,
        "largest answer the public API builds, in bytes: Next, FetchMessages and FetchMessagesShared stop at it "
        "(always returning at least one message, so a reader continues), other calls whose answer would be "
        "larger are refused with INVALID_ARGUMENT; at most max_request_bytes",
    )
    grpc_workers: int = _opt(
        64,
        "threads serving gRPC calls: public calls (max_public_calls), internal calls and refusals (the peers' "
        "Raft streams have threads of their own)",
    )
    block_cache_bytes: int = _opt(64 * 1024 * 1024, "RocksDB block cache shared by all shards, in bytes")
    write_buffer_bytes: int = _opt(128 * 1024 * 1024, "RocksDB memtable memory for all shards together, in bytes")
    compaction_low_priority: bool = _opt(
        True,
        "run RocksDB compactions at the lowest CPU and I/O priority, so they use what serving calls leave "
        "(their bursts otherwise show in write latency)",
    )
    shutdown_grace_s: float = _opt(5.0, "seconds in-flight calls get to finish on SIGTERM")
    log_level: str = _opt("INFO", "logging level: DEBUG, INFO, WARNING or ERROR")
    log_format: str = _opt(
        "text", "log line format on stderr: text, or json (one JSON object a line: time, level, logger, message)"
    )

    def validate(self) -> NodeConfig:
        """Raise ConfigError with a precise message for the first bad setting."""
        if not self.node_id or not all(c.isalnum() or c in "-_." for c in self.node_id):
            raise ConfigError(f"node_id {self.node_id!r}: use letters, digits, '-', '_' or '.'")
        for name in ("listen", "advertise"):
            value = getattr(self, name)
            if name == "advertise" and not value:
                continue
            if not _is_address(value):
                raise ConfigError(f"{name} {value!r}: expected host:port with a port from 1 to 65535")
        for name in ("metrics_listen", "raft_listen"):
            value = getattr(self, name)
            host, sep, port = value.rpartition(":")
            if value and not (sep and host and port.isdigit() and int(port) < 65536):
                raise ConfigError(f"{name} {value!r}: expected host:port with a port from 0 to 65535, or empty")
        if self.raft_transport not in ("tcp", "grpc"):
            raise ConfigError(f"raft_transport {self.raft_transport!r}: expected tcp or grpc")
        if self.ready_max_lag_entries < 0:
            raise ConfigError(f"ready_max_lag_entries must be 0 or more, got {self.ready_max_lag_entries}")
        peers = self.peer_map()
        if len(set(peers) - {self.node_id}) and not self.cluster_secret and not self.dev_mode:
            raise ConfigError(
                "cluster_secret is required when the cluster has other nodes (set the same secret on every "
                "node, e.g. MQDS_CLUSTER_SECRET), or set dev_mode for a development cluster"
            )
        if not self.data_dir:
            raise ConfigError("data_dir must not be empty")
        self._check_tls()
        positive = (
            "n_shards",
            "lts_threshold_top",
            "lts_threshold",
            "max_payload_bytes",
            "max_batch_messages",
            "max_next_batch",
            "store_stream_window",
            "store_stream_idle_s",
            "follow_feed_bytes",
            "follow_max_subscriptions",
            "follow_max_batch",
            "max_request_bytes",
            "max_answer_bytes",
            "grpc_workers",
            "block_cache_bytes",
            "write_buffer_bytes",
            "maintenance_interval_s",
            "disk_check_interval_s",
            "replication_factor",
            "raft_heartbeat_s",
            "raft_pass_threads",
            "raft_long_step_threads",
            "raft_log_max_bytes",
            "raft_segment_bytes",
            "raft_compaction_interval_s",
            "ready_max_apply_stall_s",
            "write_timeout_s",
            "read_timeout_s",
            "max_concurrent_rpcs",
            "max_public_calls",
            "max_public_streams",
            "digest_rate_bytes",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be greater than 0, got {getattr(self, name)}")
        # A follower then hears its leader at least every 1.5 heartbeats:
        # twice within the shortest election timeout.
        if not 0 <= self.raft_heartbeat_linger_s <= self.raft_heartbeat_s / 2:
            raise ConfigError(
                f"raft_heartbeat_linger_s must be between 0 and half of raft_heartbeat_s "
                f"({self.raft_heartbeat_s / 2:g}), got {self.raft_heartbeat_linger_s}"
            )
        if self.raft_election_timeout_s < 3 * self.raft_heartbeat_s:
            raise ConfigError(
                f"raft_election_timeout_s ({self.raft_election_timeout_s}) must be at least three heartbeats "
                f"(raft_heartbeat_s = {self.raft_heartbeat_s})"
            )
        if self.max_concurrent_rpcs < self.grpc_workers:
            raise ConfigError(
                f"max_concurrent_rpcs ({self.max_concurrent_rpcs}) must be at least grpc_workers ({self.grpc_workers})"
            )
        self._check_worker_caps()
        self._check_open_api()
        if self.auth_tokens_file:
            from mqds.server.auth import TokenFileError, load_tokens

            try:
                load_tokens(self.auth_tokens_file)
            except TokenFileError as err:
                raise ConfigError(str(err)) from None
        for name in (
            "generation_interval_s",
            "retention_period_s",
            "retention_check_interval_s",
            "shutdown_grace_s",
            "leader_balance_interval_s",
            "placement_repair_interval_s",
            "max_calls_per_client",
            "disk_quota_bytes",
            "disk_min_free_bytes",
            "session_expiry_default_s",
            "consumer_lag_metric_top",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.fault_clock_offset_s and not self.fault_injection:
            raise ConfigError("fault_clock_offset_s skews the node's clock for chaos tests: it needs fault_injection")
        if self.n_shards > 4096:
            raise ConfigError(f"n_shards {self.n_shards} is more than the supported 4096")
        if self.max_payload_bytes + 65_536 > self.max_request_bytes:
            raise ConfigError(
                f"max_request_bytes ({self.max_request_bytes}) must exceed max_payload_bytes "
                f"({self.max_payload_bytes}) by at least 65536"
            )
        if self.max_answer_bytes > self.max_request_bytes:
            raise ConfigError(
                f"max_answer_bytes ({self.max_answer_bytes}) must be at most max_request_bytes "
                f"({self.max_request_bytes}): an answer carries one message over it at most, and must still fit "
                "the node's send limit"
            )
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level {self.log_level!r}: use DEBUG, INFO, WARNING or ERROR")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format {self.log_format!r}: use text or json")
        return self

    def _check_worker_caps(self) -> None:
        """Public calls may never hold every worker: the rest serve internal calls and refusals.

        The peers' Raft streams do not count: they run on threads of their own
        (``Node``), so the check holds however many nodes the cluster grows to
        (it once counted the founders' streams, and a sixth node joining a
        cluster of defaults refused to start).
        """
        if self.grpc_workers - self.max_public_calls < _SPARE_WORKERS:
            raise ConfigError(
                f"grpc_workers ({self.grpc_workers}) must exceed max_public_calls ({self.max_public_calls}) by at "
                f"least {_SPARE_WORKERS}: those workers serve internal calls and refusals while clients keep "
                f"max_public_calls busy; raise grpc_workers or lower max_public_calls"
            )
        if self.max_calls_per_client > self.max_public_calls:
            raise ConfigError(
                f"max_calls_per_client ({self.max_calls_per_client}) must not exceed max_public_calls "
                f"({self.max_public_calls}): one client could otherwise take every public slot"
            )

    def _check_open_api(self) -> None:
        """Secure by default: a public API that authenticates no caller is served on loopback only."""
        if self.auth_tokens_file or self.insecure_open_api or self.dev_mode or is_loopback(self.listen):
            return
        raise ConfigError(
            f"listen {self.listen!r} can be reached from other machines and auth_tokens_file is not set: anyone "
            "who reaches the port could read and write every message. Set auth_tokens_file (a file of "
            "'<role> <token>' lines, e.g. MQDS_AUTH_TOKENS_FILE), listen on 127.0.0.1, or set insecure_open_api "
            "(MQDS_INSECURE_OPEN_API=true) to serve an open API on purpose"
        )

    @property
    def raft_tcp_listen(self) -> str:
        """Where the Raft TCP listener binds: raft_listen, or the host of listen with any free port."""
        return self.raft_listen or f"{self.listen.rpartition(':')[0]}:0"

    @property
    def tls(self) -> bool:
        """True when the gRPC port serves TLS."""
        return bool(self.tls_cert_file)

    def _check_tls(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file go together: set both to serve TLS, or neither")
        if not self.tls_cert_file:
            for name in ("tls_ca_file", "tls_client_ca_file"):
                if getattr(self, name):
                    raise ConfigError(f"{name} needs TLS: set tls_cert_file and tls_key_file too")
            return
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file", "tls_client_ca_file"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{name} {path}: no such file, or not readable")
        try:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except ssl.SSLError as err:
            raise ConfigError(
                f"tls_cert_file {self.tls_cert_file} and tls_key_file {self.tls_key_file} are not a PEM "
                f"certificate and its private key: {err.reason or err}"
            ) from None
        for name in ("tls_ca_file", "tls_client_ca_file"):
            path = getattr(self, name)
            if not path:
                continue
            try:
                context.load_verify_locations(cafile=path)
            except ssl.SSLError as err:
                raise ConfigError(f"{name} {path} holds no PEM CA certificate: {err.reason or err}") from None

    @property
    def advertised(self) -> str:
        """The address peers and clients use for this node."""
        return self.advertise or self.listen

    def peer_map(self) -> dict[str, str]:
        """``peers`` parsed: node id -> address (empty when the node is alone)."""
        return parse_peers(self.peers)

    def to_toml(self) -> str:
        """The settings as a TOML document that ``--config`` accepts."""
        lines = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "cluster_secret" and value:
                lines.append(f"# {f.metadata['help']}\n# cluster_secret is set (not shown)")
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = f'"{value}"'
            else:
                text = repr(value)
            lines.append(f"# {f.metadata['help']}\n{f.name} = {text}")
        return "\n".join(lines) + "\n"


_FIELDS = {f.name: f for f in dataclasses.fields(NodeConfig)}
_SETTINGS = SettingsReader(dataclasses.fields(NodeConfig))
# Workers kept from public calls, at least: internal calls and refusals.
_SPARE_WORKERS = 8


def _is_address(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def parse_peers(text: str) -> dict[str, str]:
    """``"n1=h:1,n2=h:2"`` -> ``{"n1": "h:1", "n2": "h:2"}``, with a ConfigError naming a bad item.

    >>> parse_peers("n1=127.0.0.1:7101, n2=127.0.0.1:7102")
    {'n1': '127.0.0.1:7101', 'n2': '127.0.0.1:7102'}
    """
    peers: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        node_id, sep, address = item.partition("=")
        node_id, address = node_id.strip(), address.strip()
        if not sep or not node_id or not all(c.isalnum() or c in "-_." for c in node_id):
            raise ConfigError(f"peers: {item!r} is not id=host:port")
        if not _is_address(address):
            raise ConfigError(f"peers: {item!r}: expected host:port with a port from 1 to 65535")
        if node_id in peers:
            raise ConfigError(f"peers: node {node_id!r} is listed twice")
        peers[node_id] = address
    return peers


def build_parser(prog: str = "mqds-server") -> argparse.ArgumentParser:
    """``mqds-server``'s command line: --config, --print-config and a flag per setting, grouped by topic."""
    return cli.build_parser(dataclasses.fields(NodeConfig), prog)


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[NodeConfig, argparse.Namespace]:
    """Parse flags, read the file and the environment; return the validated config."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    flags = {name: getattr(args, name) for name in _FIELDS if getattr(args, name) is not None}
    config_file = args.config or environ.get(ENV_PREFIX + "CONFIG")
    return NodeConfig(**_SETTINGS.read(flags, environ, config_file or None)).validate(), args
