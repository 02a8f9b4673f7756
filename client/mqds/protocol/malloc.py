"""glibc malloc's thresholds for processes that move answers of megabytes: the nodes and the ``mqds`` command.

By default glibc serves an allocation above its mmap threshold (128 KiB, raised
as such blocks are freed) with pages of its own and gives them back on free,
and hands free memory at a heap's top back to the system past its trim
threshold. A process that builds or receives an answer of a few megabytes
every few milliseconds then takes a page fault for every 4 KiB of it, the
kernel zeroing each page, and unmaps it again: 8% of a replaying node's CPU and
9% of the replaying client's (docs/performance.md, "2026-11-29 (later): the answers
in C; malloc and the collector").

``tune_malloc`` serves blocks up to ``MMAP_THRESHOLD`` from the heaps and lets
each heap keep ``TRIM_THRESHOLD`` free for the next answer. It is process-wide,
so the client library never calls it on its own: ``mqds`` commands do, and an
application that replays a lot may (``mqds.protocol.malloc.tune_malloc()``).
"""

from __future__ import annotations

import ctypes
import ctypes.util

MMAP_THRESHOLD = 4 * 1024 * 1024
"""Blocks below this come from malloc's heaps (a 10,000-message answer of 100-byte payloads is 1.5 MiB)."""
TRIM_THRESHOLD = 16 * 1024 * 1024
"""Free memory a heap keeps at its top before handing it back (each thread's heap: the bound it adds)."""
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's mmap and trim thresholds for this process; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold))
