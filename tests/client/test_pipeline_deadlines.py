"""Every pipelined call settles by its deadline, and a stopped leader does not hold its calls until then.

A chaos run (10 minutes, mixed faults, a loaded machine) failed because a
pipelined publisher's calls were still in flight 16 s after the workload
paused: a stream to a node that stopped answering (SIGSTOP keeps the
connection open, and so does a frozen VM) held every call sent on it, and
every later call of its shards, until each call's own deadline (30 s for
those publishers). Now a stream that answers nothing for ``stall_s`` is
given up and its batches go to the shards' leaders again (same sequences:
stored once), and a call settles at its deadline wherever it waits.
Real nodes on loopback; the sync and asyncio clients alike.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator

import pytest
from harness import replayed, sender_on

from mqds.client import Client, Message, aio
from mqds.client import errors as E
from mqds.client.core.pipeline import PipelineLimits
from mqds.tools.local_cluster import LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_SHARDS = 4
# What "by its deadline" allows on a loaded 2-core machine: the timer's wake-up and the publishing.
SLACK_S = 1.5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("deadlines") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        c.wait_leaders_settled()
        yield c


def test_calls_on_a_stopped_leaders_stream_move_to_the_new_leader_long_before_their_deadline(
    cluster: LocalCluster,
) -> None:
    """SIGSTOP the leader while calls are in flight on its stream: they are stored elsewhere, each once."""
    shard = 1
    sender = sender_on(shard, "stall", N_SHARDS)
    deadline_s = 25.0
    with Client(cluster.addresses, timeout_s=30, pipeline=PipelineLimits(stall_s=1.0)) as client:
        client.publish(Message("stall/a", b"warm", sender, qos=1))
        victim = cluster.wait_for_leader(shard)
        cluster.nodes[victim].pause()
        try:
            started = time.monotonic()
            pending = [
                client.store_async(Message("stall/a", str(i).encode(), sender, qos=1), timeout_s=deadline_s)
                for i in range(200)
            ]
            results = [f.result(timeout=deadline_s + 10) for f in pending]
            took = time.monotonic() - started
        finally:
            cluster.nodes[victim].resume()
    # Before: 12 s here, until HTTP/2's ping timeout (10 s) broke the connection (and the whole deadline
    # when that timeout is longer than the call's); now stall_s, then a resend through a replica's hint.
    assert took < 6.0, f"the calls took {took:.1f} s: they waited on the stopped node"
    stamps = [r[0].timestamp_us or 0 for r in results]
    assert stamps == sorted(stamps) and all(stamps), "acknowledged out of call order"
    cluster.wait_leaders_settled(60)
    counts = collections.Counter(m.payload for m in replayed(cluster, "stall/a"))
    assert set(counts) == {b"warm"} | {str(i).encode() for i in range(200)}
    assert max(counts.values()) == 1, "a message was stored twice"


def test_every_call_settles_by_its_deadline_when_no_node_answers(cluster: LocalCluster) -> None:
    """Every node SIGSTOPped with calls queued, sealed and sent: each settles within its deadline plus a slack."""
    deadline_s = 3.0
    with Client(cluster.addresses, timeout_s=30, max_in_flight_messages=100) as client:
        client.publish(Message("stop/a", b"warm", sender_on(0, "stop", N_SHARDS), qos=1))
        for node in cluster.nodes.values():
            node.pause()
        try:
            pending = []
            settled_at: dict[int, float] = {}
            for i in range(300):  # more than the window: the last ones wait for room, until their deadline
                sender = sender_on(i % N_SHARDS, "stop", N_SHARDS)
                submitted = time.monotonic()
                handle = client.store_async(Message("stop/a", str(i).encode(), sender, qos=1), timeout_s=deadline_s)
                handle.add_done_callback(lambda _h, i=i: settled_at.setdefault(i, time.monotonic()))
                pending.append((submitted, handle))
            late = []
            for i, (submitted, handle) in enumerate(pending):
                assert handle.wait(submitted + deadline_s + SLACK_S - time.monotonic()), "still in flight"
                late.append(settled_at[i] - submitted - deadline_s)
                with pytest.raises((E.DeadlineExceededError, E.UnavailableError)):
                    handle.result(timeout=0)
        finally:
            for node in cluster.nodes.values():
                node.resume()
    assert max(late) < SLACK_S
    cluster.wait_leaders_settled(60)


def test_the_asyncio_client_settles_every_call_by_its_deadline_too(cluster: LocalCluster) -> None:
    deadline_s = 3.0
    limits = PipelineLimits(stall_s=1.0)

    async def run() -> tuple[float, list[BaseException | None]]:
        async with aio.Client(cluster.addresses, timeout_s=30, pipeline=limits) as client:
            await client.publish(Message("astop/a", b"warm", sender_on(2, "astop", N_SHARDS), qos=1))
            for node in cluster.nodes.values():
                node.pause()
            try:
                started = time.monotonic()
                pending = [
                    await client.store_async(
                        Message("astop/a", str(i).encode(), sender_on(i % N_SHARDS, "astop", N_SHARDS), qos=1),
                        timeout_s=deadline_s,
                    )
                    for i in range(100)
                ]
                await asyncio.wait(pending, timeout=deadline_s + SLACK_S)
                took = time.monotonic() - started
                return took, [f.exception() if f.done() else None for f in pending]
            finally:
                for node in cluster.nodes.values():
                    node.resume()

    took, outcomes = asyncio.run(run())
    assert took < deadline_s + SLACK_S
    assert all(isinstance(err, (E.DeadlineExceededError, E.UnavailableError)) for err in outcomes)
    cluster.wait_leaders_settled(60)
