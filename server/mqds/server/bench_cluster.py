"""Replicated write throughput: a 3-node, 3-replica cluster against one node with one replica.

``python -m mqds.server.bench_cluster`` (or ``make bench-cluster``) starts the
clusters itself, as real ``mqds-server`` processes on loopback, and drives each
with several publisher processes. Each publisher stores 100-byte messages in
batches of 1,000 under its own clientid, as fast as acknowledgements come
back, for ``--duration`` seconds. A publisher sends pre-serialised requests
straight to its shard's leader (following NOT_LEADER hints), so the client's
own cost stays small next to the cluster's. It prints, per setup:
acknowledged messages/s, p50/p99/p999 ``StoreBatch`` latency; then the
latency at half the replicated throughput (paced publishers); then the time
writes to a vnode fail when its leader is killed with ``kill -9``; then the
ratio of replicated to single-replica throughput. ``--json`` prints one JSON
object instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from mqds.client.routing import Router
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.sharding import shard_of
from mqds.server.localproc import LocalCluster
from mqds.v1 import storage_pb2 as pb

STORE_METHOD = "/mqds.v1.Storage/StoreBatch"


def publisher_ids(count: int, n_shards: int) -> list[str]:
    """Clientids that fall on distinct shards (as far as there are shards), so load spreads."""
    chosen: list[str] = []
    used: set[int] = set()
    i = 0
    while len(chosen) < count:
        name = f"bench-pub-{i}"
        shard = shard_of(name, n_shards)
        if shard not in used or len(used) >= n_shards:
            chosen.append(name)
            used.add(shard)
        i += 1
    return chosen


def _request(sender: str, batch: int, size: int) -> bytes:
    payload = os.urandom(size)
    request = pb.StoreBatchRequest(sync=True)
    for i in range(batch):
        request.messages.add(topic=f"bench/{sender}/{i % 100}", payload=payload, sender=sender, qos=1)
    return request.SerializeToString()


def _publish(args: tuple[list[str], str, int, int, int, float, float, float, Any]) -> dict[str, Any]:
    """One publisher process: store batches until the end time; latencies and failures."""
    addresses, sender, n_shards, batch, size, start_at, end_at, interval_s, results = args
    raw = _request(sender, batch, size)
    shard = shard_of(sender, n_shards)
    router = Router(
        addresses,
        channel_options=[("grpc.max_send_message_length", 64 << 20), ("grpc.initial_reconnect_backoff_ms", 100)],
    )

    def leader() -> str:
        with contextlib.suppress(MqdsError):
            router.refresh(2, force=True)
        return router.leader_of(shard) or addresses[0]

    def call(address: str) -> Any:
        return router.channel(address).unary_unary(STORE_METHOD, request_serializer=None, response_deserializer=None)

    address = leader()
    latencies: list[float] = []
    outages: list[tuple[float, float]] = []
    failing_since: float | None = None
    while time.time() < start_at:
        time.sleep(0.001)
    # Paced publishers spread their sends over the interval instead of all
    # sending at the same instant.
    next_at = time.monotonic() + interval_s * (zlib.crc32(sender.encode()) % 1000) / 1000
    while time.time() < end_at:
        if interval_s:
            next_at += interval_s
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        t0 = time.perf_counter()
        try:
            call(address)(raw, timeout=10)
        except grpc.RpcError as rpc_err:
            err = errors.from_rpc_error(rpc_err)
            if failing_since is None:
                failing_since = time.time()
            if err.reason is Reason.NOT_LEADER and router.learn(err, shard):
                address = router.leader_of(shard) or address
            else:
                time.sleep(0.05)
                address = leader()
            continue
        latencies.append(time.perf_counter() - t0)
        if failing_since is not None:
            outages.append((failing_since, time.time()))
            failing_since = None
    router.close()
    out = {"sender": sender, "shard": shard, "latencies": latencies, "outages": outages, "batch": batch}
    results.put(out)
    return out


@dataclass
class RunResult:
    acked_msgs_per_s: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    batches: int
    outages: list[tuple[str, int, float, float]]


def run_load(
    addresses: list[str],
    n_shards: int,
    publishers: int,
    batch: int,
    size: int,
    duration_s: float,
    rate_msgs_per_s: float = 0.0,
    during: Any = None,
) -> RunResult:
    senders = publisher_ids(publishers, n_shards)
    ctx = mp.get_context("spawn")
    results = ctx.Manager().Queue()
    start_at = time.time() + 2.0
    end_at = start_at + duration_s
    interval = (batch * publishers / rate_msgs_per_s) if rate_msgs_per_s else 0.0
    procs = [
        ctx.Process(
            target=_publish,
            args=((addresses, s, n_shards, batch, size, start_at, end_at, interval, results),),
            daemon=True,
        )
        for s in senders
    ]
    for p in procs:
        p.start()
    if during is not None:
        while time.time() < start_at + duration_s / 3:
            time.sleep(0.05)
        during()
    collected = [results.get(timeout=duration_s + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    latencies = sorted(x for r in collected for x in r["latencies"])
    batches = len(latencies)
    if not latencies:
        raise RuntimeError("no batch was acknowledged")

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    outages = [(r["sender"], r["shard"], a, b) for r in collected for a, b in r["outages"]]
    return RunResult(batches * batch / duration_s, pct(0.5), pct(0.99), pct(0.999), batches, outages)


def _line(result: RunResult) -> str:
    return (
        f"  {result.acked_msgs_per_s:>10,.0f} msg/s acknowledged   p50 {result.p50_ms:.1f} ms   "
        f"p99 {result.p99_ms:.1f} ms   p999 {result.p999_ms:.1f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mqds.server.bench_cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per measurement (default 20)")
    parser.add_argument("--publishers", type=int, default=8, help="concurrent publisher processes (default 8)")
    parser.add_argument("--batch", type=int, default=1000, help="messages per StoreBatch (default 1000)")
    parser.add_argument("--size", type=int, default=100, help="payload bytes per message (default 100)")
    parser.add_argument("--shards", type=int, default=16, help="shards of the clusters started (default 16)")
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

    say(f"mqds replicated write benchmark: {opts.publishers} publishers, batches of {opts.batch} x {opts.size} B")
    with LocalCluster(base / "r3", 3, n_shards=opts.shards, replication_factor=3) as cluster:
        cluster.start()
        say("3 nodes, replication factor 3 (fsync on a majority before every acknowledgement) ...")
        r3 = run_load(cluster.addresses, opts.shards, opts.publishers, opts.batch, opts.size, opts.duration)
        say(_line(r3))
        report["r3"] = r3.__dict__
        half = r3.acked_msgs_per_s / 2
        say(f"same cluster, paced at half that ({half:,.0f} msg/s) ...")
        paced = run_load(cluster.addresses, opts.shards, opts.publishers, opts.batch, opts.size, opts.duration, half)
        say(_line(paced))
        report["r3_half_load"] = paced.__dict__
        if not opts.skip_failover:
            victim_shard = shard_of(publisher_ids(opts.publishers, opts.shards)[0], opts.shards)
            victim = cluster.wait_for_leader(victim_shard)
            killed: dict[str, float] = {}

            def kill() -> None:
                killed["at"] = time.time()
                cluster.kill(victim)

            say(f"kill -9 {victim}, the leader of shard {victim_shard}, under load ...")
            fo = run_load(
                cluster.addresses, opts.shards, opts.publishers, opts.batch, opts.size, opts.duration, during=kill
            )
            outage = [b - killed["at"] for _, shard, a, b in fo.outages if shard == victim_shard and b >= killed["at"]]
            failover_s = max(outage) if outage else 0.0
            say(f"  writes to shard {victim_shard} resumed {failover_s:.2f} s after the kill")
            report["failover_s"] = failover_s
    if not opts.skip_baseline:
        with LocalCluster(base / "r1", 1, n_shards=opts.shards, replication_factor=1) as single:
            single.start()
            say("1 node, replication factor 1 (the storage layer behind the same API) ...")
            r1 = run_load(single.addresses, opts.shards, opts.publishers, opts.batch, opts.size, opts.duration)
            say(_line(r1))
            report["r1"] = r1.__dict__
            report["ratio_r3_to_r1"] = r3.acked_msgs_per_s / r1.acked_msgs_per_s
            say(f"ratio replicated / single replica: {report['ratio_r3_to_r1']:.0%}")
    report["acked_msgs_per_s"] = r3.acked_msgs_per_s
    report["p50_ms"] = r3.p50_ms
    report["p99_ms"] = r3.p99_ms
    if opts.json:
        for key in ("r3", "r3_half_load", "r1"):
            if key in report:
                report[key].pop("outages", None)
        print(json.dumps(report, indent=2))
    if not opts.keep:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
