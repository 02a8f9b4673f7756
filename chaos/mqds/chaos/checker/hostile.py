"""The check of the hostile clients' answers: no INTERNAL or UNKNOWN, and no success of what must be refused."""

from __future__ import annotations

from mqds.chaos.checker.result import CheckResult, Finding
from mqds.chaos.history import HostileLog

INTERNAL_CODES = ("INTERNAL", "UNKNOWN")
"""Status codes no hostile request may get: a handler that failed instead of refusing the request clearly."""


def check_hostile(log: HostileLog, result: CheckResult) -> None:
    """The hostile clients' verdict, added to ``result``: findings, and the counts per kind and per status."""
    for answer in log.answers:
        if answer.code in INTERNAL_CODES:
            result.findings.append(
                Finding(
                    "hostile-internal",
                    f"{answer.kind} to {answer.node} at {answer.at:.2f}s: {answer.code}: {answer.detail}",
                )
            )
        elif answer.code == "OK" and answer.kind in log.must_refuse:
            result.findings.append(
                Finding(
                    "hostile-accepted",
                    f"{answer.kind} to {answer.node} at {answer.at:.2f}s: succeeded: it must be refused",
                )
            )
    if log.dropped:
        result.findings.append(Finding("hostile-internal", f"{log.dropped} more such answers (not kept)"))
    by_status = log.by_status()
    result.hostile = {
        "sent": log.sent,
        "by_status": by_status,
        "by_kind": {kind: dict(sorted(codes.items())) for kind, codes in sorted(log.counts.items())},
        "must_refuse": sorted(log.must_refuse),
        "examples": [
            {"kind": a.kind, "node": a.node, "code": a.code, "detail": a.detail, "at_s": round(a.at, 3)}
            for (_, _), a in sorted(log.examples.items())
            if a.code != "OK"
        ],
    }
    result.counts.update(
        {
            "hostile_sent": log.sent,
            "hostile_internal": sum(by_status.get(code, 0) for code in INTERNAL_CODES),
            "hostile_accepted": len(result.of_kind("hostile-accepted")),
        }
    )
