"""The node process's memory habits, set once at start: glibc's malloc and Python's cyclic collector.

A read answer is a few megabytes built from one tuple and two bytes objects per
message. Left at their defaults:

- glibc gives each answer's buffer pages of its own, faulted in and zeroed, and
  unmaps them again (``mqds.protocol.malloc``: 8% of a replaying node's CPU);
- Python's collector runs a young-generation pass every 700 tracked
  allocations, some 15 for each 10,000-message answer, and a full pass every
  hundred of those, walking every object of the node (the Raft logs' entries
  included): 3% of a replaying node's CPU, for rows that never form cycles.

So the node sets malloc's thresholds, raises the young generation's threshold,
and once it serves freezes the objects it started with out of the collector's
reach (``gc.freeze``). Figures: docs/performance.md,
"2026-11-29 (later): the answers in C; malloc and the collector".
"""

from __future__ import annotations

import gc
import logging

from mqds.protocol.malloc import tune_malloc

log = logging.getLogger(__name__)

GC_THRESHOLD = (50_000, 20, 20)
"""Young-generation allocations between passes, and the older generations' ratios (Python's: 700, 10, 10)."""


def tune_process() -> None:
    """Malloc's thresholds and the collector's, before the node starts."""
    if not tune_malloc():
        log.info("malloc's thresholds not set (not glibc): answers cost more CPU")
    gc.set_threshold(*GC_THRESHOLD)


def freeze_startup_objects() -> None:
    """Move every object that exists now out of the collector's reach (once the node serves)."""
    gc.collect()
    gc.freeze()
