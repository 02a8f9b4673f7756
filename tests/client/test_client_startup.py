"""A client started before its cluster waits for it (sync and asyncio), until its timeout_s and no longer."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from mqds.client import Client, Message, aio
from mqds.client import errors as E
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.ports import free_port
from mqds.tools.processes import NodeProcess

pytestmark = pytest.mark.integration

# How long after the client's first call the nodes start.
LATE_S = 2.0


@pytest.fixture
def later() -> Iterator[Callable[[Callable[[], object]], None]]:
    """``later(start)``: run ``start`` LATE_S seconds from now, in a thread (joined after the test)."""
    timers: list[threading.Timer] = []

    def schedule(start: Callable[[], object]) -> None:
        timer = threading.Timer(LATE_S, start)
        timers.append(timer)
        timer.start()

    yield schedule
    for timer in timers:
        timer.cancel()
        timer.join()


def test_a_sync_client_started_before_its_node_waits_for_it(
    tmp_path: Path, later: Callable[[Callable[[], object]], None]
) -> None:
    node = NodeProcess(tmp_path / "n1", port=free_port(), args=["--n-shards", "2"])
    try:
        with Client(node.address, timeout_s=60) as client:
            later(node.launch)
            started = time.monotonic()
            stored = client.store_batch([Message(topic="boot/1", payload=b"x", sender="s", qos=1)])
            elapsed = time.monotonic() - started
            assert [m.payload for m in client.replay("boot/#")] == [b"x"]
    finally:
        node.kill()
    assert len(stored) == 1 and (stored[0].timestamp_us or 0) > 0
    assert LATE_S - 0.5 < elapsed < 60, elapsed


def test_an_asyncio_client_started_before_its_cluster_waits_for_it(
    tmp_path: Path, later: Callable[[Callable[[], object]], None]
) -> None:
    with LocalCluster(tmp_path / "c", 3, n_shards=2) as cluster:

        def launch_all() -> None:
            for proc in cluster.nodes.values():
                proc.launch()

        async def first_calls() -> float:
            async with aio.Client(cluster.addresses, timeout_s=90) as client:
                later(launch_all)
                started = time.monotonic()
                # Concurrent first calls of every kind: they share the map refreshes while they wait.
                cmap, generations, stored = await asyncio.gather(
                    client.cluster_map(),
                    client.list_generations(),
                    client.store_batch([Message(topic="boot/a", payload=b"y", sender="s", qos=1)]),
                )
                elapsed = time.monotonic() - started
            assert {n.address for n in cmap.nodes} == set(cluster.addresses)
            assert {g.shard for g in generations} == {0, 1}
            assert len(stored) == 1
            return elapsed

        elapsed = asyncio.run(asyncio.wait_for(first_calls(), 120))
    assert LATE_S - 0.5 < elapsed < 90, elapsed


def _nobody() -> list[str]:
    return [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]


def _check_gave_up(err: E.MqdsError, elapsed: float, timeout_s: float, endpoints: list[str]) -> None:
    # Not at once (0.01 s): after about the call's timeout_s, naming every endpoint tried and why.
    assert timeout_s - 0.5 < elapsed < timeout_s + 3, elapsed
    assert isinstance(err, E.UnavailableError) and err.retriable
    assert all(address in err.message for address in endpoints), err.message
    assert "Connection refused" in err.message and "still none after" in err.message, err.message


@pytest.mark.parametrize("timeout_s", [None, 2.0])
def test_a_sync_client_whose_nodes_never_start_gives_up_after_its_timeout(timeout_s: float | None) -> None:
    endpoints = _nobody()
    # timeout_s None: the settings' default deadline (2.5 s here); else the call's.
    with Client(endpoints, timeout_s=2.5) as client:
        started = time.monotonic()
        with pytest.raises(E.UnavailableError) as exc:
            client.list_generations(timeout_s=timeout_s)
        _check_gave_up(exc.value, time.monotonic() - started, timeout_s or 2.5, endpoints)
        started = time.monotonic()
        with pytest.raises(E.UnavailableError) as exc:
            client.cluster_map(timeout_s=timeout_s)
        _check_gave_up(exc.value, time.monotonic() - started, timeout_s or 2.5, endpoints)


def test_an_asyncio_client_whose_nodes_never_start_gives_up_after_its_timeout() -> None:
    endpoints = _nobody()

    async def scenario() -> None:
        async with aio.Client(endpoints, timeout_s=2.5) as client:
            calls: list[tuple[float, Callable[[], Awaitable[object]]]] = [
                (2.5, lambda: client.store_batch([Message(topic="t", payload=b"x", sender="s")])),
                (2.0, lambda: client.list_generations(timeout_s=2.0)),
                (2.0, lambda: client.cluster_map(timeout_s=2.0)),
            ]
            for timeout_s, call in calls:
                started = time.monotonic()
                with pytest.raises(E.UnavailableError) as exc:
                    await call()
                _check_gave_up(exc.value, time.monotonic() - started, timeout_s, endpoints)

    asyncio.run(asyncio.wait_for(scenario(), 60))
