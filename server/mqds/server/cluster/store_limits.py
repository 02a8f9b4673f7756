"""Refusing new messages at a retention rule's limits (discard=new): the leader's figures, and the refusal.

A rule with ``discard=new`` and ``max_messages`` or ``max_bytes`` refuses the
messages of a store that would take the rule's messages in a shard past its
share (``storage/limits.py``); the store's other messages are stored. The
leader decides, before anything is logged (the Storage API leaves the refused
messages out of the command, answered alone as a message that breaks a rule
is), so a refusal changes nothing on any replica; the figure it decides by
is its own:

- its last complete pass over the rule's messages in the shard (the node's
  retention job, ``node/retention_limits.py``: newest first, stopping once
  the share is reached), counted up to the shard's last timestamp when the
  pass began;
- plus what it admitted since that pass began.

So deletes and expiry make room within one pass (``retention_check_interval_s``),
and a new leader admits until its first pass is done (it starts one at
once). The refusal is LIMIT_REACHED (RESOURCE_EXHAUSTED, the code of a quota
that is used up), not retried by the client: room comes back only when
messages go, which no retry within a deadline can count on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from mqds.protocol.errors import Reason
from mqds.protocol.messages import Problem
from mqds.server.storage.limits import LimitPolicy, RuleLimits
from mqds.v1 import storage_pb2 as pb


@dataclass
class _Figure:
    """What a shard holds of a rule: ``known`` once a pass completed, plus what was admitted since it began."""

    term: int
    messages: int = 0
    bytes: int = 0
    known: bool = False


class StoreLimits:
    """The figures of the discard=new rules in the shards this node leads, and the check a store passes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._policy: LimitPolicy | None = None
        self._figures: dict[tuple[int, int], _Figure] = {}
        """(shard, rule index) -> what the shard holds of the rule."""
        self._pending: dict[tuple[int, int], _Figure] = {}
        """(shard, rule index) -> what was admitted since the pass under way began."""

    def set_policy(self, policy: LimitPolicy | None) -> None:
        """The policy in force (None: none refuses); figures of another policy are forgotten."""
        with self._lock:
            if policy is self._policy:
                return
            self._policy = policy
            self._figures.clear()
            self._pending.clear()

    def forget(self, shard: int) -> None:
        """This node no longer leads ``shard`` (or its term changed): its figures go."""
        with self._lock:
            for table in (self._figures, self._pending):
                for key in [k for k in table if k[0] == shard]:
                    del table[key]

    def pass_began(self, shard: int, rule: int, term: int) -> None:
        """A pass over the rule's messages in the shard began: count what is admitted from now on."""
        with self._lock:
            self._pending[(shard, rule)] = _Figure(term)

    def pass_done(self, shard: int, rule: int, term: int, messages: int, size: int) -> None:
        """The pass found ``messages`` and ``size`` bytes (up to its share): the shard's figure from now on."""
        with self._lock:
            pending = self._pending.pop((shard, rule), None) or _Figure(term)
            self._figures[(shard, rule)] = _Figure(term, messages + pending.messages, size + pending.bytes, known=True)

    def figure(self, shard: int, rule: int) -> tuple[int, int] | None:
        """(messages, bytes) the leader counts the shard holding of the rule; None before its first pass."""
        with self._lock:
            found = self._figures.get((shard, rule))
            return (found.messages, found.bytes) if found is not None and found.known else None

    def refused(self, shard: int, messages: Iterable[tuple[int, pb.Message]]) -> dict[int, Problem]:
        """Of a shard's part (index, message), those a discard=new rule refuses, by index, with why (LIMIT_REACHED);
        the others are counted as admitted. Once one of a rule's messages is refused, so are its later ones in the
        part (a publisher's messages are stored in order or not at all)."""
        policy = self._policy
        if policy is None or not policy.refusing:
            return {}
        refusing = {r.index: r for r in policy.refusing}
        out: dict[int, Problem] = {}
        with self._lock:
            full: dict[int, Problem] = {}
            for index, message in messages:
                number = policy.rule_of(message.topic)
                rule = refusing.get(number)
                if rule is None:
                    continue
                if number in full:
                    out[index] = full[number]
                    continue
                figure = self._figures.get((shard, number))
                size = message.ByteSize()
                if (
                    figure is not None
                    and figure.known
                    and (
                        (rule.max_messages and figure.messages + 1 > rule.max_messages)
                        or (rule.max_bytes and figure.bytes + size > rule.max_bytes)
                    )
                ):
                    out[index] = full[number] = (
                        Reason.LIMIT_REACHED,
                        _limit_reached(shard, rule, figure, policy.n_shards),
                    )
                    continue
                for table in (self._figures, self._pending):
                    found = table.get((shard, number))
                    if found is not None:
                        found.messages += 1
                        found.bytes += size
        return out


def _limit_reached(shard: int, rule: RuleLimits, figure: _Figure, n_shards: int) -> str:
    held = []
    if rule.max_messages:
        held.append(
            f"{figure.messages:,} messages of its share of {rule.max_messages:,} "
            f"(max_msgs={rule.rule.max_messages:,} over {n_shards} shards)"
        )
    if rule.max_bytes:
        held.append(
            f"{figure.bytes:,} bytes of its share of {rule.max_bytes:,} "
            f"(max_bytes={rule.rule.max_bytes:,} over {n_shards} shards)"
        )
    return (
        f"{rule.describe()} with discard=new: shard {shard} holds {' and '.join(held)}; new messages of the rule "
        "are refused there until deletes or the rule's period remove some (mqds retention show)"
    )
