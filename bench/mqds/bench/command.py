"""``mqds bench``: write load against a running cluster; acknowledged messages/s, latency, replay speed."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mqds.bench import backup as bench_backup
from mqds.bench import fanout as bench_fanout
from mqds.bench import mqtt as bench_mqtt
from mqds.bench import sessions as bench_sessions
from mqds.bench import small as bench_small
from mqds.bench import storm as bench_storm
from mqds.bench.load import TOPIC_PREFIX, LeaderKill, RunResult, publisher_ids, run_load
from mqds.bench.mqtt import _cpu_total
from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, ProgressLine, bar, connection
from mqds.client import Client
from mqds.client.connection import parse_endpoints
from mqds.protocol.sharding import shard_of
from mqds.tools import cluster_command

if TYPE_CHECKING:
    from mqds.tools.local_cluster import LocalCluster

DEFAULT_DURATION_S = 10.0


def _replay(client: Client, since_us: int, objects: bool, node_pids: list[int]) -> tuple[int, float, dict[str, float]]:
    """Replay what the run wrote: in batches (``Client.replay_batches``), or a ``Message`` each (``replay``).

    The count, the seconds, and the CPU milliseconds per 1,000 messages of
    this process (``client``) and, given their process ids, of the nodes
    (``nodes``).
    """
    started = time.perf_counter()
    cpu_before, nodes_before = time.process_time(), _cpu_total(node_pids)
    if objects:
        count = sum(1 for _ in client.replay(f"{TOPIC_PREFIX}/#", since_us))
    else:
        count = sum(len(batch) for batch in client.replay_batches(f"{TOPIC_PREFIX}/#", since_us))
    took_s = time.perf_counter() - started
    per_1k = 1_000_000.0 / max(count, 1)  # seconds to ms, per 1,000 messages
    cpu = {"client": round((time.process_time() - cpu_before) * per_1k, 2)}
    nodes_after = _cpu_total(node_pids)
    if nodes_before is not None and nodes_after is not None:
        cpu["nodes"] = round((nodes_after - nodes_before) * per_1k, 2)
    return count, took_s, cpu


def _cpu_words(cpu: dict[str, float]) -> str:
    return "CPU per 1,000 messages: " + ", ".join(f"{who} {ms:.2f} ms" for who, ms in cpu.items())


def _storage_replay(messages: int, size: int) -> float | None:
    """The storage layer's own replay of as many messages (``python -m mqds.server.storage.bench --replay-only``).

    Run as a process of its own, on this machine, so the client never
    imports the server; None where the server package is not installed.
    """
    if importlib.util.find_spec("mqds.server") is None:
        return None
    command = [sys.executable, "-m", "mqds.server.storage.bench", "--replay-only", "--json"]
    command += ["--messages", str(messages), "--size", str(size)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise CommandError(f"the storage replay baseline failed: {done.stderr.strip()[-500:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["replay_msgs_per_s"])


def _report_replay(
    client: Client,
    since_us: int,
    size: int,
    node_pids: list[int],
    report: dict[str, object],
    say: Callable[[str], None],
) -> None:
    count, took_s, cpu = _replay(client, since_us, False, node_pids)
    rate = count / took_s if took_s > 0 else 0.0
    report["replayed_msgs"] = count
    report["replay_msgs_per_s"] = round(rate, 1)
    for who, ms in cpu.items():
        report[f"replay_{who}_cpu_ms_per_1000"] = ms
    say(f"replay        {rate:>12,.0f} msg/s  ({count:,} messages, '{TOPIC_PREFIX}/#' since the run began, in batches)")
    say(f"              {_cpu_words(cpu)}")
    count, took_s, cpu = _replay(client, since_us, True, node_pids)
    objects = count / took_s if took_s > 0 else 0.0
    report["replay_objects_msgs_per_s"] = round(objects, 1)
    say(f"  as objects  {objects:>12,.0f} msg/s  (a Message each: Client.replay; {_cpu_words(cpu)})")
    baseline_msgs = max(count, 1000)  # a run too short to measure still gets a baseline
    storage = _storage_replay(baseline_msgs, size)
    if storage is None:
        say("  storage     (not measured: the server package is not installed here)")
        return
    report["storage_replay_msgs_per_s"] = round(storage, 1)
    report["replay_vs_storage"] = round(rate / storage, 3)
    say(
        f"  storage     {storage:>12,.0f} msg/s  (one shard's storage layer replaying {baseline_msgs:,} stored "
        f"messages, this machine): client replay is {rate / storage:.0%} of it"
    )


def run(opts: argparse.Namespace) -> int:
    if opts.batch is None:
        opts.batch = 100 if opts.subscribers else 1000
    if opts.peer_anchors is None and (opts.peer_python or opts.peer_nats_server or opts.peer_args):
        raise CommandError("--peer-python, --peer-nats-server and --peer-args go with --peer-anchors DIR", EXIT_USAGE)
    if opts.peer_anchors is not None and not opts.small_writes:
        raise CommandError("--peer-anchors sets the peer beside the figures of --small-writes: add it", EXIT_USAGE)
    if opts.session_soak:
        return bench_sessions.run(opts)
    if opts.backup:
        return bench_backup.run(opts)
    if opts.reconnect_storm:
        if opts.start_cluster and opts.data_dir:
            raise CommandError("give --start-cluster or --data-dir, not both", EXIT_USAGE)
        return bench_storm.run(opts)
    if opts.mqtt and not opts.small_writes:
        return bench_mqtt.run(opts)
    for name in ("publishers", "batch", "nodes", "shards", "replication_factor"):
        if getattr(opts, name) < 1:
            raise CommandError(f"--{name.replace('_', '-')} must be at least 1", EXIT_USAGE)
    if opts.size < 0 or (opts.duration is not None and opts.duration <= 0) or opts.rate < 0:
        raise CommandError("--size and --rate must be 0 or more, --duration above 0", EXIT_USAGE)
    if opts.in_flight is not None and opts.in_flight < 1:
        raise CommandError("--in-flight must be at least 1", EXIT_USAGE)
    if opts.in_flight is not None and opts.rate:
        raise CommandError("--in-flight calls are not paced: give --rate or --in-flight, not both", EXIT_USAGE)
    if opts.start_cluster and opts.data_dir:
        raise CommandError("give --start-cluster or --data-dir, not both", EXIT_USAGE)
    if opts.subscribers:
        if opts.small_writes or opts.in_flight is not None or opts.kill_leader:
            raise CommandError("--subscribers runs its own load: no --small-writes, --in-flight or --kill-leader")
        return bench_fanout.run(opts)
    if opts.small_writes:
        return bench_small.run(opts)
    if opts.duration is None:
        opts.duration = DEFAULT_DURATION_S
    if opts.kill_leader and not (opts.start_cluster or opts.data_dir):
        raise CommandError(
            "--kill-leader kills a process, so it needs a cluster this command controls: "
            "--start-cluster, or --data-dir DIR of a cluster started with 'mqds cluster up'",
            EXIT_USAGE,
        )
    with contextlib.ExitStack() as stack:
        cluster = cluster_command.for_benchmark(opts, stack, "mqds-bench-")
        endpoints = cluster.addresses if cluster is not None else parse_endpoints(opts.endpoints)
        client = stack.enter_context(Client(endpoints, settings=connection(opts, 30.0)))
        return _bench(opts, client, endpoints, cluster)
    raise AssertionError("unreachable")


def _terms(client: Client) -> dict[int, int]:
    """Each vnode's Raft term as the cluster map has it now."""
    return {vnode.shard: vnode.term for vnode in client.cluster_map().vnodes}


def _bench(opts: argparse.Namespace, client: Client, endpoints: list[str], cluster: LocalCluster | None) -> int:
    n_shards = client.cluster_map().n_shards

    def say(text: str) -> None:
        if not opts.json:
            print(text, flush=True)

    say(
        f"mqds bench: {opts.publishers} publishers, batches of {opts.batch:,} x {opts.size} B, "
        f"{opts.duration:g} s against {len(endpoints)} node(s), {n_shards} vnodes"
        + (f", paced at {opts.rate:,.0f} msg/s" if opts.rate else "")
        + (f", {opts.in_flight} store_async calls in flight per publisher" if opts.in_flight else "")
    )
    kill: LeaderKill | None = None
    if opts.kill_leader:
        assert cluster is not None
        shard = shard_of(publisher_ids(opts.publishers, n_shards)[0], n_shards)
        kill = LeaderKill(shard, lambda: cluster.wait_for_leader(shard), cluster.kill)
        say(f"the leader of vnode {shard} will be killed (kill -9) a third of the way through")
    terms_before = _terms(client)
    line = ProgressLine()

    def progress(acked: int, elapsed_s: float, duration_s: float) -> None:
        rate = acked / elapsed_s if elapsed_s > 0 else 0.0
        line.show(
            f"  {bar(elapsed_s / duration_s)} {elapsed_s:5.1f}/{duration_s:g} s  {acked:>10,} acknowledged  "
            f"{rate:>9,.0f} msg/s",
            final=elapsed_s >= duration_s,
        )

    try:
        result: RunResult = run_load(
            endpoints,
            n_shards,
            opts.publishers,
            opts.batch,
            opts.size,
            opts.duration,
            rate_msgs_per_s=opts.rate,
            during=kill,
            progress=progress,
            settings=client.settings,
            in_flight=opts.in_flight or 0,
        )
    except RuntimeError as err:
        raise CommandError(f"the load run failed: {err}") from None
    finally:
        line.close()
    report: dict[str, object] = {
        "publishers": opts.publishers,
        "batch": opts.batch,
        "size": opts.size,
        "duration_s": opts.duration,
        "in_flight": opts.in_flight,
        "acked_msgs_per_s": round(result.acked_msgs_per_s, 1),
        "acked_msgs": result.batches * opts.batch,
        "failed_batches": result.failed_batches,
        "p50_ms": round(result.p50_ms, 2),
        "p99_ms": round(result.p99_ms, 2),
        "p999_ms": round(result.p999_ms, 2),
    }
    say(
        f"acknowledged  {result.acked_msgs_per_s:>12,.0f} msg/s  ({result.batches * opts.batch:,} messages, "
        f"{result.failed_batches} failed and retried batches)"
    )
    say(
        f"latency       p50 {result.p50_ms:.1f} ms   p99 {result.p99_ms:.1f} ms   p999 {result.p999_ms:.1f} ms"
        f"   (per store call of {opts.batch:,} messages, acknowledged after a majority's fsync"
        + (", from submit to acknowledgement)" if opts.in_flight else ")")
    )
    new_terms = {shard: term - terms_before.get(shard, term) for shard, term in _terms(client).items()}
    changed = sum(1 for added in new_terms.values() if added > 0)
    report["new_terms"] = sum(new_terms.values())
    say(
        f"leaders       {report['new_terms']} new term(s) on {changed} of {len(new_terms)} vnodes during the load "
        "(elections, and hand-overs by the balancer or a stopping node)"
    )
    if kill is not None:
        failover = kill.failover_s(result)
        report["failover_s"] = round(failover, 3)
        say(f"failover      writes to vnode {kill.shard} resumed {failover:.2f} s after {kill.victim} was killed")
        assert cluster is not None
        cluster.start_node(kill.victim)
        if opts.data_dir:
            cluster.save()
        say(f"              {kill.victim} restarted")
    if not opts.skip_replay:
        node_pids = [] if cluster is None else [p.pid for p in cluster.nodes.values() if p.pid is not None]
        _report_replay(client, int(result.start_at * 1_000_000), opts.size, node_pids, report, say)
    if opts.json:
        print(json.dumps(report, indent=2))
    return EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "bench",
        parents=[connection],
        help="measure write throughput and latency of a running cluster",
        description=(
            "Run PUBLISHERS processes that each store batches of SIZE-byte messages under their own clientid "
            f"(topics {TOPIC_PREFIX}/<clientid>/<n>), as fast as acknowledgements come back, for DURATION seconds; "
            "print acknowledged messages/s, p50/p99/p999 store latency (a progress line runs on stderr) and the "
            "new Raft terms the vnodes went through meanwhile (JSON key new_terms: elections and hand-overs), then "
            f"how fast '{TOPIC_PREFIX}/#' replays what was written. The messages stay in the cluster. "
            "--in-flight N keeps N pipelined store calls outstanding per publisher instead of one blocking call. "
            "--small-writes runs the small-write scenarios against their targets instead (see its help); "
            "--subscribers measures push subscribers' fan-out under a steady write load; "
            "--mqtt measures QoS 1 through 'mqds broker'; "
            "--reconnect-storm measures persistent sessions fetching their backlogs all at once."
        ),
    )
    parser.add_argument("--publishers", type=int, default=8, metavar="N", help="publisher processes (default 8)")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        metavar="N",
        help="messages per store call (default 1000; with --subscribers, 100)",
    )
    parser.add_argument("--size", type=int, default=100, metavar="BYTES", help="payload bytes (default 100)")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"load time (default {DEFAULT_DURATION_S:g}; with --small-writes, of each scenario's run: "
        f"default {bench_small.DEFAULT_DURATION_S:g})",
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=None,
        metavar="N",
        help="keep N pipelined Client.store_async calls of --batch messages outstanding per publisher, "
        "submitting a new one as each is acknowledged (latency: submit to acknowledgement); default: one "
        f"blocking store call at a time. With --small-writes: the calls in flight per publisher of its "
        f"pipelined scenario (default {bench_small.DEFAULT_IN_FLIGHT})",
    )
    parser.add_argument(
        "--small-writes",
        action="store_true",
        help="instead of one load: run the small-write scenarios against one cluster in alternating --rounds "
        "(default 2) of --duration seconds, and print each one's msg/s, p50/p99 latency and CPU per 1,000 "
        "messages (nodes' CPU with --start-cluster or --data-dir) with its target and PASS/MISS: one writer "
        "storing 1 message per blocking call (target p50 <= 2 ms); --publishers x --in-flight pipelined "
        "1-message calls (target 50,000 msg/s; baseline: as many blocking calls from threads); 1 process x "
        f"{bench_small.SINGLE_PROCESS_IN_FLIGHT:,} pipelined 1-message calls (the peer's shape, see --peer-anchors); "
        "'mqds exhook' "
        f"driven by {bench_small.EXHOOK_CALLERS} concurrent OnMessagePublish calls (target 20,000 msg/s; "
        "ceiling: the same callers against a provider that stores nothing); "
        "--publishers x blocking calls of --batch messages (target 100,000 msg/s). --json: one object, "
        "the pipelined scenario's figures at the top and every scenario under 'scenarios'",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        metavar="MSGS",
        help="pace to MSGS messages/s in total (default: flat out; with --subscribers, "
        f"{bench_fanout.DEFAULT_RATE:,.0f})",
    )
    parser.add_argument(
        "--subscribers",
        metavar="N[,N...]",
        help="instead of the write load alone: for each N, N push subscribers (Storage.Follow) of "
        f"'{TOPIC_PREFIX}/#' from now on (started, each has had one message, before the load) while the "
        "publishers store --rate msg/s for --duration s; print "
        "delivered msg/s, delivery p50/p99 of every message from the acknowledgement of the call that stored it "
        "and from the timestamp its leader gave it (which adds the commit), the nodes' CPU per 1,000 "
        "delivered messages (--start-cluster or --data-dir) and the nodes' memory. --json keys "
        "delivered_msgs_per_s, delivery_p50_ms, delivery_p99_ms (from the acknowledgement), "
        "stored_delivery_p99_ms, server_cpu_ms_per_1000_delivered (largest N) and 'runs'",
    )
    parser.add_argument(
        "--subscriber-processes",
        type=int,
        default=2,
        metavar="N",
        help="processes the --subscribers share (default 2)",
    )
    parser.add_argument(
        "--separate-answers",
        action="store_true",
        help="with --subscribers: the subscriptions do not take shared answers, so the nodes send each of "
        "them its own answer (the cost without FollowStart.shared_answers, for comparison)",
    )
    parser.add_argument(
        "--skip-replay",
        action="store_true",
        help="do not measure replay (by default: what the run wrote, replayed in batches and as Message objects, "
        "against the storage layer's own replay of as many messages on this machine)",
    )
    parser.add_argument(
        "--start-cluster",
        action="store_true",
        help="start a local cluster of --nodes mqds-server processes in a temporary directory for the run, "
        "and stop it afterwards (needs the server package); --endpoints is then ignored",
    )
    parser.add_argument("--nodes", type=int, default=3, metavar="N", help="nodes of --start-cluster (default 3)")
    parser.add_argument("--shards", type=int, default=16, metavar="N", help="vnodes of --start-cluster (default 16)")
    parser.add_argument(
        "--replication-factor",
        type=int,
        default=3,
        metavar="N",
        help="replicas per vnode of --start-cluster (default 3)",
    )
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        help="run against the local cluster recorded in DIR by 'mqds cluster up' (lets --kill-leader kill its nodes)",
    )
    parser.add_argument(
        "--kill-leader",
        action="store_true",
        help="kill -9 the leader of the first publisher's vnode a third of the way through, print how long writes "
        "to that vnode failed (failover_s), then restart the node; needs --start-cluster or --data-dir",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object with the figures instead")
    bench_small.register_options(parser)
    bench_mqtt.register_options(parser)
    bench_storm.register_options(parser)
    bench_sessions.register_options(parser)
    bench_backup.register_options(parser)
    parser.set_defaults(run=run)
