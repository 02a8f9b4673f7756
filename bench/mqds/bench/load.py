"""A write load generator for a running mqds cluster: publisher processes, acknowledged rate, latency.

Used by ``mqds bench`` and by ``python -m mqds.bench.cluster`` (which
starts the clusters it measures). It needs only the client package.

Each publisher is a process of its own (so the load generator's Python does
not share one GIL) and stores ``size``-byte messages in batches of ``batch``
under its own clientid, as fast as acknowledgements come back (or paced to a
total rate), between a common start and end time. A publisher sends one
pre-serialised ``StoreBatch`` request straight to its shard's leader,
following NOT_LEADER hints and refreshing the map otherwise, so the client's
own cost stays small next to the cluster's. Every acknowledgement waited for
a majority's fsync (``sync=True``).

Two other ways of sending: ``threads`` runs that blocking loop in several
threads of each publisher (the old path at a given concurrency), and
``in_flight`` instead keeps that many pipelined ``Client.store_async`` calls
outstanding per publisher (a new one submitted as each completes; a call's
latency runs from its submit to its acknowledgement).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from mqds.client.connection import ConnectionSettings
from mqds.client.model import Message
from mqds.client.sync.routing import Router
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.sharding import shard_of
from mqds.v1 import storage_pb2 as pb

STORE_METHOD = "/mqds.v1.Storage/StoreBatch"

# The topic prefix of every benchmark message: ``bench/<clientid>/<n>``.
TOPIC_PREFIX = "bench"


def publisher_ids(count: int, n_shards: int, leaders: Mapping[int, str] | None = None) -> list[str]:
    """Clientids that fall on distinct shards (as far as there are shards), so load spreads; with ``leaders``
    (shard -> the node leading it), also spread evenly over the nodes that lead (each gets its share of the
    leaders' work: eight publishers on shards whose leaders were six on one node put three quarters of the
    writes on that node). The first is always ``bench-pub-0``, with or without ``leaders``.
    """
    first_name: dict[int, int] = {}  # shard -> the index of the first name on it
    i = 0
    while len(first_name) < min(count, n_shards) or (leaders and len(first_name) < n_shards and i < 64 * n_shards):
        first_name.setdefault(shard_of(f"bench-pub-{i}", n_shards), i)
        i += 1
    shards = sorted(first_name, key=first_name.__getitem__)
    if leaders:
        by_node: dict[str, list[int]] = {}
        for shard in shards:  # nodes in the order of their first shard, each one's shards in order
            by_node.setdefault(leaders.get(shard, ""), []).append(shard)
        per_node = list(by_node.values())
        shards = [mine[k] for k in range(max(map(len, per_node))) for mine in per_node if k < len(mine)]
    chosen = [f"bench-pub-{first_name[shard]}" for shard in shards[:count]]
    i = max(first_name.values()) + 1
    while len(chosen) < count:  # more publishers than shards: the next names, wherever they fall
        chosen.append(f"bench-pub-{i}")
        i += 1
    return chosen


def shard_places(addresses: list[str], settings: ConnectionSettings | None) -> tuple[dict[int, list[str]], int] | None:
    """Where each shard is served as the cluster's map says now, and the number of shards (None when no node answered).

    Shard -> ``[the address of its leader]``, or the addresses of all its
    replicas where the map knows no leader.
    """
    router = Router(addresses, settings=settings)
    try:
        view = router.refresh(5, force=True)
        places: dict[int, list[str]] = {}
        for shard in range(view.n_shards):
            leader = view.leaders.get(shard)
            if leader is not None and leader[1] in view.addresses:
                places[shard] = [view.addresses[leader[1]]]
            else:
                places[shard] = router.replica_addresses(shard)
        return places, view.n_shards
    except MqdsError:
        return None
    finally:
        router.close()


def shard_leaders(addresses: list[str], settings: ConnectionSettings | None) -> dict[int, str] | None:
    """Shard -> the address of the node leading it as the cluster's map says now (its first replica's where the
    map knows no leader; None when no node answered)."""
    found = shard_places(addresses, settings)
    return None if found is None else {shard: where[0] for shard, where in found[0].items() if where}


def _request(sender: str, batch: int, size: int) -> bytes:
    payload = os.urandom(size)
    request = pb.StoreBatchRequest(sync=True)
    for i in range(batch):
        request.messages.add(topic=f"{TOPIC_PREFIX}/{sender}/{i % 100}", payload=payload, sender=sender, qos=1)
    return request.SerializeToString()


@dataclass
class Shared:
    """What the parent and every load process share: the results queue, the acknowledged count, the start."""

    results: Any
    acked: Any
    ready: Any
    start: Any

    def wait_for_start(self) -> float:
        """Say this process is ready, wait for the common start; the end time is the start + duration."""
        with self.ready.get_lock():
            self.ready.value += 1
        # The parent sets the start once every process is ready (spawning and
        # importing grpc takes a while, longer on a busy machine).
        while not self.start.value or time.time() < self.start.value:
            time.sleep(0.001)
        return float(self.start.value)

    def count(self, n: int) -> None:
        with self.acked.get_lock():
            self.acked.value += n


@dataclass
class PublisherSpec:
    addresses: list[str]
    sender: str
    n_shards: int
    batch: int
    size: int
    duration_s: float
    interval_s: float
    settings: ConnectionSettings | None
    threads: int = 1
    in_flight: int = 0
    record_acks: bool = False
    """Keep each acknowledged call's (shard, first and last timestamp, wall-clock time of the acknowledgement)."""


def _blocking(spec: PublisherSpec, shared: Shared, end_at: float, router: Router, out: dict[str, Any]) -> None:
    """One thread's loop of blocking StoreBatch calls until ``end_at``; adds to ``out`` under its lock."""
    raw = _request(spec.sender, spec.batch, spec.size)
    shard = shard_of(spec.sender, spec.n_shards)
    addresses = spec.addresses

    def leader() -> str:
        with contextlib.suppress(MqdsError):
            router.refresh(2, force=True)
        return router.leader_of(shard) or addresses[0]

    def call(address: str) -> Any:
        return router.channel(address).unary_unary(STORE_METHOD, request_serializer=None, response_deserializer=None)

    address = leader()
    latencies: list[float] = []
    acks: list[tuple[int, int, int, float]] = []
    outages: list[tuple[float, float]] = []
    failures = 0
    failing_since: float | None = None
    interval_s = spec.interval_s
    # Paced publishers spread their sends over the interval instead of all
    # sending at the same instant.
    next_at = time.monotonic() + interval_s * (zlib.crc32(spec.sender.encode()) % 1000) / 1000
    while time.time() < end_at:
        if interval_s:
            next_at += interval_s
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        t0 = time.perf_counter()
        try:
            answer = call(address)(raw, timeout=10, metadata=router.metadata)
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
        if spec.record_acks:
            acked_at = time.time()
            positions = pb.StoreBatchResponse.FromString(answer).positions
            acks.append((shard, positions[0].timestamp_us, positions[-1].timestamp_us, acked_at))
        shared.count(spec.batch)
        if failing_since is not None:
            outages.append((failing_since, time.time()))
            failing_since = None
    with out["lock"]:
        out["latencies"] += latencies
        out["acks"] += acks
        out["outages"] += outages
        out["failures"] += failures


def _pipelined(spec: PublisherSpec, shared: Shared, end_at: float, client: Any, out: dict[str, Any]) -> None:
    """Keep ``spec.in_flight`` store_async calls of ``spec.batch`` messages outstanding until ``end_at``."""
    payload = os.urandom(spec.size)
    messages = [
        Message(f"{TOPIC_PREFIX}/{spec.sender}/{i % 100}", payload, sender=spec.sender, qos=1)
        for i in range(spec.batch)
    ]
    slots = threading.Semaphore(spec.in_flight)
    lock = threading.Lock()
    latencies: list[float] = []
    failures = [0]

    def submit() -> None:
        t0 = time.perf_counter()

        def done(future: Any) -> None:
            took = time.perf_counter() - t0
            failed = future.exception() is not None
            with lock:
                if failed:
                    failures[0] += 1
                else:
                    latencies.append(took)
            if not failed:
                shared.count(spec.batch)
            slots.release()

        client.store_async(messages, timeout_s=10).add_done_callback(done)

    while time.time() < end_at:
        slots.acquire()
        if time.time() >= end_at:
            slots.release()
            break
        submit()
    # Wait for the outstanding calls (counted, as a blocking loop's last call is).
    for _ in range(spec.in_flight):
        slots.acquire(timeout=15)
    with out["lock"]:
        out["latencies"] += latencies
        out["failures"] += failures[0]


def _publish(args: tuple[PublisherSpec, Shared]) -> dict[str, Any]:
    """One publisher process: store from the common start for ``duration_s``; latencies, failures, CPU seconds."""
    spec, shared = args
    shard = shard_of(spec.sender, spec.n_shards)
    out: dict[str, Any] = {"lock": threading.Lock(), "latencies": [], "acks": [], "outages": [], "failures": 0}
    router = Router(
        spec.addresses,
        settings=spec.settings,
        channel_options=[("grpc.max_send_message_length", 64 << 20), ("grpc.initial_reconnect_backoff_ms", 100)],
    )
    client: Any = None
    if spec.in_flight:
        from mqds.client import Client

        window = max(10_000, spec.in_flight * spec.batch)
        client = Client(spec.addresses, settings=spec.settings, max_in_flight_messages=window)
        client.cluster_map()
    else:
        with contextlib.suppress(MqdsError):
            router.refresh(2, force=True)
    start_at = shared.wait_for_start()
    end_at = start_at + spec.duration_s
    cpu_before = time.process_time()
    if client is not None:
        try:
            _pipelined(spec, shared, end_at, client, out)
        finally:
            client.close()
    else:
        workers = [
            threading.Thread(target=_blocking, args=(spec, shared, end_at, router, out), daemon=True)
            for _ in range(spec.threads)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    cpu_s = time.process_time() - cpu_before
    router.close()
    del out["lock"]
    out.update(sender=spec.sender, shard=shard, batch=spec.batch, cpu_s=cpu_s)
    shared.results.put(out)
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
    # Acknowledged messages in all, and every acknowledged call's latency in seconds (sorted).
    acked_msgs: int = 0
    latencies_s: list[float] = field(default_factory=list)
    # CPU seconds the load processes used between the start and the end of their loops.
    load_cpu_s: float = 0.0
    # ``sample()`` at the end minus at the start (see run_load); None without a sample or when it had none.
    sampled: float | None = None
    # With ``record_acks``: every acknowledged call's (shard, first and last timestamp_us, time.time() of the
    # acknowledgement).
    acks: list[tuple[int, int, int, float]] = field(default_factory=list)


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


def pct_ms(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted latencies in seconds, in milliseconds (0 when there are none)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


def drive(
    target: Callable[[Any], dict[str, Any]],
    specs: list[Any],
    duration_s: float,
    *,
    during: Callable[[], None] | None = None,
    progress: Progress | None = None,
    progress_interval_s: float = 0.5,
    sample: Callable[[], float | None] | None = None,
) -> tuple[list[dict[str, Any]], float, float, float | None]:
    """Run ``target((spec, shared))`` in one spawned process per spec, all starting at once, for ``duration_s``.

    Each process calls ``shared.wait_for_start()``, counts acknowledged
    messages with ``shared.count(n)`` and puts one dict on ``shared.results``.
    Returns those dicts, the start and end times, and ``sample()`` at the end
    minus at the start (e.g. the CPU of processes the caller watches).
    """
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        shared = Shared(manager.Queue(), ctx.Value("q", 0), ctx.Value("i", 0), ctx.Value("d", 0.0))
        procs = [ctx.Process(target=target, args=((spec, shared),), daemon=True) for spec in specs]
        for p in procs:
            p.start()
        try:
            ready_deadline = time.monotonic() + 120
            while shared.ready.value < len(procs):
                if time.monotonic() > ready_deadline or not all(p.is_alive() for p in procs):
                    codes = sorted({p.exitcode for p in procs if p.exitcode})
                    raise RuntimeError(f"the load processes did not start (exit codes {codes})")
                time.sleep(0.05)
            start_at = time.time() + 0.1
            end_at = start_at + duration_s
            shared.start.value = start_at
            time.sleep(max(0.0, start_at - time.time()))
            sampled_before = sample() if sample is not None else None
            pending_during = during
            last_progress = 0.0
            while time.time() < end_at:
                now = time.time()
                if pending_during is not None and now >= start_at + duration_s / 3:
                    pending_during()
                    pending_during = None
                if progress is not None and now >= start_at and now - last_progress >= progress_interval_s:
                    progress(int(shared.acked.value), now - start_at, duration_s)
                    last_progress = now
                time.sleep(0.05)
            collected: list[dict[str, Any]] = []
            collect_deadline = time.monotonic() + 120
            while len(collected) < len(procs):
                try:
                    collected.append(shared.results.get(timeout=0.5))
                except queue.Empty:
                    if time.monotonic() > collect_deadline or not any(p.is_alive() for p in procs):
                        codes = sorted({p.exitcode for p in procs if p.exitcode})
                        raise RuntimeError(
                            f"{len(procs) - len(collected)} load processes did not report (exit codes {codes})"
                        ) from None
            sampled_after = sample() if sample is not None else None
            if progress is not None:
                progress(int(shared.acked.value), duration_s, duration_s)
        finally:
            for p in procs:
                # Processes that never got a start time would wait for ever.
                p.join(timeout=30 if shared.start.value else 0)
                if p.is_alive():
                    p.kill()
    sampled = None if sampled_before is None or sampled_after is None else sampled_after - sampled_before
    return collected, start_at, end_at, sampled


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
    *,
    threads: int = 1,
    in_flight: int = 0,
    sample: Callable[[], float | None] | None = None,
    record_acks: bool = False,
) -> RunResult:
    """Drive ``publishers`` processes against the cluster for ``duration_s``; what was acknowledged, how fast.

    ``rate_msgs_per_s`` paces the publishers to that total rate (0: as fast
    as acknowledged). ``during`` runs once, a third of the way through (to
    kill a leader under load). ``progress`` is called every
    ``progress_interval_s`` while the load runs. ``settings`` say how to
    connect (TLS, token); plaintext by default. ``threads`` runs the blocking
    loop in that many threads per publisher; ``in_flight`` (above 0) instead
    keeps that many ``store_async`` calls outstanding per publisher (not
    paced). ``sample`` is called at the start and the end (``RunResult.sampled``).
    ``record_acks`` keeps when each blocking call was acknowledged, and for which
    messages (``RunResult.acks``).
    """
    if publishers < 1 or batch < 1 or size < 0 or duration_s <= 0 or threads < 1 or in_flight < 0:
        raise ValueError(
            "publishers, batch and threads must be at least 1, size and in_flight at least 0, duration above 0"
        )
    if in_flight and rate_msgs_per_s:
        raise ValueError("in_flight calls are not paced: give a rate or in_flight, not both")
    senders = publisher_ids(publishers, n_shards, shard_leaders(addresses, settings))
    interval = (batch * publishers * threads / rate_msgs_per_s) if rate_msgs_per_s else 0.0
    specs = [
        PublisherSpec(
            addresses, s, n_shards, batch, size, duration_s, interval, settings, threads, in_flight, record_acks
        )
        for s in senders
    ]
    collected, start_at, end_at, sampled = drive(
        _publish,
        specs,
        duration_s,
        during=during,
        progress=progress,
        progress_interval_s=progress_interval_s,
        sample=sample,
    )
    latencies = sorted(x for r in collected for x in r["latencies"])
    batches = len(latencies)
    if not latencies:
        raise RuntimeError("no batch was acknowledged")
    outages = [(r["sender"], r["shard"], a, b) for r in collected for a, b in r["outages"]]
    return RunResult(
        batches * batch / duration_s,
        pct_ms(latencies, 0.5),
        pct_ms(latencies, 0.99),
        pct_ms(latencies, 0.999),
        batches,
        outages,
        failed_batches=sum(r["failures"] for r in collected),
        start_at=start_at,
        end_at=end_at,
        acked_msgs=batches * batch,
        latencies_s=latencies,
        load_cpu_s=sum(r["cpu_s"] for r in collected),
        sampled=sampled,
        acks=[tuple(a) for r in collected for a in r["acks"]],
    )
