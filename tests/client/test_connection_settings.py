"""Keepalive and deadlines against a real node that stops answering (SIGSTOP), sync and asyncio."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc
import pytest

from mqds.client import Client, ConnectionSettings, aio
from mqds.client import errors as E
from mqds.client.aio import AsyncRouter
from mqds.client.sync.routing import Router
from mqds.tools.ports import free_port
from mqds.tools.processes import NodeProcess, thread_states
from mqds.v1 import storage_pb2 as pb

pytestmark = pytest.mark.integration

REQUEST = pb.ListGenerationsRequest(shards=[0])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    proc = NodeProcess(tmp_path_factory.mktemp("conn") / "n1", args=["--n-shards", "1"]).start()
    yield proc
    proc.kill()


def _failure(call: Callable[[], object]) -> tuple[grpc.StatusCode | None, float]:
    started = time.monotonic()
    try:
        call()
    except grpc.RpcError as err:
        return err.code(), time.monotonic() - started
    return None, time.monotonic() - started


async def _afailure(call: Awaitable[object]) -> tuple[grpc.StatusCode | None, float]:
    started = time.monotonic()
    try:
        await call
    except grpc.RpcError as err:
        return err.code(), time.monotonic() - started
    return None, time.monotonic() - started


def test_keepalive_notices_a_node_that_stopped_answering(node: NodeProcess) -> None:
    # Without keepalive a call to a frozen node waits for its whole deadline
    # (10 s here): the TCP connection stays up. With it, the unanswered ping
    # closes the connection within about keepalive_time + keepalive_timeout.
    settings = ConnectionSettings(keepalive_time_s=0.3, keepalive_timeout_s=0.5)
    router = Router([node.address], settings=settings)

    async def scenario() -> list[tuple[grpc.StatusCode | None, float]]:
        arouter = AsyncRouter([node.address], settings=settings)
        stub, astub = router.storage(node.address), arouter.storage(node.address)
        stub.ListGenerations(REQUEST, timeout=5)
        await astub.ListGenerations(REQUEST, timeout=5)
        node.pause()
        try:
            return list(
                await asyncio.gather(
                    asyncio.to_thread(_failure, lambda: stub.ListGenerations(REQUEST, timeout=10)),
                    _afailure(astub.ListGenerations(REQUEST, timeout=10)),
                )
            )
        finally:
            node.resume()
            await arouter.close()

    try:
        outcomes = asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        router.close()
    for code, elapsed in outcomes:
        assert code == grpc.StatusCode.UNAVAILABLE and elapsed < 4, outcomes


def test_deadline_errors_are_typed(node: NodeProcess) -> None:
    # The default deadline comes from the settings; a call's timeout_s overrides it.
    settings = ConnectionSettings(timeout_s=1.0)

    async def scenario() -> tuple[E.MqdsError, float]:
        async with aio.Client(node.address, timeout_s=20) as client:
            await client.list_generations()
            node.pause()
            try:
                started = time.monotonic()
                with pytest.raises(E.DeadlineExceededError) as exc:
                    await client.list_generations(timeout_s=1.0)
                return exc.value, time.monotonic() - started
            finally:
                node.resume()

    err, elapsed = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert elapsed < 4 and err.retriable and isinstance(err, TimeoutError)

    with Client(node.address, settings=settings) as client:
        client.list_generations()
        node.pause()
        try:
            started = time.monotonic()
            with pytest.raises(E.DeadlineExceededError):
                client.list_generations()
            assert time.monotonic() - started < 4
        finally:
            node.resume()
    with Client(node.address, settings=settings) as client:
        assert client.list_generations()  # the node is fine again


def test_a_missing_node_is_a_typed_error_naming_it() -> None:
    address = f"127.0.0.1:{free_port()}"

    async def scenario() -> None:
        async with aio.Client(address, timeout_s=3) as client:
            with pytest.raises(E.UnavailableError) as exc:
                await client.list_generations()
            assert address in exc.value.message and "Connection refused" in exc.value.message

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_paused_node_has_stopped_every_thread_when_pause_returns(node: NodeProcess) -> None:
    """Regression: the kernel stops a process's threads one by one as each next runs, so on a busy machine a
    node thread already awake went on answering calls after SIGSTOP was sent; a "paused" node answered this
    module's deadline calls in a few milliseconds. pause() now returns once no thread can run the node's code."""
    assert node.pid is not None
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)
    ]  # a busy machine, as under a full test run
    try:
        with Client(node.address, timeout_s=10) as client:
            for _ in range(30):
                client.list_generations()
                node.pause()
                try:
                    states = thread_states(node.pid)
                    # Stopped, or in the kernel (stops on its way out): none can run the node's code.
                    assert states and all(state in "TD" for state in states), states
                finally:
                    node.resume()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
