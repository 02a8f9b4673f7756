"""``mqds bench --reconnect-storm``: many persistent sessions with a backlog each come back at once.

What a broker meets after a restart or a network blip: ``--sessions``
persistent sessions (default 10,000), each subscribed to one of ``--filters``
topic filters (default 10: sessions share filters, as a broker's devices
subscribe to the same few command topics; ``--filters`` equal to
``--sessions`` gives every session its own), each with a backlog of
``--backlog`` messages (default 100) stored while it was away; then every
session reconnects within ``--window`` seconds (default 10, evenly spread) and
fetches its backlog, a page of 500 at a time (the broker's default
``max_returned_count``; a full page is acknowledged before the next, as the
broker does).

It runs the storm twice, on two sets of sessions with the same filters and
backlogs: first as the broker integrations fetch now (``OfflineFetches``:
the fetches that arrive together go out as one ``fetch_offline_many``, read
positions and messages in shared calls, each shard scanned once per filter),
then the baseline, one ``fetch_offline`` per session (at most
``BASELINE_IN_FLIGHT`` at once: a client with more in flight is refused
OVERLOADED by the nodes' ``max_calls_per_client``). For each: the time from
the first reconnect until every backlog was delivered, messages delivered a
second, and the nodes' CPU per 1,000 delivered messages (when the command
controls the nodes: ``--start-cluster`` or ``--data-dir``). Every session
must get exactly its backlog, else the command fails. The sessions and
messages stay in the cluster, under ``storm/<run>/...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mqds.bench.mqtt import _cpu_total
from mqds.broker.offline import OfflineFetches
from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, ProgressLine, bar, connection
from mqds.client import Message, OfflineFetch, aio
from mqds.client.connection import parse_endpoints
from mqds.tools import cluster_command

DEFAULT_SESSIONS = 10_000
DEFAULT_BACKLOG = 100
DEFAULT_FILTERS = 10
DEFAULT_WINDOW_S = 10.0
PAGE = 500
"""Messages per fetch: the brokers' default ``max_returned_count``."""
BASELINE_IN_FLIGHT = 32
"""``fetch_offline`` calls the baseline keeps in flight (the nodes' ``max_calls_per_client`` is 48)."""
PUBLISHERS = 16
"""Senders of the backlog, so it spreads over the shards."""


@dataclass
class Storm:
    """One storm's figures."""

    seconds: float
    delivered: int
    cpu_ms_per_1000: float | None
    short: int
    """Sessions that did not get exactly their backlog."""
    calls: int | None = None
    """Shared calls the coalesced fetches went out in (None for the baseline)."""

    @property
    def msgs_per_s(self) -> float:
        return self.delivered / self.seconds if self.seconds > 0 else 0.0


def check(opts: argparse.Namespace) -> None:
    for name in ("sessions", "backlog", "filters"):
        if getattr(opts, name) < 1:
            raise CommandError(f"--{name} must be at least 1", EXIT_USAGE)
    if opts.filters > opts.sessions:
        raise CommandError("--filters must be at most --sessions (each filter has a session at least)", EXIT_USAGE)
    if opts.window < 0:
        raise CommandError("--window must be 0 or more", EXIT_USAGE)
    if opts.kill_leader or opts.small_writes or opts.subscribers or opts.mqtt:
        raise CommandError(
            "--reconnect-storm runs its own scenario: no --kill-leader, --small-writes, --subscribers or --mqtt",
            EXIT_USAGE,
        )


def run(opts: argparse.Namespace) -> int:
    check(opts)
    with contextlib.ExitStack() as stack:
        cluster = cluster_command.for_benchmark(opts, stack, "mqds-bench-storm-")
        endpoints = cluster.addresses if cluster is not None else parse_endpoints(opts.endpoints)
        node_pids = [] if cluster is None else [p.pid for p in cluster.nodes.values() if p.pid is not None]
        shared, baseline = asyncio.run(_bench(opts, endpoints, node_pids))
    report = {
        "sessions": opts.sessions,
        "backlog": opts.backlog,
        "filters": opts.filters,
        "window_s": opts.window,
        "delivered": shared.delivered,
        "storm_s": round(shared.seconds, 3),
        "storm_baseline_s": round(baseline.seconds, 3),
        "storm_msgs_per_s": round(shared.msgs_per_s, 1),
        "baseline_msgs_per_s": round(baseline.msgs_per_s, 1),
        "server_cpu_ms_per_1000_delivered": shared.cpu_ms_per_1000,
        "baseline_server_cpu_ms_per_1000_delivered": baseline.cpu_ms_per_1000,
        "shared_calls": shared.calls,
    }
    if opts.json:
        print(json.dumps(report, indent=2))
    else:
        _print(shared, baseline)
    return EXIT_OK


def _each(sessions: int, filters: int) -> str:
    per = sessions / filters
    return (
        "1 session each"
        if per == 1
        else f"{per:,.0f} sessions each"
        if per == int(per)
        else f"{per:,.1f} sessions each"
    )


def _cpu(storm: Storm) -> str:
    return "-" if storm.cpu_ms_per_1000 is None else f"{storm.cpu_ms_per_1000:.2f} ms"


def _print(shared: Storm, baseline: Storm) -> None:
    print(
        f"storm         {shared.seconds:8.2f} s until every backlog was delivered  ({shared.delivered:,} messages, "
        f"{shared.msgs_per_s:,.0f} msg/s; the fetches coalesced into {shared.calls:,} fetch_offline_many "
        f"call{'' if shared.calls == 1 else 's'})"
    )
    print(f"  nodes' CPU  {_cpu(shared)} per 1,000 delivered")
    print(
        f"baseline      {baseline.seconds:8.2f} s  ({baseline.delivered:,} messages, {baseline.msgs_per_s:,.0f} msg/s; "
        f"one fetch_offline per session, {BASELINE_IN_FLIGHT} in flight)"
    )
    print(f"  nodes' CPU  {_cpu(baseline)} per 1,000 delivered")
    if baseline.seconds > 0:
        line = f"shared/baseline: {shared.seconds / baseline.seconds:.2f} of the time"
        if shared.cpu_ms_per_1000 is not None and baseline.cpu_ms_per_1000:  # a measured 0 is a figure too
            line += f", {shared.cpu_ms_per_1000 / baseline.cpu_ms_per_1000:.2f} of the nodes' CPU per message"
        print(line)


async def _bench(opts: argparse.Namespace, endpoints: list[str], node_pids: list[int]) -> tuple[Storm, Storm]:
    run_id = f"{time.time_ns() // 1_000_000:x}"
    filters = [f"storm/{run_id}/f{k}/#" for k in range(opts.filters)]
    say = (lambda _: None) if opts.json else (lambda text: print(text, flush=True))
    async with aio.Client(endpoints, settings=connection(opts, 60.0)) as client:
        n_shards = (await client.cluster_map()).n_shards
        say(
            f"mqds bench --reconnect-storm: {opts.sessions:,} persistent sessions, a backlog of {opts.backlog:,} "
            f"messages ({opts.size} B) each, on {opts.filters:,} filters ({_each(opts.sessions, opts.filters)}), "
            f"all back within {opts.window:g} s; {len(endpoints)} node(s), {n_shards} vnodes"
        )
        sets = {
            name: [(f"storm-{run_id}-{name}{i}", filters[i % opts.filters]) for i in range(opts.sessions)]
            for name in ("s", "b")
        }
        line = ProgressLine()
        try:
            # Each session subscribed once (its read position starts then), then went away.
            pairs = sets["s"] + sets["b"]
            started = 0
            for first in range(0, len(pairs), 5_000):
                chunk = pairs[first : first + 5_000]
                await client.fetch_offline_many(chunk, start="now", max_count=1)
                started += len(chunk)
                line.show(f"  preparing: {started:,}/{len(pairs):,} read positions started", final=False)
            stored = 0
            for k in range(opts.filters):
                topic = f"storm/{run_id}/f{k}/t"
                payload = b"x" * opts.size
                for first in range(0, opts.backlog, 1_000):
                    batch = [
                        Message(topic, payload, sender=f"storm-pub-{i % PUBLISHERS}", qos=1)
                        for i in range(first, min(opts.backlog, first + 1_000))
                    ]
                    await client.store_batch(batch)
                    stored += len(batch)
                line.show(f"  preparing: {stored:,}/{opts.filters * opts.backlog:,} backlog messages stored")
            line.show(f"  preparing: done ({len(pairs):,} read positions, {stored:,} messages)", final=True)
        finally:
            line.close()
        fetches = OfflineFetches(client)
        shared = await _storm(opts, "storm", sets["s"], fetches.fetch, client, node_pids)
        shared.calls = fetches.calls
        gate = asyncio.Semaphore(BASELINE_IN_FLIGHT)

        async def one(request: OfflineFetch) -> list[Message]:
            async with gate:
                return await client.fetch_offline(
                    request.clientid, request.topic_filter, max_count=request.max_count, start=request.start
                )

        baseline = await _storm(opts, "baseline", sets["b"], one, client, node_pids)
    for storm in (shared, baseline):
        if storm.short:
            raise CommandError(f"{storm.short:,} sessions did not get exactly their backlog of {opts.backlog:,}")
    return shared, baseline


async def _storm(
    opts: argparse.Namespace,
    name: str,
    sessions: list[tuple[str, str]],
    fetch: Callable[[OfflineFetch], Awaitable[list[Message]]],
    client: Any,
    node_pids: list[int],
) -> Storm:
    """Every session comes back at its time in the window and takes its backlog, page by page."""
    done = 0
    delivered = 0
    short = 0
    line = ProgressLine()
    began = time.monotonic()

    async def session(i: int, clientid: str, topic_filter: str) -> None:
        nonlocal done, delivered, short
        await asyncio.sleep(max(0.0, began + opts.window * i / len(sessions) - time.monotonic()))
        got = 0
        while True:
            page = await fetch(OfflineFetch(clientid, topic_filter, max_count=PAGE, start="now"))
            got += len(page)
            delivered += len(page)
            if len(page) < PAGE:
                break
            await client.ack(clientid, topic_filter, page[-1])
        short += got != opts.backlog
        done += 1

    async def progress() -> None:
        while True:
            elapsed = time.monotonic() - began
            line.show(
                f"  {name:<8} {bar(done / len(sessions))} {done:>7,}/{len(sessions):,} sessions  "
                f"{delivered:>10,} delivered  {elapsed:6.1f} s"
            )
            await asyncio.sleep(0.5)

    cpu_before = _cpu_total(node_pids) if node_pids else None
    shower = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(session(i, c, f) for i, (c, f) in enumerate(sessions)))
    finally:
        shower.cancel()
    seconds = time.monotonic() - began
    cpu_after = _cpu_total(node_pids) if node_pids else None
    line.show(
        f"  {name:<8} {bar(1.0)} {done:>7,}/{len(sessions):,} sessions  {delivered:>10,} delivered  {seconds:6.1f} s",
        final=True,
    )
    line.close()
    cpu = None
    if cpu_before is not None and cpu_after is not None and delivered:
        cpu = round((cpu_after - cpu_before) * 1000 / delivered * 1000, 3)
    return Storm(seconds, delivered, cpu, short)


def register_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``mqds bench --reconnect-storm`` (with bench's --size, --start-cluster, --data-dir, --json)."""
    group = parser.add_argument_group("--reconnect-storm: persistent sessions with a backlog come back at once")
    group.add_argument(
        "--reconnect-storm",
        action="store_true",
        help="instead of the store load: --sessions persistent sessions, each subscribed to one of --filters "
        "filters with a backlog of --backlog messages (--size bytes), all reconnect within --window seconds and "
        "fetch their backlogs; print the time until every backlog was delivered, delivered msg/s and the nodes' "
        "CPU per 1,000 delivered messages (--start-cluster or --data-dir), for the brokers' coalesced shared "
        "fetches and for the baseline, one fetch_offline per session, measured in the same run. --json keys "
        "storm_s, storm_baseline_s, storm_msgs_per_s, server_cpu_ms_per_1000_delivered, "
        "baseline_server_cpu_ms_per_1000_delivered",
    )
    group.add_argument(
        "--sessions",
        type=int,
        default=DEFAULT_SESSIONS,
        metavar="N",
        help=f"persistent sessions of --reconnect-storm (default {DEFAULT_SESSIONS:,}; the baseline has as many "
        "others)",
    )
    group.add_argument(
        "--backlog",
        type=int,
        default=DEFAULT_BACKLOG,
        metavar="N",
        help=f"messages each session missed (default {DEFAULT_BACKLOG}), fetched in pages of {PAGE}",
    )
    group.add_argument(
        "--filters",
        type=int,
        default=DEFAULT_FILTERS,
        metavar="K",
        help=f"distinct topic filters the sessions subscribe to, session i to filter i mod K (default "
        f"{DEFAULT_FILTERS}: many sessions share each filter and its backlog; K = --sessions gives each its own)",
    )
    group.add_argument(
        "--window",
        type=float,
        default=DEFAULT_WINDOW_S,
        metavar="SECONDS",
        help=f"every session reconnects within this long, evenly spread (default {DEFAULT_WINDOW_S:g}; 0: all at once)",
    )
