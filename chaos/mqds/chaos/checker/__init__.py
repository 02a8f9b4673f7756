"""The checker: what a run's history and final read say about the cluster.

Given the :class:`~mqds.chaos.history.History` (what was attempted and
acknowledged, what readers saw while faults ran, the fault timeline), the
final read of everything stored (``final``, in replay order) and the replicas'
digests after healing, :func:`check` reports:

- **lost**: acknowledged but not in the final read (must be empty), each
  classified by shard and by where its acknowledgement fell relative to faults;
- **unexpected**: read but never attempted, or a topic and payload that do not
  agree (must be empty);
- **duplicates**: a message stored more than once (exactly-once writes: zero);
- **out of order**: a sender's sequences not increasing in replay;
- **moved**: a message read at another position than its acknowledgement gave;
- **vanished**: seen by a concurrent reader but not in the final read (a read
  of something that was not durable);
- **anomalies** the workload itself recorded (a reader saw a duplicate or a
  sender's messages out of order in one stream, the client misbehaved, a
  consumer got a non-retriable error);
- **persistent-session consumers** (:func:`check_consumers`): every
  acknowledged message must have been delivered to each pubsub consumer
  (``consumer-lost``, classified like losses), and to at least one of the
  queue consumers when it matches their filter; nothing never attempted may
  be delivered (``consumer-unexpected``); a pubsub consumer's first
  deliveries of each sender must come in sequence order
  (``consumer-order``); whatever was delivered must be in the final read
  (``consumer-vanished``). Redeliveries (a message delivered again to the
  same consumer, or to both queue consumers) are allowed by at-least-once
  delivery: they are counted per consumer, not violations;
- **push subscribers** (:func:`check_followers`): each must have been sent
  every acknowledged message exactly once (``follower-lost``,
  ``follower-duplicate``), nothing never attempted (``follower-unexpected``)
  or missing from the final read (``follower-vanished``); a sender's messages
  out of order are an anomaly it recorded (``follower-order``);
- **hostile clients** (:func:`check_hostile`): no hostile request may get
  INTERNAL or UNKNOWN from any node (``hostile-internal``: a handler failed
  instead of refusing the request clearly), and no request that must be
  refused (an admin call without credentials, one with the secret whose
  arguments name nothing) may succeed (``hostile-accepted``); every answer is counted per
  request kind and per status code;
- **convergence**: every replica of every vnode at the same applied index with
  the same digest;
- **availability**: per fault, the longest time writes to its affected vnodes
  got no acknowledgement, and the same for the other vnodes. A fault that
  paused the workload (the idle-restart nemeses) is measured from when the
  workload resumed: the idle spell is the fault's, not an outage.

Only the first six kinds, anomalies, the consumer and follower checks, the hostile clients'
checks and convergence are violations; availability and redeliveries are
measurements.

The data of a verdict is in :mod:`~mqds.chaos.checker.result`; each check is a
module of its own: :mod:`~mqds.chaos.checker.reads` (the first six kinds and
the anomalies), :mod:`~mqds.chaos.checker.consumers`,
:mod:`~mqds.chaos.checker.hostile`, :mod:`~mqds.chaos.checker.availability`;
:mod:`~mqds.chaos.checker.verdict` runs them all (:func:`check`).
"""

from mqds.chaos.checker.availability import SETTLE_S, ack_times_by_shard, longest_gap, write_outages
from mqds.chaos.checker.consumers import check_consumers
from mqds.chaos.checker.followers import check_followers
from mqds.chaos.checker.hostile import INTERNAL_CODES, check_hostile
from mqds.chaos.checker.reads import check_reads, where_acked
from mqds.chaos.checker.result import (
    EXAMPLES,
    CheckResult,
    ConsumerStats,
    Convergence,
    Finding,
    FollowerStats,
    Outage,
    ReplicaState,
)
from mqds.chaos.checker.verdict import check

__all__ = [
    "EXAMPLES",
    "INTERNAL_CODES",
    "SETTLE_S",
    "CheckResult",
    "ConsumerStats",
    "Convergence",
    "Finding",
    "FollowerStats",
    "Outage",
    "ReplicaState",
    "ack_times_by_shard",
    "check",
    "check_consumers",
    "check_followers",
    "check_hostile",
    "check_reads",
    "longest_gap",
    "where_acked",
    "write_outages",
]
