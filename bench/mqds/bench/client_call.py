"""What a one-message ``store_async`` costs the client: CPU per message, time in the call, memory blocks per call.

``python -m mqds.bench.client_call`` starts a local 3-node cluster (16
vnodes), then one client in this process keeps ``--in-flight`` one-message
``Client.store_async`` calls outstanding (a new one as each completes, the
way ``mqds bench --in-flight`` does) for ``--messages`` messages, ``--rounds``
times, and prints per round:

- ``msgs_per_s``: acknowledged messages per second;
- ``client_cpu_us_per_msg``: this process's CPU (user + system, every thread:
  the caller, the pipeline's, gRPC's) per message;
- ``call_us``: the time spent inside ``store_async`` itself, per call.

Then, with every node stopped (SIGSTOP) so that nothing is answered, it
makes 2,000 calls and counts with ``tracemalloc`` the memory blocks they
hold while in flight (``blocks_per_call_in_flight``: the future, the queued
message, its share of the batches), and, the nodes resumed and every call
settled, what each settled future still holds (``blocks_per_settled_call``).
The nodes share the machine's cores with the client: compare runs of one
sitting.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

from mqds.client import Client, Message
from mqds.tools.local_cluster import LocalCluster


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _messages(payload_bytes: int) -> list[Message]:
    payload = b"x" * payload_bytes
    return [Message(f"callbench/{i}/{i % 100}", payload, sender=f"callbench-{i}", qos=1) for i in range(64)]


def steady(client: Client, n: int, in_flight: int, payload_bytes: int) -> dict[str, float]:
    """``n`` one-message calls, ``in_flight`` outstanding at a time; throughput and the client's costs."""
    messages = _messages(payload_bytes)
    slots = threading.Semaphore(in_flight)
    finished = threading.Event()
    lock = threading.Lock()
    counts = {"done": 0, "failed": 0}

    def done(future: Any) -> None:
        failed = future.exception() is not None
        with lock:
            counts["done"] += 1
            counts["failed"] += failed
            if counts["done"] == n:
                finished.set()
        slots.release()

    in_call = 0.0
    cpu0, wall0 = _cpu_s(), time.perf_counter()
    for i in range(n):
        slots.acquire()
        t = time.perf_counter()
        future = client.store_async(messages[i % len(messages)])
        in_call += time.perf_counter() - t
        future.add_done_callback(done)
    finished.wait(300)
    cpu1, wall1 = _cpu_s(), time.perf_counter()
    return {
        "msgs_per_s": round(n / (wall1 - wall0)),
        "client_cpu_us_per_msg": round((cpu1 - cpu0) / n * 1e6, 2),
        "call_us": round(in_call / n * 1e6, 2),
        "failed": counts["failed"],
    }


def held(client: Client, cluster: LocalCluster, n: int, payload_bytes: int) -> dict[str, float]:
    """Memory blocks per call: in flight (no node answers), and once settled (the futures kept)."""
    messages = _messages(payload_bytes)
    client.publish(messages[0])
    for node in cluster.nodes.values():
        node.pause()
    try:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        futures = [client.store_async(messages[i % len(messages)], timeout_s=120) for i in range(n)]
        time.sleep(0.5)  # sealed and sent meanwhile
        in_flight = tracemalloc.take_snapshot()
    finally:
        for node in cluster.nodes.values():
            node.resume()
    for future in futures:
        future.result(timeout=120)
    time.sleep(0.3)
    gc.collect()
    settled = tracemalloc.take_snapshot()
    tracemalloc.stop()

    def blocks(a: tracemalloc.Snapshot, b: tracemalloc.Snapshot) -> float:
        return round(sum(s.count_diff for s in b.compare_to(a, "filename")) / n, 2)

    return {"blocks_per_call_in_flight": blocks(before, in_flight), "blocks_per_settled_call": blocks(before, settled)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqds.bench.client_call", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=30_000, help="calls per round (default 30,000)")
    parser.add_argument("--in-flight", type=int, default=1_000, help="calls outstanding (default 1,000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--size", type=int, default=100, help="payload bytes (default 100)")
    opts = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="mqds-callbench-") as work,
        LocalCluster(Path(work) / "cluster", 3, n_shards=16) as cluster,
    ):
        cluster.start()
        cluster.wait_leaders_settled(60)
        with Client(cluster.addresses, timeout_s=30, max_in_flight_messages=10_000) as client:
            client.cluster_map()
            steady(client, 5_000, opts.in_flight, opts.size)  # warm up: streams open, code paths hot
            rounds = [steady(client, opts.messages, opts.in_flight, opts.size) for _ in range(opts.rounds)]
            for r in rounds:
                print(json.dumps(r), flush=True)
            memory = held(client, cluster, 2_000, opts.size)
            stats = client.pipeline_stats()
    summary = {
        "client_cpu_us_per_msg": sorted(r["client_cpu_us_per_msg"] for r in rounds)[len(rounds) // 2],
        "call_us": sorted(r["call_us"] for r in rounds)[len(rounds) // 2],
        "msgs_per_s": sorted(r["msgs_per_s"] for r in rounds)[len(rounds) // 2],
        **memory,
        "messages_per_batch": round(stats["messages"] / max(1, stats["batches"]), 1),
    }
    print(json.dumps({"median": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
