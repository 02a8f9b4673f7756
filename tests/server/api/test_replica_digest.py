"""A replica's digest (``api/replica_digest.py``) against a real replica: one pass, paced, bounded, cancellable."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from storage_support import vnode_replica

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.api.replica_digest import KEY_COST_BYTES, MAX_DIGESTS, DigestLimiter, digest
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.cluster.vnode import VnodeReplica
from mqds.v1 import storage_pb2 as pb

FAST = 1 << 40
"""A rate no test reaches: unpaced."""


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[VnodeReplica]:
    with vnode_replica(str(tmp_path / "v0")) as r:
        yield r


def fill(replica: VnodeReplica, batches: int, per_batch: int = 200, first_index: int = 2) -> int:
    """Store ``batches`` batches, one log entry each; the last index applied."""
    index = first_index
    for b in range(batches):
        cmd = cpb.VnodeCommand()
        cmd.store.now_us = 10_000 + b
        cmd.store.messages.extend(
            pb.Message(topic=f"d/{b % 7}/{i}", payload=b"p" * 100, sender="s") for i in range(per_batch)
        )
        replica.apply(cmd.SerializeToString(), index)
        index += 1
    return index - 1


def reference(replica: VnodeReplica) -> tuple[str, int, int]:
    """The digest as the format defines it (each column family, key and value length-prefixed), and its cost."""
    sha = hashlib.sha256()
    keys = cost = 0
    with replica.reading() as storage:
        for cf, key, value in storage.dump():
            for part in (cf.encode(), key, value):
                sha.update(len(part).to_bytes(4, "big") + part)
            keys += 1
            cost += len(key) + len(value) + KEY_COST_BYTES
    return sha.hexdigest(), keys, cost


class Caller:
    """What a digest asks of its gRPC context: whether the caller is there, and the time left to it."""

    def __init__(self, deadline_s: float | None = None) -> None:
        self.gone = threading.Event()
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s

    def is_active(self) -> bool:
        return not self.gone.is_set() and (self._deadline is None or time.monotonic() < self._deadline)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


class Running:
    """A digest on a thread of its own: its answer or its error, and when it ended."""

    def __init__(self, replica: VnodeReplica, limiter: DigestLimiter, caller: Caller | None = None) -> None:
        self.answer: object = None
        self.error: MqdsError | None = None
        self.ended = 0.0
        self.caller = caller
        self._thread = threading.Thread(target=self._run, args=(replica, limiter), daemon=True)
        self._thread.start()

    def _run(self, replica: VnodeReplica, limiter: DigestLimiter) -> None:
        try:
            self.answer = digest(replica, limiter, self.caller)
        except MqdsError as err:
            self.error = err
        self.ended = time.monotonic()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the digest did not end within {timeout_s} s"


def test_the_digest_keeps_its_format(replica: VnodeReplica) -> None:
    last = fill(replica, 5)
    sha, keys, _ = reference(replica)
    answer = digest(replica, DigestLimiter(FAST))
    assert (answer.sha256, answer.keys, answer.applied_index) == (sha, keys, last)


def test_a_digest_of_a_replica_being_written_is_one_pass_at_the_index_it_began_at(replica: VnodeReplica) -> None:
    last = fill(replica, 20)
    sha, keys, cost = reference(replica)
    # Paced to take about two seconds: writes land all through it.
    limiter = DigestLimiter(cost // 2)
    running = Running(replica, limiter)
    index = last + 1
    while running.ended == 0.0 and index < last + 2_000:
        fill(replica, 1, per_batch=20, first_index=index)
        index += 1
        time.sleep(0.01)
    running.join(30)
    assert running.error is None, running.error
    assert index > last + 20, "the writes did not overlap the digest"
    assert running.answer is not None
    assert (running.answer.sha256, running.answer.keys, running.answer.applied_index) == (sha, keys, last)  # type: ignore[attr-defined]
    assert digest(replica, DigestLimiter(FAST)).applied_index == index - 1


def test_digests_hash_at_the_node_rate_together(replica: VnodeReplica) -> None:
    fill(replica, 10)
    _, _, cost = reference(replica)
    rate = cost // 2  # each digest alone two seconds' worth; two together share the rate
    limiter = DigestLimiter(rate)
    started = time.monotonic()
    both = [Running(replica, limiter), Running(replica, limiter)]
    for running in both:
        running.join(60)
        assert running.error is None, running.error
    took = max(r.ended for r in both) - started
    assert took >= (2 * cost - rate * 0.25) / rate * 0.9, (
        f"two digests of {cost} bytes each at {rate}/s took {took:.2f}s"
    )


def test_more_digests_than_the_node_runs_are_refused_at_once(replica: VnodeReplica) -> None:
    fill(replica, 10)
    _, _, cost = reference(replica)
    limiter = DigestLimiter(cost // 20)  # twenty seconds each: they stay running
    callers = [Caller() for _ in range(MAX_DIGESTS)]
    running = [Running(replica, limiter, c) for c in callers]
    deadline = time.monotonic() + 10
    while limiter.running < MAX_DIGESTS and time.monotonic() < deadline:
        time.sleep(0.01)
    asked = time.monotonic()
    with pytest.raises(MqdsError) as refused:
        digest(replica, limiter, Caller())
    assert refused.value.reason is Reason.OVERLOADED
    assert "at once" in str(refused.value)
    assert time.monotonic() - asked < 1.0
    for caller in callers:
        caller.gone.set()
    for r in running:
        r.join(5)


@pytest.mark.parametrize("how", ["cancelled", "deadline"])
def test_a_digest_stops_when_its_caller_is_gone(replica: VnodeReplica, how: str) -> None:
    fill(replica, 10)
    _, _, cost = reference(replica)
    limiter = DigestLimiter(cost // 30)  # thirty seconds of work
    caller = Caller(deadline_s=0.5 if how == "deadline" else None)
    running = Running(replica, limiter, caller)
    time.sleep(0.5)
    gone = time.monotonic()
    caller.gone.set()
    running.join(5)
    assert running.ended - gone < 1.0, f"the digest went on {running.ended - gone:.1f}s after its caller left"
    assert running.error is not None
    assert running.error.reason is (Reason.DEADLINE_EXCEEDED if how == "deadline" else Reason.UNAVAILABLE)
    assert limiter.running == 0


def test_closing_the_replica_stops_a_digest_instead_of_waiting_for_it(replica: VnodeReplica) -> None:
    fill(replica, 10)
    _, _, cost = reference(replica)
    running = Running(replica, DigestLimiter(cost // 30), Caller())
    time.sleep(0.3)
    started = time.monotonic()
    replica.close()
    assert time.monotonic() - started < 2.0
    running.join(5)
    assert running.error is not None and running.error.reason is Reason.SHUTTING_DOWN
