"""GetReplicaDigest: a replica's whole content hashed in one pass, at a bounded rate, while its caller waits.

The digest (SHA-256 over every column family, key and value, each
length-prefixed, in order) is what the harness and the chaos checker compare
across a vnode's replicas. It reads one ``ShardView``: the replica as it
stood at one applied index, however long the pass takes while writes go on.
It once hashed the whole replica again, up to 50 times, until a pass saw no
change, and went on after its caller had gone: eight calls on a busy
200,000-message shard raised a writer's p50 from 14 to 289 ms, caused two
elections and ran past 120 s. A digest is a scan of a whole replica, so:

- at most ``MAX_DIGESTS`` run on a node at once; more get OVERLOADED at once;
- together they hash at most ``digest_rate_bytes`` a second, each key
  counting ``KEY_COST_BYTES`` more for the work per key; ahead of that rate a
  digest sleeps (which also lets go of the GIL), so writes and elections go
  on beside it;
- after every ``CHECK_BYTES`` hashed, and while it sleeps, a digest stops if
  its caller is gone (cancelled, or past its deadline) or the replica is
  being closed or replaced by a snapshot (which waits for its readers);
- it needs the admin role (its entry in ``methods.METHODS``).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.v1 import cluster_pb2 as clpb

if TYPE_CHECKING:
    from mqds.server.cluster.vnode import VnodeReplica

MAX_DIGESTS = 2
"""Digests running on a node at once."""
KEY_COST_BYTES = 64
"""What a key costs of the rate besides its bytes: the per-key work (an iteration, four hash updates)."""
CHECK_BYTES = 256 * 1024
"""A digest pays the rate and looks at its caller after this much (at most 4,096 keys)."""
_BURST_S = 0.25
"""An idle limiter lets this many seconds' worth be hashed at once."""
_WAIT_SLICE_S = 0.1
"""A digest waiting for its rate looks at its caller at least this often."""


class DigestLimiter:
    """The node's digests: how many run, and the bytes a second they may hash together (a token bucket)."""

    def __init__(self, rate_bytes: int) -> None:
        self.rate = float(rate_bytes)
        self._lock = threading.Lock()
        self._running = 0
        self._tokens = self.rate * _BURST_S
        self._refilled = time.monotonic()

    @property
    def running(self) -> int:
        return self._running

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """One of the ``MAX_DIGESTS`` places, or OVERLOADED at once."""
        with self._lock:
            if self._running >= MAX_DIGESTS:
                raise errors.error(
                    Reason.OVERLOADED,
                    f"{self._running} replica digests are running on this node, the most it runs at once; "
                    "ask again when one has finished",
                )
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1

    def spend(self, cost: int) -> float:
        """Take ``cost`` bytes of the rate; the seconds to wait before hashing more (0: none)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate * _BURST_S, self._tokens + (now - self._refilled) * self.rate)
            self._refilled = now
            self._tokens -= cost
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


def digest(replica: VnodeReplica, limiter: DigestLimiter, context: Any = None) -> clpb.ReplicaDigest:
    """The digest of ``replica`` at one applied index; stops (with the reason) when the caller is gone.

    ``context`` is the call's ``grpc.ServicerContext`` (None: nobody to wait
    for but the replica).
    """
    shard = replica.shard
    with limiter.slot(), replica.reading() as storage:
        view = storage.view()
        sha = hashlib.sha256()
        count = 0
        cost = 0
        family = ""
        prefix = b""
        for name, key, value in view.items():
            if name != family:
                encoded = name.encode()
                family, prefix = name, len(encoded).to_bytes(4, "big") + encoded
            sha.update(prefix)
            sha.update(len(key).to_bytes(4, "big") + key)
            sha.update(len(value).to_bytes(4, "big") + value)
            count += 1
            cost += len(key) + len(value) + KEY_COST_BYTES
            if cost >= CHECK_BYTES:
                _pace(limiter.spend(cost), replica, context)
                cost = 0
        limiter.spend(cost)  # the tail too: the rate is the node's, shared with the digests after this one
        _check(replica, context)
        return clpb.ReplicaDigest(shard=shard, applied_index=view.applied_index, sha256=sha.hexdigest(), keys=count)


def _pace(wait_s: float, replica: VnodeReplica, context: Any) -> None:
    """Wait ``wait_s`` in slices, looking at the caller and the replica before and between them."""
    _check(replica, context)
    end = time.monotonic() + wait_s
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, _WAIT_SLICE_S))
        _check(replica, context)


def _check(replica: VnodeReplica, context: Any) -> None:
    shard = replica.shard
    if context is not None:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise errors.error(Reason.DEADLINE_EXCEEDED, f"the digest of shard {shard} passed the call's deadline")
        if not context.is_active():
            raise errors.error(Reason.UNAVAILABLE, f"the digest of shard {shard} stopped: its caller went away")
    if replica.stopping.is_set():
        raise errors.error(Reason.SHUTTING_DOWN, f"the replica of shard {shard} is closing")
    if replica.swap_waiting:
        raise errors.error(
            Reason.UNAVAILABLE, f"the replica of shard {shard} is being replaced by a snapshot; ask again"
        )
