"""A write load generator for a running mqds cluster: publisher processes, acknowledged rate, latency.

Used by ``mqds bench`` and by ``python -m mqds.tools.bench_cluster`` (which
starts the clusters it measures). It needs only the client package.

Each publisher is a process of its own (so the load generator's Python does
not share one GIL) and stores ``size``-byte messages in batches of ``batch``
under its own clientid, as fast as acknowledgements come back (or paced to a
total rate), between a common start and end time. A publisher sends one
pre-serialised ``StoreBatch`` request straight to its shard's leader,
following NOT_LEADER hints and refreshing the map otherwise, so the client's
own cost stays small next to the cluster's. Every acknowledgement waited for
a majority's fsync (``sync=True``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from mqds.client.connection import ConnectionSettings
from mqds.client.routing import Router
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.sharding import shard_of
from mqds.v1 import storage_pb2 as pb

STORE_METHOD = "/mqds.v1.Storage/StoreBatch"

# The topic prefix of every benchmark message: ``bench/<clientid>/<n>``.
TOPIC_PREFIX = "bench"


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
        request.messages.add(topic=f"{TOPIC_PREFIX}/{sender}/{i % 100}", payload=payload, sender=sender, qos=1)
    return request.SerializeToString()


def _publish(args: tuple[list[str], str, int, int, int, float, float, Any, Any, Any, Any, Any]) -> dict[str, Any]:
    """One publisher process: store batches from the common start for ``duration_s``; latencies and failures."""
    addresses, sender, n_shards, batch, size, duration_s, interval_s, results, acked, ready, start, settings = args
    raw = _request(sender, batch, size)
    shard = shard_of(sender, n_shards)
    router = Router(
        addresses,
        settings=settings,
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
    failures = 0
    failing_since: float | None = None
    with ready.get_lock():
        ready.value += 1
    # The parent sets the start once every publisher is ready (spawning and
    # importing grpc takes a while, longer on a busy machine).
    while not start.value or time.time() < start.value:
        time.sleep(0.001)
    end_at = start.value + duration_s
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
            call(address)(raw, timeout=10, metadata=router.metadata)
        except grpc.RpcError as rpc_err:
            err = errors.from_rpc_error(rpc_err)
            failures += 1
            if failing_since is None:
                failing_since = time.time()
            if err.reason is Reason.NOT_LEADER and router.learn(err, shard):
                address = router.leader_of(shard) or address
            else:
                time.sleep(0.05)
                address = leader()
            continue
        latencies.append(time.perf_counter() - t0)
        with acked.get_lock():
            acked.value += batch
        if failing_since is not None:
            outages.append((failing_since, time.time()))
            failing_since = None
    router.close()
    out = {
        "sender": sender,
        "shard": shard,
        "latencies": latencies,
        "outages": outages,
        "batch": batch,
        "failures": failures,
    }
    results.put(out)
    return out


@dataclass
class RunResult:
    """What one load run measured. Latencies are per ``StoreBatch`` call, acknowledged ones only."""

    acked_msgs_per_s: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    batches: int
    outages: list[tuple[str, int, float, float]]
    # Calls that failed (and were retried by the publisher), e.g. during a failover.
    failed_batches: int = 0
    # Wall-clock bounds of the run (seconds since the epoch): replay from start_at finds its messages.
    start_at: float = 0.0
    end_at: float = 0.0


class LeaderKill:
    """A ``during`` action for :func:`run_load`: kill a shard's leader once, then tell how long its writes failed.

    ``find_leader()`` names the shard's leader at the moment of the kill
    (leaders move, e.g. when the cluster balances them after a start) and
    ``kill(node)`` kills that node's process (``kill -9``).
    """

    def __init__(self, shard: int, find_leader: Callable[[], str], kill: Callable[[str], None]) -> None:
        self.shard = shard
        self._find_leader = find_leader
        self._kill = kill
        self.victim = ""
        self.killed_at = 0.0

    def __call__(self) -> None:
        self.victim = self._find_leader()
        self.killed_at = time.time()
        self._kill(self.victim)

    def failover_s(self, result: RunResult) -> float:
        """Seconds from the kill until writes to the shard succeeded again (0 if none failed)."""
        if not self.killed_at:
            raise RuntimeError("the leader was not killed during the run")
        outage = [
            end - self.killed_at for _, shard, _, end in result.outages if shard == self.shard and end >= self.killed_at
        ]
        return max(outage, default=0.0)


# progress(acknowledged messages so far, seconds since the load started, duration in seconds)
Progress = Callable[[int, float, float], None]


def run_load(
    addresses: list[str],
    n_shards: int,
    publishers: int,
    batch: int,
    size: int,
    duration_s: float,
    rate_msgs_per_s: float = 0.0,
    during: Callable[[], None] | None = None,
    progress: Progress | None = None,
    progress_interval_s: float = 0.5,
    settings: ConnectionSettings | None = None,
) -> RunResult:
    """Drive ``publishers`` processes against the cluster for ``duration_s``; what was acknowledged, how fast.

    ``rate_msgs_per_s`` paces the publishers to that total rate (0: as fast
    as acknowledged). ``during`` runs once, a third of the way through (to
    kill a leader under load). ``progress`` is called every
    ``progress_interval_s`` while the load runs. ``settings`` say how to
    connect (TLS, token); plaintext by default.
    """
    if publishers < 1 or batch < 1 or size < 0 or duration_s <= 0:
        raise ValueError("publishers and batch must be at least 1, size at least 0, duration above 0")
    senders = publisher_ids(publishers, n_shards)
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.Queue()
        acked = ctx.Value("q", 0)
        ready = ctx.Value("i", 0)
        start = ctx.Value("d", 0.0)
        interval = (batch * publishers / rate_msgs_per_s) if rate_msgs_per_s else 0.0
        procs = [
            ctx.Process(
                target=_publish,
                args=(
                    (addresses, s, n_shards, batch, size, duration_s, interval, results, acked, ready, start, settings),
                ),
                daemon=True,
            )
            for s in senders
        ]
        for p in procs:
            p.start()
        try:
            ready_deadline = time.monotonic() + 120
            while ready.value < len(procs):
                if time.monotonic() > ready_deadline or not all(p.is_alive() for p in procs):
                    codes = sorted({p.exitcode for p in procs if p.exitcode})
                    raise RuntimeError(f"the publisher processes did not start (exit codes {codes})")
                time.sleep(0.05)
            start_at = time.time() + 0.1
            end_at = start_at + duration_s
            start.value = start_at
            pending_during = during
            last_progress = 0.0
            while time.time() < end_at:
                now = time.time()
                if pending_during is not None and now >= start_at + duration_s / 3:
                    pending_during()
                    pending_during = None
                if progress is not None and now >= start_at and now - last_progress >= progress_interval_s:
                    progress(int(acked.value), now - start_at, duration_s)
                    last_progress = now
                time.sleep(0.05)
            collected: list[dict[str, Any]] = []
            collect_deadline = time.monotonic() + 120
            while len(collected) < len(procs):
                try:
                    collected.append(results.get(timeout=0.5))
                except queue.Empty:
                    if time.monotonic() > collect_deadline or not any(p.is_alive() for p in procs):
                        codes = sorted({p.exitcode for p in procs if p.exitcode})
                        raise RuntimeError(
                            f"{len(procs) - len(collected)} publisher processes did not report (exit codes {codes})"
                        ) from None
            if progress is not None:
                progress(int(acked.value), duration_s, duration_s)
        finally:
            for p in procs:
                # Publishers that never got a start time would wait for ever.
                p.join(timeout=30 if start.value else 0)
                if p.is_alive():
                    p.kill()
    latencies = sorted(x for r in collected for x in r["latencies"])
    batches = len(latencies)
    if not latencies:
        raise RuntimeError("no batch was acknowledged")

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    outages = [(r["sender"], r["shard"], a, b) for r in collected for a, b in r["outages"]]
    return RunResult(
        batches * batch / duration_s,
        pct(0.5),
        pct(0.99),
        pct(0.999),
        batches,
        outages,
        failed_batches=sum(r["failures"] for r in collected),
        start_at=start_at,
        end_at=end_at,
    )
