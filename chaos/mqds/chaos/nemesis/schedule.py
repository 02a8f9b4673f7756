"""Every nemesis by name (:data:`NEMESES`; :data:`DISK_NEMESES` need fault filesystems), and the seeded
:class:`Schedule` that picks them.

:class:`Schedule` derives everything random from the run's seed: the order of
the nemeses (a new shuffle of all selected ones per cycle, so every nemesis
runs once per cycle), how long each fault is held, the quiet spells, and a
random generator per fault for its choice of targets. The same seed gives the
same schedule; which node is hit also depends on who leads what at that
moment, which the log and the report record.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from mqds.chaos.nemesis.base import Nemesis
from mqds.chaos.nemesis.cuts import Bridge, Partition
from mqds.chaos.nemesis.disk import DiskError, DiskFull, DiskSlow, PowerLossAll, PowerLossMinority, PowerLossNode
from mqds.chaos.nemesis.idle import IdleRestart, IdleRestartAll
from mqds.chaos.nemesis.membership import Membership
from mqds.chaos.nemesis.process import ClockSkew, KillLeader, KillMinority, KillNode, PauseLeader, WipeNode

NEMESES: dict[str, type[Nemesis]] = {
    cls.name: cls
    for cls in (
        KillLeader,
        KillNode,
        PauseLeader,
        KillMinority,
        WipeNode,
        Partition,
        Bridge,
        ClockSkew,
        Membership,
        IdleRestart,
        IdleRestartAll,
        PowerLossNode,
        PowerLossMinority,
        PowerLossAll,
        DiskFull,
        DiskError,
        DiskSlow,
    )
}
# Those that need the nodes' data directories on fault filesystems (--disk).
DISK_NEMESES = frozenset(
    cls.name for cls in (PowerLossNode, PowerLossMinority, PowerLossAll, DiskFull, DiskError, DiskSlow)
)


def mix(disks: bool) -> list[str]:
    """What ``--nemesis mix`` runs: every nemesis, the disk ones only on fault filesystems."""
    return [name for name in NEMESES if disks or name not in DISK_NEMESES]


@dataclass
class Planned:
    """One fault of the schedule."""

    index: int
    nemesis: str
    hold_s: float
    quiet_s: float
    rng: random.Random


class Schedule:
    """The seeded sequence of faults: every selected nemesis once per cycle, in a shuffled order."""

    def __init__(
        self,
        names: list[str],
        seed: int,
        hold_s: tuple[float, float] = (3.0, 8.0),
        quiet_s: tuple[float, float] = (2.0, 5.0),
    ) -> None:
        self.names = list(names)
        self.seed = seed
        self.hold_s = hold_s
        self.quiet_s = quiet_s
        self._rng = random.Random(seed)
        self._cycle: list[str] = []
        self._index = 0

    def __iter__(self) -> Schedule:
        return self

    def __next__(self) -> Planned:
        if not self._cycle:
            self._cycle = list(self.names)
            self._rng.shuffle(self._cycle)
        name = self._cycle.pop(0)
        self._index += 1
        hold = self._rng.uniform(*self.hold_s)
        quiet = self._rng.uniform(*self.quiet_s)
        fault_rng = random.Random(self._rng.getrandbits(64))
        return Planned(self._index, name, round(hold, 2), round(quiet, 2), fault_rng)
