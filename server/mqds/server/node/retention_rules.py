"""Retention per topic filter on the vnodes this node leads: the maintenance loop's job for it.

Once a policy is set (``mqds retention set``; the metadata group logs it in
the cluster map), every ``retention_check_interval_s`` the leader of each
vnode:

- drops whole the closed generations whose every stream outlived the
  longest period any of its topics has (``retention.droppable``): no key is
  rewritten and the disk comes back at once;
- if a stream may hold messages whose period ended since its last pass
  (``ShardStorage.retention_due``), logs a retention pass: steps of at most
  ``STEP_KEYS`` keys read, each carrying the policy and the leader's clock, so
  every replica removes the same messages (range deletions where all of a
  stream's topics share a period, one key per message otherwise). At most
  ``STEPS_PER_ROUND`` steps a round; the pass goes on in the next round from
  its cursor, so the loop's other jobs are never held up long.

Without a policy the node's ``retention_period_s`` applies, as before: whole
generations dropped once they ended that long ago (``Maintenance``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from mqds.protocol.errors import MqdsError
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.node.hosting import Hosting
from mqds.server.storage.deletes import STEP_KEYS, StepResult
from mqds.server.storage.retention import policy_of
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

STEPS_PER_ROUND = 20
"""Steps one vnode's pass logs in one maintenance round; the pass goes on in the next."""


@dataclass
class _Pass:
    """A vnode's retention pass in progress: its clock, the last complete pass's, where it is."""

    now_us: int
    after_us: int
    policy: bytes
    term: int
    cursor: pb.DeleteCursor | None = None


class RetentionRules:
    """The retention job of one node: state per vnode it leads (the last complete pass, one in progress)."""

    def __init__(
        self,
        hosting: Hosting,
        interval_s: float,
        clock: Callable[[], int],
        retention_drops: Counter,
        expired: Counter,
    ) -> None:
        self.hosting = hosting
        self.interval_s = interval_s
        self.clock = clock
        self.retention_drops = retention_drops
        self.expired = expired
        self._last_round = 0.0
        self._done: dict[int, tuple[int, bytes, int]] = {}
        """shard -> (clock of its last complete pass, the policy it applied, the Raft term it ran in)."""
        self._passes: dict[int, _Pass] = {}

    @property
    def policy(self) -> clpb.RetentionPolicy | None:
        meta = self.hosting.meta
        if meta is None:
            return None
        cmap = meta.map
        return cmap.retention if cmap.HasField("retention") else None

    def run_round(self) -> None:
        """Called every maintenance round: a pass per led vnode every ``interval_s``, or one in progress."""
        policy = self.policy
        if policy is None:
            return
        due = time.monotonic() - self._last_round >= self.interval_s
        if not due and not self._passes:
            return
        if due:
            self._last_round = time.monotonic()
        key = policy.SerializeToString(deterministic=True)
        for vnode in list(self.hosting.vnodes.values()):
            group = vnode.group
            if not group.is_leader:
                self._passes.pop(vnode.shard, None)
                continue
            try:
                self._vnode_round(vnode, policy, key, due)
            except MqdsError as err:
                self._passes.pop(vnode.shard, None)
                log.info("shard %d: retention postponed: %s", vnode.shard, err)

    def _vnode_round(self, vnode: Any, policy: clpb.RetentionPolicy, key: bytes, due: bool) -> None:
        shard = vnode.shard
        term = vnode.group.raft.term
        running = self._passes.get(shard)
        if running is not None and (running.policy != key or running.term != term):
            del self._passes[shard]  # the policy or the leadership changed: start again
            running = None
        if running is None:
            if not due:
                return
            now = self.clock()
            done = self._done.get(shard)
            # What an earlier pass removed is known only to the leader that ran it, under the same policy.
            after = done[0] if done is not None and done[1] == key and done[2] == term else 0
            with vnode.replica.reading() as storage:
                drops, may_expire = storage.retention_due(policy_of(policy), now, after)
            for generation in drops:
                body = cpb.VnodeCommand(drop_generation=cpb.DropGeneration(generation=generation))
                self.hosting.propose(shard, body.SerializeToString())
                self.retention_drops.labels(str(shard)).inc()
                log.info("shard %d: generation %d dropped (retention rules)", shard, generation)
            if not may_expire:
                self._done[shard] = (now, key, term)
                return
            running = self._passes[shard] = _Pass(now, after, key, term)
        removed = 0
        for _ in range(STEPS_PER_ROUND):
            command = cpb.ApplyRetention(
                now_us=running.now_us, policy=policy, after_us=running.after_us, max_keys=STEP_KEYS
            )
            if running.cursor is not None:
                command.cursor.CopyFrom(running.cursor)
            result: StepResult = self.hosting.propose(
                shard, cpb.VnodeCommand(apply_retention=command).SerializeToString()
            )
            removed += result.messages
            if result.cursor is None:
                self._passes.pop(shard, None)
                self._done[shard] = (running.now_us, key, term)
                break
            running.cursor = result.cursor.message()
        report_removed(self.expired, shard, "message", removed, "past their retention", shard in self._passes)


def report_removed(expired: Counter, shard: int, kind: str, removed: int, why: str, going_on: bool) -> None:
    """Count and log what a round of a retention job removed from a shard (nothing when it removed nothing)."""
    if not removed:
        return
    expired.labels(str(shard), kind).inc(removed)
    log.info("shard %d: removed %d messages %s%s", shard, removed, why, " (going on)" if going_on else "")
