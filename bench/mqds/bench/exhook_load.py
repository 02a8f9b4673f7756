"""Load for an ExHook provider (``mqds exhook``): concurrent ``OnMessagePublish`` calls, as EMQX makes them.

Used by ``mqds bench --small-writes``. Each load process runs ``callers``
asyncio tasks on one grpc.aio channel; each task calls
``emqx.exhook.v3.HookProvider/OnMessagePublish`` with a one-message request
(QoS 1, its own clientid, so the provider's rules store it), waits for the
answer and calls again, until the common end. A call's latency is the call's
round trip, which is what an EMQX publisher waits for on that hook.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mqds.bench.load import TOPIC_PREFIX, Progress, RunResult, Shared, drive, pct_ms

CALL_TIMEOUT_S = 10.0


@dataclass
class CallerSpec:
    address: str
    name: str
    callers: int
    size: int
    duration_s: float


async def _callers(spec: CallerSpec, shared: Shared, end_at: float, out: dict[str, Any]) -> None:
    import grpc

    from mqds.broker.exhook.v3 import exhook_pb2 as pb
    from mqds.broker.exhook.v3 import exhook_pb2_grpc as pb_grpc

    payload = os.urandom(spec.size)
    async with grpc.aio.insecure_channel(spec.address) as channel:
        stub = pb_grpc.HookProviderStub(channel)

        async def caller(index: int) -> None:
            clientid = f"bench-exhook-{spec.name}-{index}"
            topic = f"{TOPIC_PREFIX}/{clientid}/0"
            n = 0
            while time.time() < end_at:
                n += 1
                message = pb.Message(
                    node="emqx@bench",
                    id=f"{clientid}-{n}",
                    qos=1,
                    topic=topic,
                    payload=payload,
                    timestamp=int(time.time() * 1000),
                    headers={"protocol": "mqtt", "peerhost": "127.0.0.1"},
                    **{"from": clientid},
                )
                t0 = time.perf_counter()
                try:
                    await stub.OnMessagePublish(pb.MessagePublishRequest(message=message), timeout=CALL_TIMEOUT_S)
                except grpc.aio.AioRpcError:
                    out["failures"] += 1
                    await asyncio.sleep(0.05)
                    continue
                out["latencies"].append(time.perf_counter() - t0)
                shared.count(1)

        await asyncio.gather(*(caller(i) for i in range(spec.callers)))


def _drive_exhook(args: tuple[CallerSpec, Shared]) -> dict[str, Any]:
    spec, shared = args
    out: dict[str, Any] = {"latencies": [], "failures": 0}
    start_at = shared.wait_for_start()
    cpu_before = time.process_time()
    asyncio.run(_callers(spec, shared, start_at + spec.duration_s, out))
    out["cpu_s"] = time.process_time() - cpu_before
    shared.results.put(out)
    return out


def run_exhook_load(
    address: str,
    callers: int,
    processes: int,
    size: int,
    duration_s: float,
    *,
    progress: Progress | None = None,
    sample: Callable[[], float | None] | None = None,
) -> RunResult:
    """``callers`` concurrent OnMessagePublish callers, shared by ``processes`` processes, for ``duration_s``."""
    if callers < 1 or processes < 1 or size < 0 or duration_s <= 0:
        raise ValueError("callers and processes must be at least 1, size at least 0, duration above 0")
    processes = min(processes, callers)
    specs = [
        CallerSpec(address, f"{os.getpid()}-{i}", callers // processes + (i < callers % processes), size, duration_s)
        for i in range(processes)
    ]
    collected, start_at, end_at, sampled = drive(_drive_exhook, specs, duration_s, progress=progress, sample=sample)
    latencies = sorted(x for r in collected for x in r["latencies"])
    if not latencies:
        raise RuntimeError("no OnMessagePublish call was answered")
    return RunResult(
        len(latencies) / duration_s,
        pct_ms(latencies, 0.5),
        pct_ms(latencies, 0.99),
        pct_ms(latencies, 0.999),
        len(latencies),
        [],
        failed_batches=sum(r["failures"] for r in collected),
        start_at=start_at,
        end_at=end_at,
        acked_msgs=len(latencies),
        latencies_s=latencies,
        load_cpu_s=sum(r["cpu_s"] for r in collected),
        sampled=sampled,
    )
