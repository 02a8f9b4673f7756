"""Background maintenance: the node's one thread of periodic work.

Each round (every ``maintenance_interval_s``, sooner after a change: a new
role, a new cluster map; every 0.1 s while the node catches up):

- a node that is not a member yet asks its peers whether ``mqds admin join``
  admitted it, and opens its metadata replica once it was;
- replicas the metadata places here are created, and the ones it moved away
  deleted (``Hosting.reconcile``), and readiness is computed again;
- the metadata leader is told when this node's address changed;
- on vnodes this node leads: a new generation once the current one is
  ``generation_interval_s`` old, and generations past ``retention_period_s``
  dropped (both as log entries, so every replica agrees), or, once the
  cluster has a retention policy, what its rules ended removed
  (``retention_rules.py``);
- leadership handed back to each vnode's preferred replica, every
  ``leader_balance_interval_s``;
- on the metadata leader, every ``placement_repair_interval_s``, a check
  that each vnode's placement and Raft group agree (on a thread of its own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
from prometheus_client import Counter

from mqds.protocol.errors import MqdsError
from mqds.server.cluster import meta as meta_mod
from mqds.server.cluster.membership import Membership
from mqds.server.cluster.store_limits import StoreLimits
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.cluster.vnode import Vnode
from mqds.server.config import NodeConfig
from mqds.server.node.health import Health
from mqds.server.node.hosting import Hosting, add_generation_command
from mqds.server.node.peers import Peers
from mqds.server.node.retention_limits import RetentionLimits
from mqds.server.node.retention_rules import RetentionRules
from mqds.server.raft.cluster_auth import ClusterAuth
from mqds.server.raft.transport import PeerRouter
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc

log = logging.getLogger(__name__)

EXPIRE_STEP = 1000
"""Most expired retained messages, and most expired sessions, one logged command removes; and most stored messages
past their Message Expiry Interval (with their index entries) one ``ExpireMessages`` removes."""


class Maintenance:
    """The maintenance loop (``run``) and each of its jobs."""

    def __init__(
        self,
        config: NodeConfig,
        hosting: Hosting,
        health: Health,
        membership: Membership,
        *,
        peers: Peers,
        router: PeerRouter,
        auth: ClusterAuth,
        retention_drops: Counter,
        expired: Counter,
        clock: Callable[[], int],
        stopping: threading.Event,
        changed: threading.Event,
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self.hosting = hosting
        self.health = health
        self.membership = membership
        self.peers = peers
        self.router = router
        self.auth = auth
        self.retention_drops = retention_drops
        self.expired = expired
        self.clock = clock
        self._stopping = stopping
        self._changed = changed
        self._last_leader_balance = time.monotonic()
        self._last_placement_check = time.monotonic()
        self._placement_check: threading.Thread | None = None
        self._address_reported = False
        self.retention_rules = RetentionRules(
            hosting, config.retention_check_interval_s, clock, retention_drops, expired
        )
        self.retention_limits = RetentionLimits(hosting, config.retention_check_interval_s, expired, StoreLimits())
        """Limits by size and count per rule; its ``admission`` is what the Storage API's stores are checked against."""

    def run(self) -> None:
        """Rounds of maintenance until the node stops (the maintenance thread)."""
        interval = self.config.maintenance_interval_s
        hosting = self.hosting
        while not self._stopping.is_set():
            # Catching up (replicas without a leader or uninitialised): look
            # again soon, so readiness follows quickly. A joiner polls its
            # peers at the normal pace.
            catching_up = hosting.meta is not None and not self.health.ready()
            self._changed.wait(min(interval, 0.1) if catching_up else interval)
            self._changed.clear()
            if self._stopping.is_set():
                return
            try:
                if hosting.meta is None:
                    self._try_join()
                    continue
                hosting.reconcile()
                self.health.refresh()
                self._report_address()
                self._maintain_generations()
                self._expire()
                self.retention_rules.run_round()
                self.retention_limits.run_round()
                self._balance_leaders()
                self._check_placement()
            except Exception:
                log.exception("background work failed; will retry")

    def _try_join(self) -> None:
        """A node that is not a founder waits until `mqds admin join` made it a member."""
        for peer, address in sorted(self.config.peer_map().items()):
            if peer == self.node_id:
                continue
            try:
                cmap = clpb_grpc.ClusterStub(self.peers.channel(address)).GetClusterMap(
                    clpb.GetClusterMapRequest(), timeout=2, metadata=self.auth.metadata()
                )
            except grpc.RpcError:
                continue
            if not any(n.id == self.node_id for n in cmap.nodes):
                log.info(
                    "not a member of cluster %s yet; waiting for 'mqds admin join %s'", cmap.cluster_id, self.node_id
                )
                return
            initial = cpb.ClusterState(format=meta_mod.STATE_FORMAT, applied_index=cmap.version)
            initial.map.CopyFrom(cmap)
            initial.map.ClearField("answered_by")
            initial.map.ClearField("meta_leader")
            for vnode in initial.map.vnodes:
                vnode.ClearField("leader")
                vnode.ClearField("term")
            self.hosting.join(initial)
            self.health.refresh()
            log.info("joined cluster %s", cmap.cluster_id)
            self._changed.set()
            return

    def _report_address(self) -> None:
        meta = self.hosting.meta
        if self._address_reported or meta is None:
            return
        for node in meta.map.nodes:
            if node.id == self.node_id:
                if node.address == self.config.advertised:
                    self._address_reported = True
                    return
                cmd = cpb.MetaCommand(
                    set_address=cpb.SetNodeAddress(node_id=self.node_id, address=self.config.advertised)
                )
                try:
                    self.hosting.propose_meta(cmd, timeout_s=5)
                    log.info("told the cluster this node is now at %s", self.config.advertised)
                except MqdsError as err:
                    log.info("could not update this node's address yet: %s", err)
                return

    def _maintain_generations(self) -> None:
        interval_us = int(self.config.generation_interval_s * 1_000_000)
        retention_us = int(self.config.retention_period_s * 1_000_000)
        if self.retention_rules.policy is not None:
            retention_us = 0  # the cluster's retention policy supersedes the node's setting
        now = self.clock()
        propose = self.hosting.propose
        for vnode in list(self.hosting.vnodes.values()):
            # A shard being restored takes no command but the restore's (SHARD_RESTORING): its generations
            # come from the backup, or from the first store after the restore was abandoned.
            if not vnode.group.is_leader or vnode.replica.storage.restoring:
                continue
            try:
                gens = vnode.replica.generations()
                if not gens:
                    propose(vnode.shard, add_generation_command(now, 0))
                    continue
                current = gens[-1]
                if interval_us and now - max(current.since_us, current.created_at_us) >= interval_us:
                    info = propose(vnode.shard, add_generation_command(now, current.generation))
                    log.info("shard %d: generation %d started (interval)", vnode.shard, info.generation)
                if retention_us:
                    horizon = now - retention_us
                    for gen in gens:
                        if gen.until_us is not None and gen.until_us <= horizon:
                            body = cpb.VnodeCommand(drop_generation=cpb.DropGeneration(generation=gen.generation))
                            propose(vnode.shard, body.SerializeToString())
                            self.retention_drops.labels(str(vnode.shard)).inc()
                            log.info("shard %d: generation %d dropped (retention)", vnode.shard, gen.generation)
            except MqdsError as err:
                log.info("shard %d: generation maintenance postponed: %s", vnode.shard, err)

    def _expire(self) -> None:
        """In the vnodes led here: log the removal of what ended (retained messages, sessions, stored messages past
        their Message Expiry Interval), a bounded step each.

        The command carries the leader's clock, so every replica removes the
        same ones; a step removes at most ``EXPIRE_STEP`` of each kind and
        the next round logs another while more are due.
        """
        now = self.clock()
        for vnode in list(self.hosting.vnodes.values()):
            if not vnode.group.is_leader or vnode.replica.storage.restoring:
                continue
            self._expire_messages(vnode, now)
            try:
                with vnode.replica.reading() as storage:
                    if not storage.sessions.expiry_due(now):
                        continue
                body = cpb.VnodeCommand(
                    session=cpb.SessionCommand(now_us=now, expire=cpb.Expire(max_count=EXPIRE_STEP))
                )
                retained, sessions = self.hosting.propose(vnode.shard, body.SerializeToString())
                label = str(vnode.shard)
                self.expired.labels(label, "retained").inc(retained)
                self.expired.labels(label, "session").inc(sessions)
                log.info(
                    "shard %d: removed %d expired retained messages, %d expired sessions",
                    vnode.shard,
                    retained,
                    sessions,
                )
            except MqdsError as err:
                log.info("shard %d: removing what expired postponed: %s", vnode.shard, err)

    def _expire_messages(self, vnode: Vnode, now: int) -> None:
        """Log one ``ExpireMessages`` step in a vnode led here whose expiry index has a message due at ``now``."""
        try:
            with vnode.replica.reading() as storage:
                if not storage.messages_expiry_due(now):
                    return
            body = cpb.VnodeCommand(expire_messages=cpb.ExpireMessages(now_us=now, max_count=EXPIRE_STEP))
            result = self.hosting.propose(vnode.shard, body.SerializeToString())
            self.expired.labels(str(vnode.shard), "message_expiry").inc(result.messages)
            if result.messages:  # none: only the index entries of a dropped generation went
                log.info("shard %d: removed %d expired stored messages", vnode.shard, result.messages)
        except MqdsError as err:
            log.info("shard %d: removing expired messages postponed: %s", vnode.shard, err)

    def _balance_leaders(self) -> None:
        interval = self.config.leader_balance_interval_s
        meta = self.hosting.meta
        if not interval or time.monotonic() - self._last_leader_balance < interval or meta is None:
            return
        self._last_leader_balance = time.monotonic()
        preferred = {v.shard: v.replicas[0] for v in meta.map.vnodes if v.replicas}
        for vnode in list(self.hosting.vnodes.values()):
            group = vnode.group
            target = preferred.get(vnode.shard)
            if not group.is_leader or target in (None, self.node_id) or target not in group.members:
                continue
            if not self.router.is_connected(target):
                continue
            try:
                group.transfer_leadership(target)
                log.info("shard %d: leadership handed to preferred replica %s", vnode.shard, target)
            except MqdsError as err:
                log.debug("shard %d: %s", vnode.shard, err)

    def _check_placement(self) -> None:
        """On the metadata leader: now and then, repair vnodes whose placement and Raft group disagree.

        On a thread of its own: a repair can wait for a replica to catch up.
        """
        interval = self.config.placement_repair_interval_s
        group = self.hosting.meta_group
        if not interval or group is None or not group.is_leader:
            return
        if time.monotonic() - self._last_placement_check < interval:
            return
        if self._placement_check is not None and self._placement_check.is_alive():
            return
        self._last_placement_check = time.monotonic()

        def check() -> None:
            try:
                self.membership.repair_if_needed()
            except MqdsError as err:
                log.info("placement check: %s; will look again", err)
            except Exception:
                log.exception("placement check failed; will look again")

        self._placement_check = threading.Thread(target=check, name="placement-check", daemon=True)
        self._placement_check.start()
