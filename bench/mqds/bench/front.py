"""What the public API's front end costs per call: gRPC's thread-pool server against one event loop.

``python -m mqds.bench.front`` starts a server process that answers a
unary call the way a node answers a store: the call is handed to a worker
thread (the node's Raft pass worker), which hands the answer back. Two front
ends alternate (``--rounds``), each in a fresh process:

- ``threads``: ``grpc.server`` with a thread pool, as mqds serves its public
  API now: gRPC's poller hands the call to a pool thread, which hands it to
  the worker and waits on an event the worker sets;
- ``loop``: ``grpc.aio.server``, one asyncio event loop: the handler hands
  the call to the worker and awaits a future the worker completes through
  ``call_soon_threadsafe``;
- ``inline``: the thread-pool server whose pool thread does the worker's
  part itself (the thread that receives a call runs its pass): no hand-off.

Two loads from a client process of their own: one caller, one call at a time
(the round trip's p50 and p99: the share of a lone write's latency that is
the front end's), and ``--callers`` concurrent callers of ``grpc.aio`` for
``--duration`` seconds (calls/s). Each prints the server's CPU per 1,000
calls, read from ``/proc`` (Linux). A one-message write's steps and this
front end's share of them: docs/performance.md, "where a one-message write's
time goes after the redesign".
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from mqds.tools.alternation import alternate
from mqds.tools.ports import free_port

__all__ = ["KINDS", "main", "run_kind"]

KINDS = ("threads", "loop", "inline")
_METHOD = "/bench.Front/Call"
_TICKS = os.sysconf("SC_CLK_TCK")


def _worker(jobs: queue.SimpleQueue[tuple[bytes, Callable[[bytes], None]] | None]) -> None:
    """The node's pass worker, reduced to the hand-off: take a call, give its answer back."""
    while (job := jobs.get()) is not None:
        request, answer = job
        answer(request[:16])


def _serve_threads(port: int, ready: Any, stop: Any, inline: bool = False) -> None:
    jobs: queue.SimpleQueue[tuple[bytes, Callable[[bytes], None]] | None] = queue.SimpleQueue()
    threading.Thread(target=_worker, args=(jobs,), daemon=True).start()

    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        done = threading.Event()
        box: list[bytes] = []

        def answer(body: bytes) -> None:
            box.append(body)
            done.set()

        jobs.put((request, answer))
        done.wait(30)
        return box[0]

    def call_inline(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request[:16]

    handler = grpc.method_handlers_generic_handler(
        "bench.Front", {"Call": grpc.unary_unary_rpc_method_handler(call_inline if inline else call)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    stop.wait()
    server.stop(0)


def _serve_loop(port: int, ready: Any, stop: Any) -> None:
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        jobs: queue.SimpleQueue[tuple[bytes, Callable[[bytes], None]] | None] = queue.SimpleQueue()
        threading.Thread(target=_worker, args=(jobs,), daemon=True).start()

        async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            future: asyncio.Future[bytes] = loop.create_future()

            def answer(body: bytes) -> None:
                loop.call_soon_threadsafe(future.set_result, body)

            jobs.put((request, answer))
            return await future

        handler = grpc.method_handlers_generic_handler(
            "bench.Front", {"Call": grpc.unary_unary_rpc_method_handler(call)}
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await loop.run_in_executor(None, stop.wait)
        await server.stop(0)

    asyncio.run(serve())


def _serve_inline(port: int, ready: Any, stop: Any) -> None:
    _serve_threads(port, ready, stop, inline=True)


_SERVERS = {"threads": _serve_threads, "loop": _serve_loop, "inline": _serve_inline}


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _one_caller(port: int, server_pid: int, count: int, size: int, out: Any) -> None:
    request = b"x" * size
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        call = channel.unary_unary(_METHOD)
        for _ in range(min(200, count)):  # warm up
            call(request, timeout=10)
        latencies = []
        cpu_before = _cpu_s(server_pid)
        for _ in range(count):
            started = time.perf_counter()
            call(request, timeout=10)
            latencies.append(time.perf_counter() - started)
        cpu = _cpu_s(server_pid) - cpu_before
    latencies.sort()
    out.put(
        {
            "p50_us": round(latencies[len(latencies) // 2] * 1e6, 1),
            "p99_us": round(latencies[int(len(latencies) * 0.99)] * 1e6, 1),
            "server_cpu_ms_per_1000": round(cpu / count * 1e6, 1),
        }
    )


def _many_callers(port: int, server_pid: int, callers: int, duration_s: float, size: int, out: Any) -> None:
    request = b"x" * size

    async def load() -> dict[str, float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await channel.channel_ready()
            call = channel.unary_unary(_METHOD)
            latencies: list[float] = []
            end = 0.0

            async def caller() -> None:
                while time.perf_counter() < end:
                    started = time.perf_counter()
                    await call(request, timeout=10)
                    latencies.append(time.perf_counter() - started)

            end = time.perf_counter() + min(1.0, duration_s)  # warm up
            await asyncio.gather(*(caller() for _ in range(callers)))
            latencies.clear()
            cpu_before = _cpu_s(server_pid)
            started = time.perf_counter()
            end = started + duration_s
            await asyncio.gather(*(caller() for _ in range(callers)))
            elapsed = time.perf_counter() - started
            cpu = _cpu_s(server_pid) - cpu_before
        return {
            "calls_per_s": round(len(latencies) / elapsed, 1),
            "p50_ms": round(statistics.median(latencies) * 1e3, 2),
            "server_cpu_ms_per_1000": round(cpu / max(1, len(latencies)) * 1e6, 1),
        }

    out.put(asyncio.run(load()))


def run_kind(kind: str, count: int, callers: int, duration_s: float, size: int) -> dict[str, dict[str, float]]:
    """Both loads against a fresh server process of front end ``kind`` (one of :data:`KINDS`)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_SERVERS[kind], args=(port, ready, stop), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError(f"the {kind} server did not start within 60 s")
        assert server.pid is not None
        result: dict[str, dict[str, float]] = {}
        for name, target, args in (
            ("one_caller", _one_caller, (count, size)),
            ("many_callers", _many_callers, (callers, duration_s, size)),
        ):
            results: Any = ctx.Queue()
            client = ctx.Process(target=target, args=(port, server.pid, *args, results))
            client.start()
            try:
                result[name] = results.get(timeout=300)
            finally:
                client.join(30)
                if client.is_alive():
                    client.kill()
        return result
    finally:
        stop.set()
        server.join(30)
        if server.is_alive():
            server.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mqds.bench.front",
        description="What a unary call costs the public API's front end: gRPC's thread-pool server (as mqds "
        "serves now) and a grpc.aio event loop, each handing the call to a worker thread and back (a "
        "node's Raft pass worker), and the thread-pool server doing the worker's part on the thread that "
        "received the call; the three alternate, each in a fresh server process.",
    )
    parser.add_argument("--count", type=int, default=3000, help="calls of the one-caller load (default 3000)")
    parser.add_argument("--callers", type=int, default=64, help="concurrent callers of the second load (default 64)")
    parser.add_argument(
        "--duration", type=float, default=5.0, help="seconds of the concurrent load, after 1 s of warm-up (default 5)"
    )
    parser.add_argument("--size", type=int, default=150, help="request bytes (default 150: a one-message store)")
    parser.add_argument("--rounds", type=int, default=2, help="measurements of each front end, alternating (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    opts = parser.parse_args(argv)
    if opts.count < 1 or opts.callers < 1 or opts.rounds < 1 or opts.size < 0 or not opts.duration > 0:
        parser.error("--count, --callers and --rounds must be at least 1, --size at least 0, --duration above 0")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

    def line(kind: str, result: dict[str, dict[str, float]]) -> str:
        one, many = result["one_caller"], result["many_callers"]
        return (
            f"{kind:7}  one caller: p50 {one['p50_us']:7.1f} us  p99 {one['p99_us']:7.1f} us  "
            f"server CPU {one['server_cpu_ms_per_1000']:6.1f} ms per 1,000 calls  |  "
            f"{opts.callers} callers: {many['calls_per_s']:8.1f} calls/s  p50 {many['p50_ms']:6.2f} ms  "
            f"server CPU {many['server_cpu_ms_per_1000']:6.1f} ms per 1,000 calls"
        )

    def measure(kind: str) -> dict[str, dict[str, float]]:
        return run_kind(kind, opts.count, opts.callers, opts.duration, opts.size)

    alternate(KINDS, opts.rounds, measure, line, opts.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
