"""What one Raft hop costs: a frame's round trip between two processes over gRPC streams or a plain socket.

``python -m mqds.bench.links`` starts two processes that bounce a frame
back and forth, each through a "Raft thread" of its own (a queue in, a send
out), the way two nodes' groups talk. Over ``grpc``, each process keeps a
client-streaming call to the other fed by a request iterator, and receives
on a server handler thread, as ``mqds.server.raft.transport`` does; over
``tcp``, the Raft thread writes length-prefixed frames to a socket itself and
one thread per connection reads them. The two kinds alternate (``--rounds``)
and it prints, for each, the round trip's p50 and p99 and the initiating
process's CPU per round trip: a write's Raft round makes one such round trip
to each follower, so this is the transport's share of a small write's
latency and CPU (see docs/performance.md, "Where a small call's cost goes").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from mqds.tools.alternation import alternate
from mqds.tools.ports import free_port

_STOP = b"stop"
_LENGTH = struct.Struct(">I")


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _measure(send: Callable[[bytes], None], inbox: queue.Queue[bytes], count: int, size: int) -> dict[str, float]:
    """Bounce ``count`` frames of ``size`` bytes off the peer; the round trips' p50/p99 and CPU per round trip."""
    frame = b"x" * size
    for _ in range(min(200, count)):  # warm up
        send(frame)
        inbox.get()
    latencies = []
    cpu_before = _cpu_s()
    for _ in range(count):
        started = time.perf_counter()
        send(frame)
        inbox.get()
        latencies.append(time.perf_counter() - started)
    cpu = _cpu_s() - cpu_before
    latencies.sort()
    return {
        "p50_us": round(latencies[len(latencies) // 2] * 1e6, 1),
        "p99_us": round(latencies[int(len(latencies) * 0.99)] * 1e6, 1),
        "cpu_us_per_round_trip": round(cpu / count * 1e6, 1),
    }


def _echo(send: Callable[[bytes], None], inbox: queue.Queue[bytes]) -> None:
    while (frame := inbox.get()) != _STOP:
        send(frame)


def _grpc_side(port: int, peer: int, initiator: bool, count: int, size: int, out: Any) -> None:
    inbox: queue.Queue[bytes] = queue.Queue()

    def push(frames: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        for frame in frames:
            inbox.put(frame)
        return b""

    handler = grpc.method_handlers_generic_handler("bench.Link", {"Push": grpc.stream_unary_rpc_method_handler(push)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    outgoing: queue.Queue[bytes | None] = queue.Queue()

    def frames() -> Iterator[bytes]:
        while (frame := outgoing.get()) is not None:
            yield frame

    channel = grpc.insecure_channel(f"127.0.0.1:{peer}")
    grpc.channel_ready_future(channel).result(timeout=30)
    call = channel.stream_unary("/bench.Link/Push").future(frames())
    if initiator:
        out.put(_measure(outgoing.put, inbox, count, size))
        outgoing.put(_STOP)
    else:
        _echo(outgoing.put, inbox)
    time.sleep(0.3)
    outgoing.put(None)
    call.cancel()
    server.stop(0)


def _tcp_side(port: int, peer: int, initiator: bool, count: int, size: int, out: Any) -> None:
    inbox: queue.Queue[bytes] = queue.Queue()
    listener = socket.create_server(("127.0.0.1", port))

    def receive() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = conn.makefile("rb")
        while header := reader.read(_LENGTH.size):
            (length,) = _LENGTH.unpack(header)
            inbox.put(reader.read(length))

    threading.Thread(target=receive, daemon=True).start()
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", peer))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(frame: bytes) -> None:
        sock.sendall(_LENGTH.pack(len(frame)) + frame)

    if initiator:
        out.put(_measure(send, inbox, count, size))
        send(_STOP)
    else:
        _echo(send, inbox)
    time.sleep(0.3)
    sock.close()


_SIDES = {"grpc": _grpc_side, "tcp": _tcp_side}


def run_pair(kind: str, count: int, size: int) -> dict[str, float]:
    """One measurement of ``kind`` (``grpc`` or ``tcp``) between two fresh processes."""
    ports = (free_port(), free_port())
    results: Any = mp.get_context("spawn").Queue()
    ctx = mp.get_context("spawn")
    side = _SIDES[kind]
    echo = ctx.Process(target=side, args=(ports[1], ports[0], False, count, size, results))
    initiator = ctx.Process(target=side, args=(ports[0], ports[1], True, count, size, results))
    echo.start()
    initiator.start()
    try:
        result: dict[str, float] = results.get(timeout=300)
    finally:
        for process in (initiator, echo):
            process.join(30)
            if process.is_alive():
                process.kill()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mqds.bench.links",
        description="Round trip of a frame between two processes, each through a thread of its own, over gRPC "
        "client streams (as the Raft transport does) and over a plain TCP socket; the two alternate.",
    )
    parser.add_argument("--count", type=int, default=3000, help="round trips per measurement (default 3000)")
    parser.add_argument("--size", type=int, default=300, help="frame bytes (default 300: a one-message append)")
    parser.add_argument("--rounds", type=int, default=2, help="measurements of each kind, alternating (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    opts = parser.parse_args(argv)
    if opts.count < 1 or opts.size < 0 or opts.rounds < 1:
        parser.error("--count and --rounds must be at least 1, --size at least 0")
    # The children inherit it: gRPC's notice of the peer's GOAWAY at the end of each pair is not news.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

    def line(kind: str, result: dict[str, float]) -> str:
        return (
            f"{kind:4}  round trip p50 {result['p50_us']:7.1f} us  p99 {result['p99_us']:7.1f} us  "
            f"CPU {result['cpu_us_per_round_trip']:6.1f} us per round trip (initiating process)"
        )

    alternate(("grpc", "tcp"), opts.rounds, lambda kind: run_pair(kind, opts.count, opts.size), line, opts.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
