"""The cluster's retention policy through the client: the policy checked and built, and read from a map.

The policy is checked and built once (:func:`policy_message`) and read from
a map once (:func:`policy_of`); each driver's ``retention`` module sends it,
asking the nodes in turn by the rules of :func:`rounds`
(:class:`~mqds.client.core.retry.NodeRounds`).
"""

from __future__ import annotations

from collections.abc import Sequence

from mqds.client.core.retry import NodeRounds
from mqds.protocol.retention import check_limits, check_rules
from mqds.v1 import cluster_pb2 as clpb

PAUSE_S = 0.3
"""The pause after a round of the nodes in which none took the policy (an election of the metadata group)."""


def policy_message(rules: Sequence[tuple[str, int] | clpb.RetentionRule], default_s: int) -> clpb.RetentionPolicy:
    """A checked ``RetentionPolicy``: rules in order, each (filter, seconds) or a ``RetentionRule`` (which may
    set limits: ``mqds.protocol.retention.parse_rule_limits`` reads one), the default in seconds (0: keep)."""
    messages = [
        r if isinstance(r, clpb.RetentionRule) else clpb.RetentionRule(topic_filter=r[0], period_s=r[1]) for r in rules
    ]
    check_rules([(r.topic_filter, r.period_s) for r in messages], default_s)
    check_limits(messages)
    return clpb.RetentionPolicy(rules=messages, default_s=default_s)


def policy_of(cmap: clpb.ClusterMap) -> clpb.RetentionPolicy | None:
    """The policy a cluster map carries, or None when none was set (each node's retention_period_s applies)."""
    return cmap.retention if cmap.HasField("retention") else None


def rounds(deadline: float) -> NodeRounds:
    """The rounds of the nodes a policy is sent in until ``deadline``, ``PAUSE_S`` apart."""
    return NodeRounds(deadline, first_pause_s=PAUSE_S, max_pause_s=PAUSE_S)


LATE = "no node took the retention policy in time"
