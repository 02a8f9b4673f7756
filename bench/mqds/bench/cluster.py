"""Replicated write throughput: a 3-node, 3-replica cluster against one node with one replica.

``python -m mqds.bench.cluster`` (or ``make bench-cluster``) starts the
clusters itself, as real ``mqds-server`` processes on loopback, and drives each
with several publisher processes (the load generator of :mod:`mqds.bench`,
which ``mqds bench`` also uses). Each publisher stores 100-byte messages in
batches of 1,000 under its own clientid, as fast as acknowledgements come
back, for ``--duration`` seconds. A publisher sends pre-serialised requests
straight to its shard's leader (following NOT_LEADER hints), so the client's
own cost stays small next to the cluster's. It prints, per setup:
acknowledged messages/s, p50/p99/p999 ``StoreBatch`` latency, and the CPU
time the servers used per 1,000 acknowledged messages (user and system time
of their processes over the whole run, a steadier figure than throughput on a
shared machine); then the
latency at half the replicated throughput (paced publishers), and at half the
throughput target (``--target-rate``, 50,000 msg/s by default); then the time
writes to a vnode fail when its leader is killed with ``kill -9``; then the
ratio of replicated to single-replica throughput. ``--json`` prints one JSON
object instead.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mqds.bench.load import LeaderKill, RunResult, publisher_ids, run_load
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster


def _line(result: RunResult, cpu_ms: float) -> str:
    return (
        f"  {result.acked_msgs_per_s:>10,.0f} msg/s acknowledged   p50 {result.p50_ms:.1f} ms   "
        f"p99 {result.p99_ms:.1f} ms   p999 {result.p999_ms:.1f} ms   "
        f"server CPU {cpu_ms:.1f} ms per 1,000 msgs"
    )


def _cpu_s(cluster: LocalCluster) -> float:
    """User plus system CPU seconds the cluster's server processes have used so far (Linux ``/proc``)."""
    ticks = 0
    for proc in cluster.nodes.values():
        if proc.pid is None:
            continue
        try:
            with open(f"/proc/{proc.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # killed meanwhile
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mqds.bench.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per measurement (default 20)")
    parser.add_argument("--publishers", type=int, default=8, help="concurrent publisher processes (default 8)")
    parser.add_argument("--batch", type=int, default=1000, help="messages per StoreBatch (default 1000)")
    parser.add_argument("--size", type=int, default=100, help="payload bytes per message (default 100)")
    parser.add_argument("--shards", type=int, default=16, help="shards of the clusters started (default 16)")
    parser.add_argument(
        "--target-rate",
        type=float,
        default=100_000,
        help="also measure latency paced at half this rate, in msg/s (default 100000, the throughput target; 0 = skip)",
    )
    parser.add_argument("--skip-baseline", action="store_true", help="do not measure the single-replica node")
    parser.add_argument("--skip-failover", action="store_true", help="do not kill a leader")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--keep", metavar="DIR", help="put the clusters' data and logs in DIR and keep them")
    opts = parser.parse_args(argv)

    base = Path(opts.keep) if opts.keep else Path(tempfile.mkdtemp(prefix="mqds-bench-"))
    report: dict[str, Any] = {"publishers": opts.publishers, "batch": opts.batch, "size": opts.size}

    def say(text: str) -> None:
        if not opts.json:
            print(text, flush=True)

    def measure(key: str, cluster: LocalCluster, rate_msgs_per_s: float = 0.0) -> RunResult:
        """One load run against ``cluster``: print it, with the servers' CPU per 1,000 messages, and report it."""
        before = _cpu_s(cluster)
        result = run_load(
            cluster.addresses, opts.shards, opts.publishers, opts.batch, opts.size, opts.duration, rate_msgs_per_s
        )
        acked = result.acked_msgs_per_s * (result.end_at - result.start_at)
        cpu_ms = (_cpu_s(cluster) - before) * 1e6 / acked if acked else 0.0
        say(_line(result, cpu_ms))
        report[key] = {**result.__dict__, "server_cpu_ms_per_1000": cpu_ms}
        return result

    say(f"mqds replicated write benchmark: {opts.publishers} publishers, batches of {opts.batch} x {opts.size} B")
    with LocalCluster(base / "r3", 3, n_shards=opts.shards, replication_factor=3) as cluster:
        cluster.start()
        say("3 nodes, replication factor 3 (fsync on a majority before every acknowledgement) ...")
        r3 = measure("r3", cluster)
        half = r3.acked_msgs_per_s / 2
        say(f"same cluster, paced at half that ({half:,.0f} msg/s) ...")
        measure("r3_half_load", cluster, half)
        if opts.target_rate:
            # Half the measured rate moves with the machine's speed (in a fast
            # hour it is a heavier load than the target's half); this one does not.
            half_target = opts.target_rate / 2
            say(f"same cluster, paced at half the {opts.target_rate:,.0f} msg/s target ({half_target:,.0f} msg/s) ...")
            measure("r3_half_target", cluster, half_target)
        if not opts.skip_failover:
            victim_shard = shard_of(publisher_ids(opts.publishers, opts.shards)[0], opts.shards)
            kill = LeaderKill(victim_shard, lambda: cluster.wait_for_leader(victim_shard), cluster.kill)
            say(f"kill -9 of the leader of shard {victim_shard} under load ...")
            fo = run_load(
                cluster.addresses, opts.shards, opts.publishers, opts.batch, opts.size, opts.duration, during=kill
            )
            failover_s = kill.failover_s(fo)
            say(f"  writes to shard {victim_shard} resumed {failover_s:.2f} s after {kill.victim} was killed")
            report["failover_s"] = failover_s
    if not opts.skip_baseline:
        with LocalCluster(base / "r1", 1, n_shards=opts.shards, replication_factor=1) as single:
            single.start()
            say("1 node, replication factor 1 (the storage layer behind the same API) ...")
            r1 = measure("r1", single)
            report["ratio_r3_to_r1"] = r3.acked_msgs_per_s / r1.acked_msgs_per_s
            say(f"ratio replicated / single replica: {report['ratio_r3_to_r1']:.0%}")
    report["acked_msgs_per_s"] = r3.acked_msgs_per_s
    report["p50_ms"] = r3.p50_ms
    report["p99_ms"] = r3.p99_ms
    if opts.json:
        for key in ("r3", "r3_half_load", "r3_half_target", "r1"):
            if key in report:
                for extra in ("outages", "failed_batches", "start_at", "end_at"):
                    report[key].pop(extra, None)
        print(json.dumps(report, indent=2))
    if not opts.keep:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
