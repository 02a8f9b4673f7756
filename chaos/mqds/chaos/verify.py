"""The end of a run: read everything back, compare the replicas, check the history, and the report.

:func:`verify` runs after the drain (:mod:`mqds.chaos.phases`): the final read
(from the leaders; from any replica if some vnode has no leader, a finding),
the replicas' digests until they agree, then the checker
(:func:`mqds.chaos.checker.check`) over the history, with the harness's own
findings added; the result is a :class:`Report`. :func:`print_report` prints
it the way ``python -m mqds.chaos`` does.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from mqds.chaos.checker import CheckResult, Convergence, Finding, ReplicaState, check
from mqds.chaos.history import TOPIC_FILTER, FaultRecord, ReadMessage, parse_message
from mqds.chaos.options import Options
from mqds.chaos.phases import ChaosRun
from mqds.chaos.report import json_report, text_report
from mqds.client import errors as E

# Bounds of the phases after the faults (every wait of a run is bounded).
CONVERGE_TIMEOUT_S = 120.0
FINAL_READ_TIMEOUT_S = 120.0


@dataclass
class Report:
    """What a run produced."""

    run: dict[str, Any]
    result: CheckResult
    faults: list[FaultRecord]
    text: str
    json: dict[str, Any]
    work_dir: Path

    @property
    def passed(self) -> bool:
        return self.result.passed


def final_read(chaos: ChaosRun) -> tuple[list[ReadMessage] | None, int]:
    """Everything stored, from the leaders; from any replica if some vnode has no leader (a finding)."""
    chaos.current = "reading everything back"
    last: Exception | None = None
    deadline = time.monotonic() + FINAL_READ_TIMEOUT_S
    for stale_ok in (False, True):
        while True:
            try:
                final = replay(chaos, stale_ok)
            except E.MqdsError as err:
                last = err
                if time.monotonic() > deadline:
                    break
                chaos.say(f"final read failed ({err}); again")
                time.sleep(5)
                continue
            if stale_ok:
                chaos.harness_findings.append(
                    Finding("unreadable", f"no linearizable read of everything after healing: {last}")
                )
            return final
        deadline = time.monotonic() + FINAL_READ_TIMEOUT_S / 2
    chaos.harness_findings.append(Finding("unreadable", f"could not read everything back, even stale: {last}"))
    return None, 0


def replay(chaos: ChaosRun, stale_ok: bool) -> tuple[list[ReadMessage], int]:
    """Every message under the run's topics, and how many could not be parsed."""
    with chaos.client() as client:
        out: list[ReadMessage] = []
        bad = 0
        for m in client.replay(TOPIC_FILTER, batch_size=5000, stale_ok=stale_ok):
            key = parse_message(m.topic, m.payload)
            if key is None:
                bad += 1
                continue
            out.append(ReadMessage(key[0], key[1], int(m.shard or 0), int(m.timestamp_us or 0)))
        return out, bad


def convergence(chaos: ChaosRun) -> list[Convergence]:
    """Per vnode: its replicas' digests, asked again until they agree (CONVERGE_TIMEOUT_S at most)."""
    chaos.current = "checking replicas"
    cluster = chaos.cluster
    assert cluster is not None
    deadline = time.monotonic() + CONVERGE_TIMEOUT_S
    out = []
    for shard in range(chaos.opts.shards):
        while True:
            detail = ""
            states: list[ReplicaState] = []
            try:
                replicas = cluster.placement()[shard]
                digests = cluster.digests(shard)
                states = [
                    ReplicaState(n, d.applied_index, d.sha256, d.keys) for n, d in digests.items() if n in replicas
                ]
                missing = sorted(set(replicas) - set(digests))
                if missing:
                    detail = f"no digest from {missing}"
                converged = not missing and len({(s.applied_index, s.sha256) for s in states}) == 1
            except (grpc.RpcError, RuntimeError) as err:
                converged, detail = False, f"digest failed: {err}"
            if converged or time.monotonic() > deadline:
                out.append(Convergence(shard, converged, states, detail))
                break
            time.sleep(0.5)
    return out


def verify(chaos: ChaosRun, began: float, network_kind: str, work: Path) -> Report:
    """After the drain: the final read, the replicas compared, the history checked; the report."""
    opts = chaos.opts
    final, unparsable = final_read(chaos)
    replicas = convergence(chaos)
    chaos.stop_progress()
    result = check(chaos.history, final, replicas, opts.shards, unparsable)
    result.findings.extend(chaos.harness_findings)
    run_info: dict[str, Any] = {
        "seed": opts.seed,
        "nodes": opts.nodes,
        "shards": opts.shards,
        "nemeses": opts.nemeses,
        "duration_s": opts.duration_s,
        "elapsed_s": round((chaos.history.workload_ended or chaos.history.clock()) - began, 1),
        "network": network_kind,
        "disk": opts.disk_mode,
        "publishers": len(chaos.publishers),
        "readers": len(chaos.readers),
        "followers": len(chaos.followers),
        "session_consumers": len(chaos.consumers),
        "consumer_poll_s": opts.consumer_poll_s,
        "batch": opts.batch,
        "call_timeout_s": opts.call_timeout_s,
        "generation_interval_s": opts.generation_interval_s,
        "raft_compaction_interval_s": opts.raft_compaction_interval_s,
        "idle_s": opts.idle_s,
        "hostile": opts.hostile,
        "work_dir": str(work),
    }
    faults = list(chaos.history.faults)
    return Report(
        run_info,
        result,
        faults,
        text_report(run_info, result, faults),
        json_report(run_info, result, faults),
        work,
    )


def print_report(report: Report, opts: Options) -> None:
    """The text report to stdout; the JSON report to ``--report-json`` when asked for."""
    print(report.text, end="")
    if opts.report_json is not None:
        opts.report_json.parent.mkdir(parents=True, exist_ok=True)
        opts.report_json.write_text(json.dumps(report.json, indent=2) + "\n")
        print(f"JSON report: {opts.report_json}")
    sys.stdout.flush()
