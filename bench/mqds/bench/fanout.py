"""``mqds bench --subscribers N[,N...]``: push subscribers of one filter while the cluster stores a steady load.

For each N in turn: N push subscribers (``Storage.Follow`` on ``bench/#``,
every shard, from now on, spread over ``--subscriber-processes`` processes,
each shard read from its leader) while ``--publishers`` processes store
``--rate`` messages a second in batches of ``--batch`` on topics under it,
for ``--duration`` seconds. Per N it prints the acknowledged and the
delivered messages a second, the delivery latency from acknowledgement to
delivery (p50/p99: a message's arrival less the moment its publisher had the
answer to the call that stored it) and from storing to delivery (arrival less
the timestamp its shard's leader gave it before the commit: the commit's own
latency too), the nodes' CPU per 1,000 delivered messages (when the command
controls the nodes: ``--start-cluster`` or ``--data-dir``) and the nodes'
memory. Every message counts once for each subscription it was delivered
to, at its own latency (``mqds.bench.fanout_load.delivery_latencies``). ``--json``: one object, the
largest N's figures at the top (``delivered_msgs_per_s``, ``delivery_p50_ms``,
``delivery_p99_ms``, ``server_cpu_ms_per_1000_delivered``) and every N under
``runs`` (with ``stored_delivery_p50_ms`` and ``stored_delivery_p99_ms``).

The subscriptions take shared answers (``FollowStart.shared_answers``): the
node sends one answer for all of a call's subscriptions at the same place.
``--separate-answers`` measures one answer per subscription instead, as
clients that do not read ``also`` get them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import queue
import time
from pathlib import Path
from typing import Any

from mqds.bench.fanout_load import WINDOW, SubscriberSpec, delivery_latencies, subscribe
from mqds.bench.load import TOPIC_PREFIX, run_load, shard_places
from mqds.bench.mqtt import _cpu_total
from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, connection
from mqds.client import Client, Message
from mqds.client.connection import parse_endpoints
from mqds.protocol.sharding import shard_of
from mqds.tools import cluster_command

DEFAULT_RATE = 20_000.0
DEFAULT_DURATION_S = 10.0
# What one Follow call of the benchmark carries at most (the node's follow_max_subscriptions is 10,000).
PER_CALL = 10_000
STARTED_TIMEOUT_S = 600.0
"""How long the subscriptions may take to start (each gets one message) before the load."""


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CommandError(f"--subscribers takes numbers separated by commas, got {text!r}", EXIT_USAGE) from None
    if not counts or min(counts) < 1:
        raise CommandError("--subscribers takes one or more counts of at least 1 (e.g. 1,100,1000)", EXIT_USAGE)
    return counts


def weighted_pct_ms(ordered: list[tuple[float, int]], q: float) -> float:
    """The ``q`` quantile, in milliseconds, of sorted (latency in seconds, deliveries it stands for) samples:
    an answer of 100 messages shared by 500 subscriptions weighs as 50,000 deliveries (0 when there are none)."""
    total = sum(weight for _, weight in ordered)
    if not total:
        return 0.0
    rank = q * total
    seen = 0
    for latency, weight in ordered:
        seen += weight
        if seen > rank:
            return latency * 1000
    return ordered[-1][0] * 1000


def _rss_mib(pids: list[int]) -> float | None:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return None
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total / 1024


def run(opts: argparse.Namespace) -> int:
    counts = parse_counts(opts.subscribers)
    if opts.subscriber_processes < 1:
        raise CommandError("--subscriber-processes must be at least 1", EXIT_USAGE)
    rate = opts.rate or DEFAULT_RATE
    duration = opts.duration or DEFAULT_DURATION_S
    settings = connection(opts, 30.0)
    runs = []
    with contextlib.ExitStack() as stack:
        cluster = cluster_command.for_benchmark(opts, stack, "mqds-bench-fanout-")
        endpoints = cluster.addresses if cluster is not None else parse_endpoints(opts.endpoints)
        node_pids = [] if cluster is None else [p.pid for p in cluster.nodes.values() if p.pid is not None]
        n_shards = _replicas(endpoints, settings)[1]
        if not opts.json:
            print(
                f"mqds bench --subscribers: {','.join(map(str, counts))} push subscribers of bench/# while "
                f"{opts.publishers} publishers store {rate:,.0f} msg/s ({opts.batch}-message batches of "
                f"{opts.size} B), {duration:g} s each, {len(endpoints)} node(s), {n_shards} vnodes",
                flush=True,
            )
        for n in counts:
            replicas = _replicas(endpoints, settings)[0]
            figures = _one(opts, n, endpoints, replicas, n_shards, rate, duration, settings, node_pids)
            # A shard whose leader moved meanwhile was served by a follower from then on: later, not wrong.
            after = _replicas(endpoints, settings)[0]
            figures["leaders_moved"] = sum(after.get(shard) != where for shard, where in replicas.items())
            runs.append(figures)
            if not opts.json:
                cpu = figures["server_cpu_ms_per_1000_delivered"]
                rss = figures["node_rss_mib"]
                print(
                    f"  {n:>6,} subscribers  stored {figures['acked_msgs_per_s']:>9,.0f} msg/s  delivered "
                    f"{figures['delivered_msgs_per_s']:>11,.0f} msg/s  after the ack p50 "
                    f"{figures['delivery_p50_ms']:6.1f} ms p99 {figures['delivery_p99_ms']:6.1f} ms  after storing p50 "
                    f"{figures['stored_delivery_p50_ms']:6.1f} ms p99 {figures['stored_delivery_p99_ms']:6.1f} ms  "
                    f"(store calls' p99 {figures['store_p99_ms']:.0f} ms)  nodes' CPU "
                    + (f"{cpu:7.2f} ms/1,000 delivered" if cpu is not None else "-")
                    + (f"  nodes' memory {rss:,.0f} MiB" if rss is not None else "")
                    + f"  (started in {figures['start_s']:.1f} s)"
                    + (f"  ({figures['failures']} failures)" if figures["failures"] else "")
                    + (f"  (leaders of {figures['leaders_moved']} shards moved)" if figures["leaders_moved"] else "")
                    + (
                        f"  (stored {figures['acked_msgs_per_s'] / rate:.0%} of --rate: the publishers waited on "
                        "slower acknowledgements)"
                        if figures["acked_msgs_per_s"] < 0.95 * rate
                        else ""
                    ),
                    flush=True,
                )
    top = max(runs, key=lambda r: r["subscribers"])
    if opts.json:
        keys = (
            "delivered_msgs_per_s",
            "delivery_p50_ms",
            "delivery_p99_ms",
            "stored_delivery_p99_ms",
            "server_cpu_ms_per_1000_delivered",
        )
        print(json.dumps({"mode": "fanout", "rate": rate, **{k: top[k] for k in keys}, "runs": runs}, indent=2))
    elif len(runs) > 1 and runs[0]["server_cpu_ms_per_1000_delivered"] and top["server_cpu_ms_per_1000_delivered"]:
        ratio = top["server_cpu_ms_per_1000_delivered"] / runs[0]["server_cpu_ms_per_1000_delivered"]
        print(
            f"nodes' CPU per 1,000 delivered at {top['subscribers']:,} subscribers: {ratio:.4f} of the cost at "
            f"{runs[0]['subscribers']:,}"
        )
    return EXIT_OK


def _replicas(endpoints: list[str], settings: Any) -> tuple[dict[int, list[str]], int]:
    """Where the subscribers read each shard (its leader now), and the number of shards.

    From the leader: a follower applies what is committed only when the
    leader's next message says so (the next store, or within
    ``raft_heartbeat_s``), which would be counted as delivery latency.
    """
    found = shard_places(endpoints, settings)
    if found is None:
        raise CommandError(f"no node of {', '.join(endpoints)} answered with the cluster's map")
    return found


def _wait_delivered(delivered: Any, expected: int, timeout_s: float = 15.0) -> None:
    """Until every subscriber has what was stored, or the count stopped growing for 2 s (``timeout_s`` at most)."""
    deadline = time.monotonic() + timeout_s
    last, last_change = -1, time.monotonic()
    while time.monotonic() < deadline and delivered.value < expected:
        if delivered.value != last:
            last, last_change = delivered.value, time.monotonic()
        elif time.monotonic() - last_change > 2.0:
            return
        time.sleep(0.1)


def _wait_started(endpoints: list[str], settings: Any, warm: Any, n: int, n_shards: int, quiet: bool) -> float:
    """Store one message on each shard and wait until every subscription has it: all are started and at the
    head, so what follows measures delivery, not starting. Returns the seconds it took; unless ``quiet``, says
    how many have started every 5 s while it waits.
    """
    began = time.monotonic()
    senders: dict[int, str] = {}
    for i in itertools.count():
        senders.setdefault(shard_of(f"warm-{i}", n_shards), f"warm-{i}")
        if len(senders) == n_shards:
            break
    with Client(endpoints, settings=settings) as client:
        client.store_batch([Message(f"{TOPIC_PREFIX}/warm", b"warm", sender, 1) for sender in senders.values()])
    expected = n * n_shards
    deadline = began + STARTED_TIMEOUT_S
    said_at = began
    while warm.value < expected:
        now = time.monotonic()
        if now > deadline:
            raise CommandError(
                f"only {warm.value:,} of {expected:,} subscriptions started within {STARTED_TIMEOUT_S:.0f} s "
                "(nodes of a version before FollowStart.also start only the first of each start)"
            )
        if not quiet and now - said_at >= 5:
            said_at = now
            print(f"  waiting for the subscriptions to start: {warm.value:,} of {expected:,}", flush=True)
        time.sleep(0.1)
    return time.monotonic() - began


def _one(
    opts: argparse.Namespace,
    n: int,
    endpoints: list[str],
    replicas: dict[int, list[str]],
    n_shards: int,
    rate: float,
    duration: float,
    settings: Any,
    node_pids: list[int],
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    processes = min(n, opts.subscriber_processes)
    start_us = int(time.time() * 1e6)
    with ctx.Manager() as manager:
        shared = argparse.Namespace(
            ready=manager.Queue(),
            go=manager.Event(),
            stop=manager.Event(),
            results=manager.Queue(),
            delivered=ctx.Value("q", 0),
            warm=ctx.Value("q", 0),
        )
        specs = []
        first = 0
        for i in range(processes):
            count = n // processes + (1 if i < n % processes else 0)
            specs.append(
                SubscriberSpec(first, count, replicas, start_us, WINDOW, PER_CALL, settings, not opts.separate_answers)
            )
            first += count
        procs = [ctx.Process(target=subscribe, args=((spec, shared),), daemon=True) for spec in specs]
        for p in procs:
            p.start()
        try:
            for _ in procs:
                try:
                    shared.ready.get(timeout=300)
                except queue.Empty:
                    raise CommandError(f"the subscriber processes did not start for {n} subscribers") from None
            started_s = _wait_started(endpoints, settings, shared.warm, n, n_shards, opts.json)
            shared.go.set()
            cpu_before = _cpu_total(node_pids) if node_pids else None
            result = run_load(
                endpoints,
                n_shards,
                opts.publishers,
                opts.batch,
                opts.size,
                duration,
                rate,
                settings=settings,
                record_acks=True,
            )
            _wait_delivered(shared.delivered, result.acked_msgs * n)
            cpu_after = _cpu_total(node_pids) if node_pids else None
            rss = _rss_mib(node_pids) if node_pids else None
            shared.stop.set()
            reports = [shared.results.get(timeout=120) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    delivered = sum(r["delivered"] for r in reports)
    last = max((r["last_at"] for r in reports), default=result.start_at)
    from_ack, from_stored = delivery_latencies([tuple(x) for r in reports for x in r["samples"]], result.acks)
    cpu = None
    if cpu_before is not None and cpu_after is not None and delivered:
        cpu = round((cpu_after - cpu_before) * 1000 / delivered * 1000, 3)
    return {
        "subscribers": n,
        "acked_msgs_per_s": round(result.acked_msgs_per_s, 1),
        # From the start of the load until the last delivery (subscribers that fall behind catch up after
        # the load ends, for up to 15 s: that time counts too).
        "delivered_msgs_per_s": round(delivered / max(duration, last - result.start_at), 1),
        "expected_deliveries": result.acked_msgs * n,
        "delivered": delivered,
        "delivery_p50_ms": round(weighted_pct_ms(from_ack, 0.50), 2),
        "delivery_p99_ms": round(weighted_pct_ms(from_ack, 0.99), 2),
        "stored_delivery_p50_ms": round(weighted_pct_ms(from_stored, 0.50), 2),
        "stored_delivery_p99_ms": round(weighted_pct_ms(from_stored, 0.99), 2),
        "store_p99_ms": round(result.p99_ms, 2),
        # The share of sampled deliveries whose store call's acknowledgement was seen (the rest were retried).
        "ack_matched_share": round(sum(w for _, w in from_ack) / max(1, sum(w for _, w in from_stored)), 4),
        "server_cpu_ms_per_1000_delivered": cpu,
        "node_rss_mib": None if rss is None else round(rss, 1),
        "subscriber_cpu_s": round(sum(r["cpu_s"] for r in reports), 2),
        # Answers with messages the subscribers received (a shared answer once): with shared answers, about one
        # per stored call and subscriber call; many more when subscriptions fell out of their cohorts.
        "answers": sum(r["answers"] for r in reports),
        "start_s": round(started_s, 2),
        "failures": sum(r["failures"] for r in reports),
    }
