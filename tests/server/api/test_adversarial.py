"""Hostile requests against a live 3-node cluster, for every method the node serves, streams included.

The requests come from ``mqds.chaos.hostile_requests`` (the chaos runs'
hostile clients use the same generator): well-formed but hostile requests
built from each method's protobuf descriptor, with deep and odd topics,
edge-case numbers, unknown enum values, repeated fields and maps with
thousands of (duplicate) entries, garbage bytes where bytes go; a streaming
method (Follow, StoreStream, ExportShard, reflection, health watches) gets a
stream of them. The cluster requires tokens, and each request goes with no
token, a forged one, a reader's, a broker's, an admin's or the cluster
secret, drawn at random (never with proof to a call that would legitimately
destroy data when the request happens to make sense: those must be refused).
After each batch of examples the invariants a user relies on are checked:

- no answer is INTERNAL or UNKNOWN: bad input gets a status that says what
  was wrong; a call without the credentials its role needs is refused;
- liveness answers within a second on every node;
- every node stays alive, and at the end ready, with every shard taking
  writes, node memory within a bound, and everything acknowledged before
  still there and the same on every replica.

The raw-bytes fuzzing of every method and of the Raft stream is in
``test_fuzz.py``; the hand-written requests that found the defects are in
``test_hostile_requests.py``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor as pbd
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import rss_bytes
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mqds.chaos import hostile_requests
from mqds.client import Client, ConnectionSettings, Message
from mqds.protocol.sharding import shard_of
from mqds.server.api.methods import METHODS, Role
from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER
from mqds.tools.local_cluster import LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_SHARDS = 2
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
EXAMPLES_PER_METHOD = 10
STREAM_TIMEOUT_S = 2.0
"""A stream the node keeps open once the requests are sent (a Follow, a watch) ends here."""
# A node's resident memory may grow by this much over the whole run.
MAX_RSS_GROWTH_BYTES = 400 * 1024 * 1024
TOKENS = {"reader": "adv-reader-token-0123456789", "broker": "adv-broker-token-0123456789"}
TOKENS["admin"] = "adv-admin-token-0123456789"
RANK = {"reader": 0, "broker": 1, "admin": 2}
CREDENTIALS = ("none", "forged", "reader", "broker", "admin", "secret")

METHODS_SENT = hostile_requests.methods()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    base = tmp_path_factory.mktemp("adversarial")
    tokens = base / "tokens"
    tokens.write_text("".join(f"{role} {token}\n" for role, token in TOKENS.items()))
    with LocalCluster(base / "c", 3, n_shards=N_SHARDS, args=["--auth-tokens-file", str(tokens)]) as c:
        c.start()
        yield c


def _metadata(who: str, secret: str) -> list[tuple[str, str]]:
    if who == "secret":
        return [(SECRET_HEADER, secret), (NODE_HEADER, "adversary")]
    if who == "forged":
        return [("authorization", "Bearer forged-token-0123456789")]
    if who in TOKENS:
        return [("authorization", f"Bearer {TOKENS[who]}")]
    return []


def _may(path: str, who: str) -> bool:
    """Whether ``who`` holds what the method's role needs."""
    role = METHODS[path].role
    if role is Role.ANYONE:
        return True
    if role is Role.NODE:
        return who == "secret"
    return who == "secret" or (who in RANK and RANK[who] >= RANK[role.value])


def _live_within_1s(address: str) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    started = time.monotonic()
    answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert time.monotonic() - started < 1.0


def _one_sender_per_shard() -> list[str]:
    senders: dict[int, str] = {}
    i = 0
    while len(senders) < N_SHARDS:
        senders.setdefault(shard_of(f"w{i}", N_SHARDS), f"w{i}")
        i += 1
    return [senders[s] for s in range(N_SHARDS)]


def test_hostile_requests_get_clear_answers_and_take_nothing_down(cluster: LocalCluster) -> None:
    writer = ConnectionSettings(timeout_s=30, auth_token=TOKENS["broker"])
    with Client(cluster.addresses, settings=writer) as client:
        before = client.store_batch([Message(f"keep/{i % 5}", f"v{i}".encode(), sender=f"k{i % 3}") for i in range(60)])
    rss_before = {n: rss_bytes(p.pid) for n, p in cluster.nodes.items() if p.pid}
    channels = {address: grpc.insecure_channel(address) for address in cluster.addresses}
    seen: dict[str, set[grpc.StatusCode]] = {}
    examples = 0

    def examples_of(path: str, method: pbd.MethodDescriptor) -> None:
        streaming = method.client_streaming or method.server_streaming
        timeout_s = STREAM_TIMEOUT_S if streaming else 10.0
        # Methods that would destroy data when a request makes sense never get what their role needs.
        allowed = [who for who in CREDENTIALS if not (path in hostile_requests.DESTRUCTIVE and _may(path, who))]

        @settings(max_examples=EXAMPLES_PER_METHOD, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.randoms(use_true_random=False), st.sampled_from(range(3)), st.sampled_from(allowed))
        def hostile(rng: random.Random, node: int, who: str) -> None:
            nonlocal examples
            raws = hostile_requests.requests(method, rng)
            assume(sum(len(raw) for raw in raws) < 8 * 1024 * 1024)
            metadata = _metadata(who, cluster.secret)
            code = hostile_requests.call(channels[cluster.addresses[node]], path, method, raws, metadata, timeout_s)
            assert code not in BAD, (path, who, code)
            if not _may(path, who):
                assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), (path, who, code)
            seen.setdefault(path, set()).add(code)
            examples += 1
            if examples % 25 == 0:
                for a in cluster.addresses:
                    _live_within_1s(a)

        hostile()

    for path, method in METHODS_SENT:  # every method, a few examples each
        examples_of(path, method)
    # Every method was tried, and the requests reached the code behind authentication.
    assert set(seen) == {path for path, _ in METHODS_SENT}, sorted({p for p, _ in METHODS_SENT} - set(seen))
    assert any(grpc.StatusCode.INVALID_ARGUMENT in codes for codes in seen.values())

    for address in cluster.addresses:
        _live_within_1s(address)
    cluster.wait_ready(60)
    for node_id, proc in cluster.nodes.items():
        assert proc.running, f"{node_id} died:\n{proc.output()}"
        grown = rss_bytes(proc.pid) - rss_before[node_id]
        assert grown < MAX_RSS_GROWTH_BYTES, f"{node_id} grew by {grown / 2**20:.0f} MiB"
    with Client(cluster.addresses, settings=writer) as client:
        for sender in _one_sender_per_shard():
            assert client.store_batch([Message("keep/after", sender.encode(), sender=sender)])[0].timestamp_us
        kept = {(m.topic, m.payload, m.timestamp_us) for m in client.replay("keep/#") if m.topic != "keep/after"}
        assert kept == {(m.topic, m.payload, m.timestamp_us) for m in before}
    cluster.assert_replicas_identical(timeout_s=60)
