"""The faults a chaos run injects, and the seeded schedule that picks them.

Each nemesis has ``inject`` (break something; say on whom, and which vnodes it
is expected to stop: those whose leader was hit, or that lost their majority)
and ``heal`` (put it back: restart, resume, reconnect). The runner holds each
fault for a while, heals it, waits until every vnode has a leader again, and
waits a quiet spell before the next one. Faults never overlap, so each write
outage belongs to one fault.

- :mod:`~mqds.chaos.nemesis.base`: :class:`Nemesis`, :class:`Env` (what a
  nemesis works with), :class:`Injection`;
- the fault kinds: :mod:`~mqds.chaos.nemesis.process` (kill, pause, wipe,
  clock skew), :mod:`~mqds.chaos.nemesis.cuts` (partition, bridge),
  :mod:`~mqds.chaos.nemesis.membership` (join and leave),
  :mod:`~mqds.chaos.nemesis.idle` (restarts after an idle spell),
  :mod:`~mqds.chaos.nemesis.disk` (power loss, a full, failing or slow disk:
  the nodes' data directories on fault filesystems);
- :mod:`~mqds.chaos.nemesis.schedule`: :data:`NEMESES` by name and the seeded
  :class:`Schedule`.
"""

from mqds.chaos.nemesis.base import (
    ADMIN_TIMEOUT_S,
    START_TIMEOUT_S,
    Env,
    Injection,
    Nemesis,
    NotRecovered,
    led_by,
)
from mqds.chaos.nemesis.cuts import Bridge, Partition, cut_off
from mqds.chaos.nemesis.disk import DiskError, DiskFull, DiskSlow, PowerLossAll, PowerLossMinority, PowerLossNode
from mqds.chaos.nemesis.idle import IDLE_MAX_HOLD_S, IDLE_READY_TIMEOUT_S, IdleRestart, IdleRestartAll
from mqds.chaos.nemesis.membership import Membership
from mqds.chaos.nemesis.process import ClockSkew, KillLeader, KillMinority, KillNode, PauseLeader, WipeNode
from mqds.chaos.nemesis.schedule import DISK_NEMESES, NEMESES, Planned, Schedule, mix

__all__ = [
    "ADMIN_TIMEOUT_S",
    "DISK_NEMESES",
    "IDLE_MAX_HOLD_S",
    "IDLE_READY_TIMEOUT_S",
    "NEMESES",
    "START_TIMEOUT_S",
    "Bridge",
    "ClockSkew",
    "DiskError",
    "DiskFull",
    "DiskSlow",
    "Env",
    "IdleRestart",
    "IdleRestartAll",
    "Injection",
    "KillLeader",
    "KillMinority",
    "KillNode",
    "Membership",
    "Nemesis",
    "NotRecovered",
    "Partition",
    "PauseLeader",
    "Planned",
    "PowerLossAll",
    "PowerLossMinority",
    "PowerLossNode",
    "Schedule",
    "WipeNode",
    "cut_off",
    "led_by",
    "mix",
]
