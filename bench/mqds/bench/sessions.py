"""``mqds bench --session-soak``: short-lived clientids come and go, and their state must go with them.

Ordinary IoT traffic: ``--soak-clients`` clientids (default 1,000,000) each
connect once with a Session Expiry Interval of ``--soak-expiry`` seconds
(default 60), take one proxy subscription and disconnect, ``--soak-in-flight``
clients at a time (default 256, through the asyncio client). Then nothing:
once their sessions have expired, the nodes' leaders remove them in logged
steps. The command measures the cluster three times: before the load (the
baseline), after it, and after expiry (it waits until every expired session
is gone, at most ``--soak-expiry`` plus 10 minutes): the keys of every vnode
(one replica each, from its digest) and each node's data directory on disk.
Once the keys are back, it waits (at most ``SETTLE_S``) for the disk to come
back too, to within ``SLACK_PER_NODE`` a node of the baseline, and fails
unless it is then within that plus ``SLACK_PER_REPLICA`` a replica the node
holds: sizes that do not grow with the number of clients (the Raft log's
segment, which a node whose groups went idle starts afresh past 1 MiB;
RocksDB's info logs, rolled at 256 KiB with two old ones kept). The keys and
the disk must both return, else the command fails. Also: clients
recorded a second, and the nodes' CPU per 1,000 clients for the load and for
the removal. It needs the nodes (``--start-cluster`` or ``--data-dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

from mqds.bench.mqtt import _cpu_total
from mqds.cli.console import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CommandError, ProgressLine, bar, table
from mqds.client import aio
from mqds.tools import cluster_command

DEFAULT_CLIENTS = 1_000_000
DEFAULT_EXPIRY_S = 60
DEFAULT_IN_FLIGHT = 256
WAIT_AFTER_EXPIRY_S = 600
WARMUP_CLIENTS = 100
SETTLE_S = 180
"""How long the disk may take to come back once the keys have (the Raft groups compact after 30 s idle)."""
SLACK_PER_NODE = 1024 * 1024
SLACK_PER_REPLICA = 768 * 1024


@dataclass(frozen=True)
class Snapshot:
    """The cluster at one moment: keys of every vnode (one replica each) and bytes on disk per node."""

    keys: int
    disk_bytes: dict[str, int]

    @property
    def disk_total(self) -> int:
        return sum(self.disk_bytes.values())


def register_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``mqds bench --session-soak`` (with bench's --start-cluster, --data-dir, --json)."""
    group = parser.add_argument_group("--session-soak: short-lived clientids whose state must end")
    group.add_argument(
        "--session-soak",
        action="store_true",
        help="instead of the store load: --soak-clients clientids connect once with a Session Expiry Interval of "
        "--soak-expiry seconds, subscribe once and leave; print every vnode's keys and the nodes' disk before, "
        "after the load and after expiry (keys and disk must return to the baseline), clients/s and the nodes' CPU "
        "per 1,000 clients. Needs --start-cluster or --data-dir. --json keys clients, clients_per_s, "
        "baseline_keys, loaded_keys, expired_keys, baseline_disk_bytes, loaded_disk_bytes, expired_disk_bytes, "
        "removal_s, disk_settle_s, disk_back, load_cpu_ms_per_1000, removal_cpu_ms_per_1000",
    )
    group.add_argument(
        "--soak-clients", type=int, default=DEFAULT_CLIENTS, metavar="N", help="clientids (default 1,000,000)"
    )
    group.add_argument(
        "--soak-expiry",
        type=int,
        default=DEFAULT_EXPIRY_S,
        metavar="SECONDS",
        help=f"their Session Expiry Interval (default {DEFAULT_EXPIRY_S})",
    )
    group.add_argument(
        "--soak-in-flight",
        type=int,
        default=DEFAULT_IN_FLIGHT,
        metavar="N",
        help=f"clients connecting at a time (default {DEFAULT_IN_FLIGHT})",
    )


def run(opts: argparse.Namespace) -> int:
    if opts.soak_clients < 1 or opts.soak_in_flight < 1 or opts.soak_expiry < 0:
        raise CommandError(
            "--soak-clients and --soak-in-flight must be at least 1, --soak-expiry 0 or more", EXIT_USAGE
        )
    if not (opts.start_cluster or opts.data_dir) or (opts.start_cluster and opts.data_dir):
        raise CommandError("--session-soak measures the nodes: give --start-cluster or --data-dir", EXIT_USAGE)
    with contextlib.ExitStack() as stack:
        cluster = cluster_command.for_benchmark(opts, stack, "mqds-bench-soak-")
        assert cluster is not None
        pids = [p.pid for p in cluster.nodes.values() if p.pid is not None]
        say = (lambda _text: None) if opts.json else (lambda text: print(text, flush=True))

        def snapshot() -> Snapshot:
            keys = 0
            for shard in range(cluster.n_shards):
                digests = cluster.digests(shard)
                keys += next(iter(digests.values())).keys if digests else 0
            disk = {node: cluster.status(node, timeout_s=10).data_dir_bytes for node in cluster.live()}
            return Snapshot(keys, disk)

        # A warm-up of clients whose sessions end at once: the shards' own bookkeeping keys of session
        # commands (written once, kept) are then in the baseline too.
        asyncio.run(_load(cluster.addresses, opts, WARMUP_CLIENTS, 0, "warm-up"))
        baseline = snapshot()
        for _ in range(60):
            time.sleep(1)
            settled = snapshot()
            if settled.keys == baseline.keys:
                break
            baseline = settled
        say(f"baseline: {baseline.keys:,} keys, {_mb(baseline.disk_total)} on disk")
        cpu0, t0 = _cpu_total(pids), time.monotonic()
        asyncio.run(_load(cluster.addresses, opts, opts.soak_clients, opts.soak_expiry, "soak"))
        load_s, cpu1 = time.monotonic() - t0, _cpu_total(pids)
        loaded = snapshot()
        say(f"after the load: {loaded.keys:,} keys, {_mb(loaded.disk_total)} on disk; waiting for expiry ...")
        t1 = time.monotonic()
        deadline = t0 + load_s + opts.soak_expiry + WAIT_AFTER_EXPIRY_S
        expired = loaded
        line = ProgressLine()
        while time.monotonic() < deadline:
            expired = snapshot()
            line.show(f"expiry: {expired.keys:,} keys ({expired.keys - baseline.keys:,} above the baseline)")
            if expired.keys <= baseline.keys:
                break
            time.sleep(5)
        removal_s, cpu2 = time.monotonic() - t1, _cpu_total(pids)
        line.show(f"expiry: {expired.keys:,} keys", final=True)
        replicas = cluster.n_shards * min(opts.replication_factor, len(pids))
        target = baseline.disk_total + SLACK_PER_NODE * len(pids)
        allowed = target + SLACK_PER_REPLICA * replicas
        t2 = time.monotonic()
        while expired.keys <= baseline.keys and expired.disk_total > target and time.monotonic() < t2 + SETTLE_S:
            line.show(f"disk: {_mb(expired.disk_total)} (waiting for {_mb(target)}; back means at most {_mb(allowed)})")
            time.sleep(5)
            expired = snapshot()
        settle_s = time.monotonic() - t2
        line.show(f"disk: {_mb(expired.disk_total)} after {settle_s:.0f} s more", final=True)
    n = opts.soak_clients
    report = {
        "clients": n,
        "expiry_s": opts.soak_expiry,
        "load_s": round(load_s, 2),
        "clients_per_s": round(n / load_s, 1),
        "baseline_keys": baseline.keys,
        "loaded_keys": loaded.keys,
        "expired_keys": expired.keys,
        "baseline_disk_bytes": baseline.disk_total,
        "loaded_disk_bytes": loaded.disk_total,
        "expired_disk_bytes": expired.disk_total,
        "removal_s": round(removal_s, 2),
        "disk_settle_s": round(settle_s, 2),
        "disk_allowed_bytes": allowed,
        "disk_back": expired.disk_total <= allowed,
        "load_cpu_ms_per_1000": None if cpu0 is None or cpu1 is None else round((cpu1 - cpu0) / n * 1e6, 2),
        "removal_cpu_ms_per_1000": None if cpu1 is None or cpu2 is None else round((cpu2 - cpu1) / n * 1e6, 2),
    }
    back = expired.keys <= baseline.keys and expired.disk_total <= allowed
    if opts.json:
        print(json.dumps(report, indent=2))
    else:
        rows = [
            ["baseline", f"{baseline.keys:,}", _mb(baseline.disk_total), "", ""],
            ["after the load", f"{loaded.keys:,}", _mb(loaded.disk_total), f"{load_s:.1f} s", _ms(report, "load")],
            [
                "after expiry",
                f"{expired.keys:,}",
                _mb(expired.disk_total),
                f"{removal_s:.1f} s (disk: {settle_s:.0f} s more)",
                _ms(report, "removal"),
            ],
        ]
        print(
            f"{n:,} clientids, each connected once with a {opts.soak_expiry} s session expiry, one subscription, "
            f"gone: {n / load_s:,.0f} clients/s"
        )
        print(table(["PHASE", "KEYS", "ON DISK", "TOOK", "NODES' CPU / 1,000 CLIENTS"], rows, right=(1, 2, 3, 4)))
        print(
            f"OK: every expired session removed, the disk back at the baseline (at most {_mb(allowed)})"
            if back
            else f"FAILED: keys ({expired.keys:,}) or disk ({_mb(expired.disk_total)}) not back at the baseline "
            f"({baseline.keys:,} keys, at most {_mb(allowed)})"
        )
    return EXIT_OK if back else EXIT_FAILED


async def _load(endpoints: list[str], opts: argparse.Namespace, n: int, expiry: int, what: str) -> None:
    run_id = f"{what}-{int(time.time())}"
    done = 0
    line = ProgressLine()
    started = time.monotonic()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    async with aio.Client(endpoints, timeout_s=60) as client:

        async def worker() -> None:
            nonlocal done
            while not queue.empty():
                i = queue.get_nowait()
                clientid = f"{run_id}-{i}"
                await client.client_connected(clientid, "soak-broker", session_expiry_s=expiry)
                await client.subscribe(clientid, f"soak/{i % 100}/#", 1)
                await client.client_disconnected(clientid, "soak-broker")
                done += 1
                if done % 1000 == 0:
                    rate = done / max(time.monotonic() - started, 1e-3)
                    line.show(f"{what} clients {bar(done / n)} {done:>10,}/{n:,}  {rate:>8,.0f}/s")

        await asyncio.gather(*(worker() for _ in range(min(opts.soak_in_flight, n))))
    line.show(f"{what}: {n:,} clients connected, subscribed and gone", final=True)


def _mb(n: int) -> str:
    return f"{n / 1024 / 1024:,.1f} MiB"


def _ms(report: dict[str, object], phase: str) -> str:
    value = report[f"{phase}_cpu_ms_per_1000"]
    return "-" if value is None else f"{value:.1f} ms"
