"""The clock every Raft timer reads: one indirection, so a simulation can run the groups on its own clock.

pysyncobj reads ``monotonicTime`` (an alias of ``time.monotonic``) for its
election deadlines, heartbeats and the answers it counts; mqds's own timers
(``timing.py``, ``transfer.py``, ``machine.py``) and the node's scheduler read
:func:`now`. Both go through :func:`now`, which reads the process's clock:
``time.monotonic`` unless a deterministic simulation (``tests/raft_sim.py``)
swapped in a simulated one with :func:`use`. Production never calls ``use``;
the cost is one Python call per reading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pysyncobj.syncobj
from pysyncobj.monotonic import monotonic as _monotonic

_clock: Callable[[], float] = _monotonic


def now() -> float:
    """The Raft clock's time in seconds (monotonic, unless a simulation set its own)."""
    return _clock()


@contextmanager
def use(clock: Callable[[], float]) -> Iterator[None]:
    """Read ``clock`` instead of the monotonic clock, for the whole process, until the block ends."""
    global _clock
    previous = _clock
    _clock = clock
    try:
        yield
    finally:
        _clock = previous


# pysyncobj reads its own alias inside ``pysyncobj.syncobj``: point it here, once.
pysyncobj.syncobj.monotonicTime = now
