"""What a chaos run did and saw: write attempts, acknowledgements, concurrent reads, faults.

Every message of the workload is identified by ``(sender, seq)``: the sender
(MQTT clientid, which picks the shard) and a sequence number unique per sender
that increases in the order the sender's messages are written. The topic and
the payload both carry it (``chaos/<sender>/<seq>`` and ``<sender>:<seq>``),
so a message read back names itself, and a topic and payload that disagree
show corruption.

A :class:`History` is filled by the workload threads (thread-safe) and read by
the checker once the run is over; what each persistent-session consumer was
delivered is kept per consumer (:class:`ConsumerLog`). Times are seconds since the run began
(``History.clock``), on the monotonic clock of the process that runs the
workload and the nemeses, so faults and acknowledgements can be compared.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

TOPIC_ROOT = "chaos"
TOPIC_FILTER = f"{TOPIC_ROOT}/#"

MessageKey = tuple[str, int]
"""``(sender, seq)``: one message of the workload."""


def topic_of(sender: str, seq: int) -> str:
    return f"{TOPIC_ROOT}/{sender}/{seq}"


def payload_of(sender: str, seq: int) -> bytes:
    return f"{sender}:{seq}".encode()


def parse_message(topic: str, payload: bytes) -> MessageKey | None:
    """The ``(sender, seq)`` a stored message names, or None when topic and payload do not agree."""
    parts = topic.split("/")
    if len(parts) != 3 or parts[0] != TOPIC_ROOT or not parts[2].isdigit():
        return None
    # Interned: a long run keeps millions of these (final read, readers, consumers), a few senders among them.
    sender, seq = sys.intern(parts[1]), int(parts[2])
    if payload != payload_of(sender, seq):
        return None
    return sender, seq


class Ack(NamedTuple):
    """Where an acknowledged message was stored, and when the acknowledgement came back."""

    shard: int
    timestamp_us: int
    at: float


class ReadMessage(NamedTuple):
    """A message as a reader got it back: its identity and stored position."""

    sender: str
    seq: int
    shard: int
    timestamp_us: int

    @property
    def key(self) -> MessageKey:
        return self.sender, self.seq


# The outcomes of one store_batch call, as the publisher saw them.
OK = "ok"  # acknowledged: every message of the call is stored
PARTIAL = "partial"  # some shards' parts acknowledged, the others failed (PartialBatchError)
UNKNOWN = "unknown"  # failed with a retriable error or a timeout: may or may not be stored
FAILED = "failed"  # rejected for good (a non-retriable error): not stored


@dataclass(frozen=True)
class Attempt:
    """One ``store_batch`` call (a retry is another attempt with the same ``sequence``)."""

    publisher: str
    sequence: int | None
    shards: tuple[int, ...]
    n_messages: int
    started: float
    ended: float
    outcome: str
    n_acked: int
    error: str = ""


@dataclass(frozen=True)
class Anomaly:
    """Something a workload thread saw that must not happen (a reader saw a duplicate, the client misbehaved)."""

    kind: str
    detail: str
    at: float


@dataclass
class FaultRecord:
    """One injected fault: what, on whom, when, and which vnodes it was expected to hit."""

    index: int
    nemesis: str
    targets: list[str]
    detail: str
    started: float
    healed: float | None = None
    recovered: float | None = None
    affected_shards: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    paused_at: float | None = None
    """When the fault paused the workload's writers (the idle-restart nemeses), if it did."""
    resumed_at: float | None = None
    """When they were let go again (after the cluster was whole again)."""

    @property
    def end(self) -> float:
        """When the cluster was whole again and the workload resumed (or healed, or began: the last known)."""
        return self.resumed_at or self.recovered or self.healed or self.started


PUBSUB = "pubsub"  # every subscriber has its own read position and gets every message
QUEUE = "queue"  # the queue readers share the messages: an acknowledged one is gone for all of them


@dataclass
class ConsumerLog:
    """What one persistent-session consumer was delivered, in order, redeliveries included.

    ``deliveries`` is appended to under the history's lock (the checker may
    read it while a consumer that did not stop is still running); the
    counters are written by the consumer's own thread only.
    """

    name: str
    mode: str
    topic_filter: str
    deliveries: list[ReadMessage] = field(default_factory=list)
    fetches: int = 0
    acks: int = 0
    errors: int = 0
    drained: bool = False
    """A fetch begun after the workload ended came back empty: the consumer had everything."""


@dataclass(frozen=True)
class HostileAnswer:
    """One answer a hostile request got that the checker must look at (see :class:`HostileLog`)."""

    kind: str
    node: str
    code: str
    detail: str
    at: float


@dataclass
class HostileLog:
    """What the hostile clients sent and what each request kind got back, by gRPC status code name.

    ``counts[kind][code]`` counts every answer; ``answers`` keeps the answers
    the checker judges (INTERNAL and UNKNOWN, and OK to a kind in
    ``must_refuse``: an admin call without credentials), at most
    :attr:`KEEP` of them; ``examples`` keeps the first answer of each kind and
    code, for the report.
    """

    KEEP = 1000
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    must_refuse: set[str] = field(default_factory=set)
    answers: list[HostileAnswer] = field(default_factory=list)
    examples: dict[tuple[str, str], HostileAnswer] = field(default_factory=dict)
    dropped: int = 0
    """Answers to judge beyond KEEP (counted, not kept)."""

    def judged(self, kind: str, code: str) -> bool:
        """Whether an answer is one the checker must see (kept in ``answers``)."""
        return code in ("INTERNAL", "UNKNOWN") or (code == "OK" and kind in self.must_refuse)

    @property
    def sent(self) -> int:
        return sum(sum(list(codes.values())) for codes in list(self.counts.values()))

    def by_status(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for codes in self.counts.values():
            for code, n in codes.items():
                out[code] = out.get(code, 0) + n
        return dict(sorted(out.items()))


@dataclass
class FollowerLog:
    """What one push subscriber (``Client.follow``) was sent: each message's count, in order of first arrival.

    Written under the history's lock; ``restarts`` and ``errors`` by the follower's own thread only.
    """

    name: str
    any_replica: bool
    counts: dict[MessageKey, int] = field(default_factory=dict)
    order: list[ReadMessage] = field(default_factory=list)
    restarts: int = 0
    errors: int = 0
    complete: bool = False
    """It had every acknowledged message once the workload ended."""


class History:
    """Everything the workload recorded. Keys are recorded as attempted before they are sent."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self.attempted: dict[MessageKey, float] = {}
        self.acked: dict[MessageKey, Ack] = {}
        self.attempts: list[Attempt] = []
        self.anomalies: list[Anomaly] = []
        # Union of what the concurrent readers saw (first position seen).
        self.seen: dict[MessageKey, tuple[int, int]] = {}
        self.reads_observed = 0
        self.faults: list[FaultRecord] = []
        self.consumers: dict[str, ConsumerLog] = {}
        self.followers: dict[str, FollowerLog] = {}
        self.workload_ended: float | None = None
        # The hostile clients' answers (None when the run had none).
        self.hostile: HostileLog | None = None

    def clock(self) -> float:
        """Seconds since the run began."""
        return time.monotonic() - self._t0

    def record_attempted(self, keys: list[MessageKey]) -> None:
        now = self.clock()
        with self._lock:
            for key in keys:
                self.attempted.setdefault(key, now)

    def record_acks(self, acks: list[tuple[MessageKey, int, int]]) -> None:
        """``(key, shard, timestamp_us)`` of each acknowledged message; the first ack of a key counts."""
        now = self.clock()
        with self._lock:
            for key, shard, ts in acks:
                if key not in self.acked:
                    self.acked[key] = Ack(shard, ts, now)
                elif self.acked[key][:2] != (shard, ts):
                    self.anomalies.append(
                        Anomaly(
                            "ack-moved",
                            f"{key[0]}#{key[1]} acknowledged at shard {shard} ts {ts}, earlier at "
                            f"shard {self.acked[key].shard} ts {self.acked[key].timestamp_us}: stored twice",
                            now,
                        )
                    )

    def record_attempt(self, attempt: Attempt) -> None:
        with self._lock:
            self.attempts.append(attempt)

    def record_anomaly(self, kind: str, detail: str) -> None:
        with self._lock:
            self.anomalies.append(Anomaly(kind, detail, self.clock()))

    def record_seen(self, messages: list[ReadMessage]) -> None:
        with self._lock:
            self.reads_observed += len(messages)
            for m in messages:
                self.seen.setdefault(m.key, (m.shard, m.timestamp_us))

    def add_consumer(self, name: str, mode: str, topic_filter: str) -> ConsumerLog:
        """Register a persistent-session consumer; its deliveries go to the log returned."""
        if mode not in (PUBSUB, QUEUE):
            raise ValueError(f"mode must be {PUBSUB!r} or {QUEUE!r}, got {mode!r}")
        with self._lock:
            if name in self.consumers:
                raise ValueError(f"consumer {name!r} registered twice: clientids must be unique")
            log = self.consumers[name] = ConsumerLog(name, mode, topic_filter)
            return log

    def record_delivered(self, name: str, messages: list[ReadMessage]) -> None:
        """One fetch's messages, as consumer ``name`` got them (in order)."""
        with self._lock:
            log = self.consumers[name]
            log.fetches += 1
            log.deliveries.extend(messages)

    def deliveries(self, name: str) -> list[ReadMessage]:
        """A copy of what consumer ``name`` was delivered so far."""
        with self._lock:
            return list(self.consumers[name].deliveries)

    def add_follower(self, name: str, any_replica: bool) -> FollowerLog:
        with self._lock:
            log = self.followers[name] = FollowerLog(name, any_replica)
            return log

    def record_followed(self, name: str, messages: list[ReadMessage]) -> None:
        """One batch, as follower ``name`` got it (in order)."""
        with self._lock:
            log = self.followers[name]
            for m in messages:
                count = log.counts.get(m.key, 0)
                log.counts[m.key] = count + 1
                if not count:
                    log.order.append(m)

    def follower_missing(self, name: str) -> int:
        """Acknowledged messages follower ``name`` has not been sent (yet)."""
        with self._lock:
            counts = self.followers[name].counts
            return sum(1 for key in self.acked if key not in counts)

    def add_hostile(self, must_refuse: set[str]) -> HostileLog:
        """Register the hostile clients; ``must_refuse``: request kinds an OK answer to is a violation."""
        with self._lock:
            self.hostile = HostileLog(must_refuse=set(must_refuse))
            return self.hostile

    def record_hostile(self, kind: str, node: str, code: str, detail: str = "") -> None:
        """One answer to a hostile request of ``kind`` sent to ``node`` (``code``: a grpc.StatusCode name)."""
        with self._lock:
            if self.hostile is None:
                self.hostile = HostileLog()
            log = self.hostile
            codes = log.counts.setdefault(kind, {})
            codes[code] = codes.get(code, 0) + 1
            answer = HostileAnswer(kind, node, code, detail[:300], self.clock())
            log.examples.setdefault((kind, code), answer)
            if log.judged(kind, code):
                if len(log.answers) < log.KEEP:
                    log.answers.append(answer)
                else:
                    log.dropped += 1

    def is_attempted(self, key: MessageKey) -> bool:
        return key in self.attempted

    def add_fault(self, fault: FaultRecord) -> None:
        with self._lock:
            self.faults.append(fault)

    def counts(self) -> dict[str, int]:
        with self._lock:
            outcomes: dict[str, int] = {OK: 0, PARTIAL: 0, UNKNOWN: 0, FAILED: 0}
            for attempt in self.attempts:
                outcomes[attempt.outcome] = outcomes.get(attempt.outcome, 0) + 1
            return {
                "attempted": len(self.attempted),
                "acked": len(self.acked),
                "calls": len(self.attempts),
                **{f"calls_{k}": v for k, v in outcomes.items()},
                "reads_observed": self.reads_observed,
                "consumer_deliveries": sum(len(c.deliveries) for c in self.consumers.values()),
                "follower_deliveries": sum(sum(f.counts.values()) for f in self.followers.values()),
            }
