"""The command line of ``mqds-server``: one flag per setting, grouped by topic, with metavars and defaults.

Every flag takes its value as text; the settings loader parses it like the
same value from the environment, so ``--raft-log-max-bytes 16MiB`` and
``MQDS_RAFT_LOG_MAX_BYTES=16MiB`` mean the same.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from typing import Any

from mqds.server.config.units import format_duration, format_size, kind_of

# Topic -> settings, in the order --help shows them; a setting in no group lands in the last one.
GROUPS: dict[str, tuple[str, ...]] = {
    "node and network": (
        "node_id",
        "listen",
        "advertise",
        "data_dir",
        "peers",
        "n_shards",
        "replication_factor",
    ),
    "security": (
        "cluster_secret",
        "dev_mode",
        "tls_cert_file",
        "tls_key_file",
        "tls_ca_file",
        "tls_client_ca_file",
        "auth_tokens_file",
        "insecure_open_api",
    ),
    "Raft replication": (
        "raft_transport",
        "raft_listen",
        "raft_heartbeat_s",
        "raft_heartbeat_linger_s",
        "raft_pass_threads",
        "raft_long_step_threads",
        "raft_election_timeout_s",
        "raft_log_max_bytes",
        "raft_segment_bytes",
        "raft_compaction_interval_s",
        "write_timeout_s",
        "read_timeout_s",
        "leader_balance_interval_s",
        "placement_repair_interval_s",
    ),
    "storage": (
        "generation_interval_s",
        "retention_period_s",
        "maintenance_interval_s",
        "session_expiry_default_s",
        "lts_threshold_top",
        "lts_threshold",
        "block_cache_bytes",
        "write_buffer_bytes",
        "compaction_low_priority",
        "disk_quota_bytes",
        "disk_min_free_bytes",
        "disk_check_interval_s",
    ),
    "limits": (
        "max_calls_per_client",
        "max_public_calls",
        "max_public_streams",
        "max_concurrent_rpcs",
        "digest_rate_bytes",
        "grpc_workers",
        "max_payload_bytes",
        "max_batch_messages",
        "max_next_batch",
        "max_request_bytes",
        "max_answer_bytes",
        "store_stream_window",
        "store_stream_idle_s",
        "follow_feed_bytes",
        "follow_max_subscriptions",
        "follow_max_batch",
        "shutdown_grace_s",
    ),
    "health and metrics": (
        "metrics_listen",
        "ready_max_lag_entries",
        "ready_max_apply_stall_s",
        "consumer_lag_metric_top",
    ),
    "logging": ("log_level", "log_format"),
    "fault injection (tests and chaos runs only)": ("fault_injection", "fault_clock_offset_s"),
}

_METAVARS = {
    "listen": "HOST:PORT",
    "advertise": "HOST:PORT",
    "metrics_listen": "HOST:PORT",
    "raft_listen": "HOST:PORT",
    "raft_transport": "{tcp,grpc}",
    "peers": "ID=HOST:PORT,...",
    "data_dir": "DIR",
    "node_id": "ID",
    "cluster_secret": "SECRET",
    "log_level": "LEVEL",
    "log_format": "{text,json}",
}
_KIND_METAVARS = {"size": "SIZE", "duration": "DURATION", "bool": "BOOL", "int": "N", "float": "NUMBER"}


def metavar(name: str, default: Any) -> str:
    if name in _METAVARS:
        return _METAVARS[name]
    if name.endswith("_file"):
        return "FILE"
    return _KIND_METAVARS.get(kind_of(name, default), "TEXT")


def show_default(name: str, default: Any) -> str:
    kind = kind_of(name, default)
    if kind == "size":
        return format_size(default)
    if kind == "duration":
        return format_duration(default)
    if kind == "bool":
        return "true" if default else "false"
    if default == "":
        return "empty"
    return str(default)


def build_parser(fields: Iterable[dataclasses.Field[Any]], prog: str = "mqds-server") -> argparse.ArgumentParser:
    """The parser of ``mqds-server``: --config, --print-config and one flag per setting (value as text)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [-h] [--config FILE] [--print-config] [--SETTING VALUE ...]",
        description=(
            "Run an mqds node: a gRPC server that stores MQTT messages in RocksDB and replays them. "
            "Settings come from defaults, then --config FILE (TOML), then MQDS_<NAME> environment "
            "variables, then these flags. SIZE is a number of bytes or a number with a unit (16MiB, "
            "512KiB, 1GB); DURATION is a number of seconds or a number with a unit (250ms, 30s, 5m, 1h)."
        ),
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with settings (also MQDS_CONFIG)")
    parser.add_argument("--print-config", action="store_true", help="print the effective settings as TOML and exit")
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    group_of = {name: title for title, names in GROUPS.items() for name in names}
    order = {name: i for i, name in enumerate(group_of)}
    last = list(groups.values())[-1]
    for f in sorted(fields, key=lambda f: order.get(f.name, len(order))):
        group = groups[group_of[f.name]] if f.name in group_of else last
        is_bool = type(f.default) is bool
        extra: dict[str, Any] = {"nargs": "?", "const": True} if is_bool else {}
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            metavar=metavar(f.name, f.default),
            help=f"{f.metadata['help']} (default: {show_default(f.name, f.default)})".replace("%", "%%"),
            **extra,
        )
    return parser
