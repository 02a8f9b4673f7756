"""Measurements of several kinds taken in alternation, so that a slow spell of the machine falls on each.

The development benchmarks that set two or three ways of doing one thing
side by side (``bench_links``: gRPC streams and a socket; ``bench_front``:
three front ends) take one measurement of each kind per round, in the same
order every round, print a line per measurement as it comes, or with
``--json`` one object of every kind's measurements at the end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["alternate"]

R = TypeVar("R")


def alternate(
    kinds: Sequence[str],
    rounds: int,
    measure: Callable[[str], R],
    line: Callable[[str, R], str],
    as_json: bool,
) -> dict[str, list[R]]:
    """``measure`` each kind once per round, kinds in turn; print ``line`` of each, or the JSON report at the end."""
    report: dict[str, list[R]] = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind in kinds:
            result = measure(kind)
            report[kind].append(result)
            if not as_json:
                print(line(kind, result), flush=True)
    if as_json:
        print(json.dumps(report, indent=2))
    return report
