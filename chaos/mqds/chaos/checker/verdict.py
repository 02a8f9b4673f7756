"""The whole verdict of a run: every check over the history, the final read and the replicas' digests."""

from __future__ import annotations

from collections.abc import Sequence

from mqds.chaos.checker.availability import write_outages
from mqds.chaos.checker.consumers import check_consumers
from mqds.chaos.checker.followers import check_followers
from mqds.chaos.checker.hostile import check_hostile
from mqds.chaos.checker.reads import check_reads
from mqds.chaos.checker.result import CheckResult, Convergence
from mqds.chaos.history import History, ReadMessage


def check(
    history: History,
    final: Sequence[ReadMessage] | None,
    convergence: Sequence[Convergence],
    n_shards: int,
    unparsable: int = 0,
) -> CheckResult:
    """The whole verdict of a run (see :mod:`mqds.chaos.checker`)."""
    # Nothing could be read back: only the counts (the runner records why).
    result = CheckResult(counts=history.counts()) if final is None else check_reads(history, final, unparsable)
    final_keys = None if final is None else {m.key for m in final}
    check_consumers(history, result, final_keys)
    check_followers(history, result, final_keys)
    if history.hostile is not None:
        check_hostile(history.hostile, result)
    result.convergence = list(convergence)
    result.outages = write_outages(history, n_shards)
    return result
