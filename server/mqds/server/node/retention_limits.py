"""Retention limits by size and count on the vnodes this node leads: the maintenance loop's job for them.

For each rule of the cluster's retention policy that sets ``max_messages``,
``max_bytes`` or ``max_messages_per_topic`` (``storage/limits.py`` has the
semantics: per shard, the rule's messages, shares of filter-wide limits),
the leader of each vnode runs a pass every ``retention_check_interval_s``,
and at once when it becomes leader or the policy changes:

- it reads the rule's messages newest first, at most ``ROUND_KEYS`` keys a
  round (the pass goes on in the next round from its cursor, so the loop's
  other jobs are never held up long);
- a ``discard=old`` rule: what is over a limit is logged as ``TrimMessages``
  commands of at most ``STEP_KEYS`` messages, which every replica applies
  alike;
- a ``discard=new`` rule: the pass counts until the share is reached and
  gives the figure to ``StoreLimits``, which refuses the stores over it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from mqds.protocol.errors import MqdsError
from mqds.protocol.retention import has_limits
from mqds.server.cluster.store_limits import StoreLimits
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.node.hosting import Hosting
from mqds.server.node.retention_rules import report_removed
from mqds.server.storage.deletes import STEP_KEYS, StepResult
from mqds.server.storage.limits import Doomed, LimitPolicy, LimitScan

log = logging.getLogger(__name__)

ROUND_KEYS = 50_000
"""Keys one vnode's passes read in one maintenance round, all rules together; they go on in the next."""


@dataclass
class _ShardPasses:
    """The passes of one led vnode: its term, when its last passes began, those under way by rule."""

    term: int
    began: float = -1e18
    scans: dict[int, LimitScan] = field(default_factory=dict)


class RetentionLimits:
    """The limits job of one node: a pass per rule with limits, per vnode it leads."""

    def __init__(self, hosting: Hosting, interval_s: float, expired: Counter, admission: StoreLimits) -> None:
        self.hosting = hosting
        self.interval_s = interval_s
        self.expired = expired
        self.admission = admission
        """The figures of discard=new rules, which the Storage API's stores are checked against."""
        self._key: bytes | None = None
        self._policy: LimitPolicy | None = None
        self._shards: dict[int, _ShardPasses] = {}

    def _current(self) -> LimitPolicy | None:
        """The policy's limits (None: no rule sets any); a new policy starts every pass again."""
        meta = self.hosting.meta
        cmap = meta.map if meta is not None else None
        if cmap is None or not cmap.HasField("retention") or not any(has_limits(r) for r in cmap.retention.rules):
            key = None
        else:
            key = cmap.retention.SerializeToString(deterministic=True) + cmap.n_shards.to_bytes(4, "big")
        if key != self._key:
            self._key = key
            self._policy = None if cmap is None or key is None else LimitPolicy(cmap.retention, cmap.n_shards)
            self._shards.clear()
            self.admission.set_policy(self._policy)
        return self._policy

    def run_round(self) -> None:
        """Called every maintenance round: passes begun when due, those under way taken on."""
        policy = self._current()
        if policy is None:
            return
        for vnode in list(self.hosting.vnodes.values()):
            shard = vnode.shard
            if not vnode.group.is_leader:
                if self._shards.pop(shard, None) is not None:
                    self.admission.forget(shard)
                continue
            try:
                self._vnode_round(vnode, policy)
            except MqdsError as err:
                self._shards.pop(shard, None)
                self.admission.forget(shard)
                log.info("shard %d: retention limits postponed: %s", shard, err)

    def _vnode_round(self, vnode: Any, policy: LimitPolicy) -> None:
        shard = vnode.shard
        term = vnode.group.raft.term
        passes = self._shards.get(shard)
        if passes is None or passes.term != term:
            self.admission.forget(shard)
            passes = self._shards[shard] = _ShardPasses(term)
        if not passes.scans and time.monotonic() - passes.began >= self.interval_s:
            passes.began = time.monotonic()
            with vnode.replica.reading() as storage:
                top = storage.last_ts
            for rule in policy.rules:
                passes.scans[rule.index] = LimitScan(rule, top)
                if rule.discard_new:
                    self.admission.pass_began(shard, rule.index, term)
        read = 0
        removed = 0
        for index, scan in list(passes.scans.items()):
            doomed: Doomed = {}
            while not scan.done and read < ROUND_KEYS:
                with vnode.replica.reading() as storage:
                    read += storage.limit_scan(policy, scan, min(STEP_KEYS, ROUND_KEYS - read), doomed)
                if sum(len(t) for t in doomed.values()) >= STEP_KEYS:
                    removed += self._trim(shard, doomed)
                    doomed = {}
            removed += self._trim(shard, doomed)
            if not scan.done:
                break
            del passes.scans[index]
            if scan.topics_capped:
                log.warning(
                    "shard %d: %s: more than %d topics; the later ones were not trimmed per topic this pass",
                    shard,
                    scan.rule.describe(),
                    len(scan.topics),
                )
            if scan.rule.discard_new:
                self.admission.pass_done(shard, index, term, scan.messages, scan.bytes)
        report_removed(self.expired, shard, "limit", removed, "over retention limits", bool(passes.scans))

    def _trim(self, shard: int, doomed: Doomed) -> int:
        """Log what a pass found over the limits, at most ``STEP_KEYS`` messages a command; how many went."""
        removed = 0
        command = cpb.TrimMessages()
        count = 0
        for (generation, stream), stamps in sorted(doomed.items()):
            for start in range(0, len(stamps), STEP_KEYS):
                part = stamps[start : start + STEP_KEYS]
                if count + len(part) > STEP_KEYS:
                    removed += self._propose(shard, command)
                    command, count = cpb.TrimMessages(), 0
                command.streams.add(generation=generation, stream=stream, timestamps=part)
                count += len(part)
        if count:
            removed += self._propose(shard, command)
        return removed

    def _propose(self, shard: int, command: cpb.TrimMessages) -> int:
        result: StepResult = self.hosting.propose(shard, cpb.VnodeCommand(trim_messages=command).SerializeToString())
        return result.messages
