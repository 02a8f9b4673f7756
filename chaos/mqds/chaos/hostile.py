"""Hostile clients: odd and malicious requests sent beside the workload, over raw gRPC.

What operators' tools and attackers send, not what the client library would:
a topic 1,500 levels deep, then a queue acknowledgement with it as the
filter; ``GetStreams`` and ``GetFences`` with thousands of repeated shards;
an empty ``StoreBatch``; bytes that are no protobuf message at all, to public
methods; admin calls without credentials (``JoinNode`` with an address the
caller chose, ``AddGeneration``); many slow calls at once on one connection.
A second set presents the cluster secret, so authentication does not stop it
and the handlers see it: admin calls with arguments that are invalid or name
nothing (a node that is not a member, a shard that does not exist), and
garbage bytes to an admin method. Admin calls that would really change the
cluster (``LeaveNode``, ``ForgetNode``, ``DropGeneration`` of something that
exists) are never sent with the secret: they would legitimately destroy data.

Every other request is not one of these but one built by the generator the
adversarial suite uses (:mod:`mqds.chaos.hostile_requests`): a random method
of the node's table, streams included, with a hostile request (or stream of
them) drawn from the run's seed, with the cluster secret unless the method
could destroy data with it (those go without, and must be refused).

One thread (:class:`HostileClients`) sends one request every
``interval_s`` seconds, cycling through :data:`REQUESTS` in a seeded order,
each to a random running node, on channels of its own (their own connection:
the burst of slow calls must not share one with the workload's clients).
Every answer's status code is recorded in the history
(:meth:`~mqds.chaos.history.History.record_hostile`); the checker fails the
run on any INTERNAL or UNKNOWN answer, and on an admin call without
credentials that succeeded. The thread pauses with the workload (it writes
too: the deep topic), see :class:`~mqds.chaos.workload.WorkloadPause`.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from mqds.chaos import hostile_requests
from mqds.chaos.cluster import ChaosCluster
from mqds.chaos.history import History
from mqds.chaos.workload import PauseGate
from mqds.client import ConnectionSettings
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError
from mqds.protocol.sharding import shard_of
from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

DEEP_LEVELS = 1500
DEEP_SENDER = "hostile-deep"
DEEP_TOPIC = "hostile/" + "/".join(["l"] * (DEEP_LEVELS - 1))
"""A topic of DEEP_LEVELS levels (outside ``chaos/#``, so the checker's reads never see it)."""
INTRUDER = "intruder"
JOIN_ADDRESS = "203.0.113.7:7000"
"""Where an unauthenticated JoinNode asks the cluster to send its Raft traffic (TEST-NET-3: nowhere)."""
BURST = 32
"""Slow calls sent at once on one connection (more than a node lets one connection have in flight)."""
GARBAGE = (
    b"\xff" * 24,  # a tag with wire type 7: no such wire type
    b"\x0a\xff\xff\xff\xff\x0f" + b"x" * 8,  # a length-delimited field 4 GiB long, 8 bytes there
    b"\x08" + b"\x80" * 12,  # a varint that never ends
)
"""Bytes no protobuf message parses from."""


GENERATED_STREAM_S = 2.0
"""A generated stream the node keeps open (a Follow, a watch) is ended after this long."""


def _generated_kind(path: str) -> str:
    return "generated:" + path.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Request:
    """One kind of hostile request: where it goes and how its bytes are made."""

    kind: str
    service: str
    method: str
    build: Callable[[HostileClients], bytes]
    secret: bool = False
    """Present the cluster secret (the handler sees it instead of the authentication refusing it)."""
    must_refuse: bool = False
    """An OK answer is a violation (an admin call without credentials, arguments that name nothing)."""
    burst: int = 0
    """Send this many at once on one connection instead of one."""

    @property
    def path(self) -> str:
        return f"/mqds.v1.{self.service}/{self.method}"


def _garbage(index: int) -> Callable[[HostileClients], bytes]:
    return lambda h: GARBAGE[index % len(GARBAGE)]


def _deep_store(h: HostileClients) -> bytes:
    message = pb.Message(topic=DEEP_TOPIC, payload=b"deep", sender=DEEP_SENDER, qos=1)
    return pb.StoreBatchRequest(messages=[message]).SerializeToString()


def _deep_ack(h: HostileClients) -> bytes:
    shard, ts = h.deep_position or (shard_of(DEEP_SENDER, h.n_shards), 1)
    return spb.AckRequest(
        clientid=DEEP_SENDER, topic_filter=DEEP_TOPIC, mode=spb.QUEUE, shard=shard, timestamp_us=ts
    ).SerializeToString()


REQUESTS: tuple[Request, ...] = (
    # -- without credentials ----------------------------------------------------------------
    Request("deep-topic-store", "Storage", "StoreBatch", _deep_store),
    Request("deep-topic-queue-ack", "Sessions", "Ack", _deep_ack),
    Request(
        "get-streams-2000-shards",
        "Storage",
        "GetStreams",
        lambda h: pb.GetStreamsRequest(topic_filter="#", shards=[9] * 2000).SerializeToString(),
    ),
    Request(
        "get-fences-200k-shards",
        "Storage",
        "GetFences",
        lambda h: pb.GetFencesRequest(shards=[0] * 200_000).SerializeToString(),
    ),
    Request("empty-store-batch", "Storage", "StoreBatch", lambda h: pb.StoreBatchRequest().SerializeToString()),
    Request(
        "fetch-2000-after-us",
        "Sessions",
        "FetchMessages",
        lambda h: spb.FetchMessagesRequest(
            topic_filter="#", max_count=5, shards=[0], after_us={i: 1 for i in range(2000)}
        ).SerializeToString(),
    ),
    Request(
        "fetch-shared-1000-sessions-200-after-us",
        "Sessions",
        "FetchMessagesShared",
        lambda h: spb.FetchMessagesSharedRequest(
            shards=[0],
            sessions=[
                spb.SharedFetchSession(topic_filter="#", max_count=5, after_us={i: 1 for i in range(200)})
                for _ in range(1000)
            ],
        ).SerializeToString(),
    ),
    Request(
        "get-read-positions-1001-pairs",
        "Sessions",
        "GetReadPositions",
        lambda h: spb.ReadPositionsRequest(
            pairs=[spb.ReadPositionPair(clientid=f"c{i}", topic_filter="#") for i in range(1001)]
        ).SerializeToString(),
        must_refuse=True,
    ),
    Request("garbage:Sessions/FetchMessagesShared", "Sessions", "FetchMessagesShared", _garbage(2)),
    Request(
        "delete-no-credentials",
        "Storage",
        "DeleteMessages",
        lambda h: pb.DeleteMessagesRequest(shard=0, topic_filter="chaos/#").SerializeToString(),
        must_refuse=True,
    ),
    Request(
        "set-retention-no-credentials",
        "Cluster",
        "SetRetention",
        lambda h: clpb.SetRetentionRequest(
            policy=clpb.RetentionPolicy(rules=[clpb.RetentionRule(topic_filter="chaos/#", period_s=1)])
        ).SerializeToString(),
        must_refuse=True,
    ),
    Request(
        "share-group-bad-name",
        "Sessions",
        "JoinShareGroup",
        lambda h: spb.ShareGroupRequest(group="a/+", topic_filter="#", member="m", lease_s=5).SerializeToString(),
        must_refuse=True,
    ),
    Request("garbage:Sessions/JoinShareGroup", "Sessions", "JoinShareGroup", _garbage(1)),
    Request("garbage:Storage/StoreBatch", "Storage", "StoreBatch", _garbage(0)),
    Request("garbage:Storage/Next", "Storage", "Next", _garbage(1)),
    Request("garbage:Storage/GetStreams", "Storage", "GetStreams", _garbage(2)),
    Request("garbage:Sessions/Ack", "Sessions", "Ack", _garbage(0)),
    Request("garbage:Sessions/FetchMessages", "Sessions", "FetchMessages", _garbage(1)),
    Request("garbage:Cluster/GetClusterMap", "Cluster", "GetClusterMap", _garbage(2)),
    Request(
        "join-node-no-credentials",
        "Cluster",
        "JoinNode",
        lambda h: clpb.JoinNodeRequest(node_id=INTRUDER, address=JOIN_ADDRESS).SerializeToString(),
        must_refuse=True,
    ),
    Request(
        "add-generation-no-credentials",
        "Storage",
        "AddGeneration",
        lambda h: pb.AddGenerationRequest(shard=0).SerializeToString(),
        must_refuse=True,
    ),
    Request(
        f"burst:{BURST}-slow-fetches-1-connection",
        "Sessions",
        "FetchMessages",
        # Shard 0, sent to a node holding a replica of it (see _send): served there, slowly, not
        # turned away at once as NOT_HOSTED.
        lambda h: spb.FetchMessagesRequest(
            topic_filter="#", max_count=1000, stale_ok=True, shards=[0]
        ).SerializeToString(),
        burst=BURST,
    ),
    # -- with the cluster secret: past authentication, never destructive ----------------------
    Request(
        "secret:add-generation-dup-bad-shards",
        "Storage",
        "AddGeneration",
        lambda h: pb.AddGenerationRequest(shards=[h.n_shards + 5] * 100).SerializeToString(),
        secret=True,
        must_refuse=True,
    ),
    Request(
        "secret:join-node-empty",
        "Cluster",
        "JoinNode",
        lambda h: clpb.JoinNodeRequest(node_id="", address="").SerializeToString(),
        secret=True,
        must_refuse=True,
    ),
    Request(
        "secret:leave-node-not-member",
        "Cluster",
        "LeaveNode",
        lambda h: clpb.LeaveNodeRequest(node_id="ghost").SerializeToString(),
        secret=True,
        must_refuse=True,
    ),
    Request(
        "secret:forget-node-not-member",
        "Cluster",
        "ForgetNode",
        lambda h: clpb.ForgetNodeRequest(node_id="ghost").SerializeToString(),
        secret=True,
        must_refuse=True,
    ),
    Request(
        "secret:drop-generation-no-shard",
        "Storage",
        "DropGeneration",
        lambda h: pb.DropGenerationRequest(shard=h.n_shards + 999, generation=12345).SerializeToString(),
        secret=True,
        must_refuse=True,
    ),
    Request(
        "secret:replica-digest-no-shard",
        "Cluster",
        "GetReplicaDigest",
        lambda h: clpb.GetReplicaDigestRequest(shard=2**32 - 1).SerializeToString(),
        secret=True,
        must_refuse=True,
    ),
    Request(
        "secret:delete-everything-unconfirmed",
        "Storage",
        "DeleteMessages",
        lambda h: pb.DeleteMessagesRequest(shard=0, topic_filter="#").SerializeToString(),
        secret=True,
        must_refuse=True,
    ),
    Request(
        "secret:set-retention-bad-rule",
        "Cluster",
        "SetRetention",
        lambda h: clpb.SetRetentionRequest(
            policy=clpb.RetentionPolicy(rules=[clpb.RetentionRule(topic_filter="chaos/#/x", period_s=1)])
        ).SerializeToString(),
        secret=True,
        must_refuse=True,
    ),
    Request(
        "import-no-credentials",
        "Storage",
        "ImportShard",
        lambda h: pb.ImportShardRequest(shard=0, begin=pb.ImportBegin()).SerializeToString(),
        must_refuse=True,
    ),
    Request(
        "secret:import-raft-state",
        "Storage",
        "ImportShard",
        lambda h: pb.ImportShardRequest(
            shard=0, records=pb.ImportRecords(column_family="default", keys=[b"m:applied"], values=[bytes(8)])
        ).SerializeToString(),
        secret=True,
        must_refuse=True,
    ),
    Request("secret:garbage:Storage/ImportShard", "Storage", "ImportShard", _garbage(1), secret=True),
    Request("secret:garbage:Storage/DeleteMessages", "Storage", "DeleteMessages", _garbage(2), secret=True),
    Request("secret:garbage:Cluster/SetRetention", "Cluster", "SetRetention", _garbage(0), secret=True),
    Request("secret:garbage:Cluster/JoinNode", "Cluster", "JoinNode", _garbage(0), secret=True),
    Request("secret:garbage:Storage/DropGeneration", "Storage", "DropGeneration", _garbage(1), secret=True),
)


class HostileClients:
    """One thread sending :data:`REQUESTS` round after round, recording every answer's status code."""

    n_shards: int
    deep_position: tuple[int, int] | None
    """Where the last deep-topic message was stored (shard, timestamp), for the queue acknowledgement."""

    def __init__(
        self,
        cluster: ChaosCluster,
        history: History,
        n_shards: int,
        *,
        seed: int,
        interval_s: float = 0.5,
        call_timeout_s: float = 10.0,
        requests: tuple[Request, ...] = REQUESTS,
        generated: bool = True,
    ) -> None:
        self.cluster = cluster
        self.history = history
        self.n_shards = n_shards
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.requests = requests
        self.rng = random.Random(seed)
        self.deep_position: tuple[int, int] | None = None
        self.gate = PauseGate()
        self._stop = threading.Event()
        self._channels: dict[str, grpc.Channel] = {}
        self.generated = hostile_requests.methods() if generated else []
        must_refuse = {r.kind for r in requests if r.must_refuse}
        must_refuse |= {_generated_kind(path) for path, _ in self.generated if path in hostile_requests.DESTRUCTIVE}
        history.add_hostile(must_refuse)
        self.thread = threading.Thread(target=self._run, name="chaos-hostile", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            order: list[Request] = []
            sent = 0
            while self.gate.enter(self._stop):
                try:
                    sent += 1
                    if self.generated and sent % 2 == 0:
                        self._send_generated()
                    else:
                        if not order:
                            order = list(self.requests)
                            self.rng.shuffle(order)
                        self._send(order.pop(0))
                finally:
                    self.gate.leave()
                self._stop.wait(self.interval_s)
        except Exception as err:  # a bug here: record it, it fails the run
            log.exception("hostile clients died")
            self.history.record_anomaly("hostile-crashed", repr(err))
        finally:
            for channel in self._channels.values():
                channel.close()

    def _channel(self, node_id: str) -> grpc.Channel:
        address = self.cluster.nodes[node_id].address
        channel = self._channels.get(address)
        if channel is None:
            settings = self.cluster.connection or ConnectionSettings()
            # A connection of its own: gRPC would otherwise share one with a workload client's channel.
            options = [*settings.channel_options(), ("grpc.use_local_subchannel_pool", 1)]
            channel = self._channels[address] = settings.open_channel(address, options=options)
        return channel

    def _send(self, request: Request) -> None:
        live = self.cluster.live()
        if request.burst:
            try:
                live = [n for n in live if n in self.cluster.replicas(0)]
            except RuntimeError:  # no node answered for the map
                return
        if not live:
            return
        node = self.rng.choice(sorted(live))
        try:
            call = self._channel(node).unary_unary(request.path)
        except KeyError:  # the node just left (membership)
            return
        raw = request.build(self)
        metadata = ((SECRET_HEADER, self.cluster.secret), (NODE_HEADER, "chaos-hostile")) if request.secret else None
        if request.burst:
            futures = [call.future(raw, timeout=self.call_timeout_s, metadata=metadata) for _ in range(request.burst)]
            for future in futures:
                try:
                    future.result()
                except grpc.RpcError as err:
                    self._record(request, node, err)
                else:
                    self.history.record_hostile(request.kind, node, "OK")
            return
        for _ in range(3):
            try:
                answer = call(raw, timeout=self.call_timeout_s, metadata=metadata)
                break
            except grpc.RpcError as err:
                # Not the leader of the shard (or of the metadata): the handler that matters is the leader's.
                leader = errors.from_rpc_error(err).metadata.get("leader", "")
                if leader and leader != node and leader in self.cluster.live():
                    node = leader
                    call = self._channel(node).unary_unary(request.path)
                    continue
                self._record(request, node, err)
                return
        else:
            return
        self.history.record_hostile(request.kind, node, "OK")
        if request.kind == "join-node-no-credentials":
            self._undo_join()
        if request.kind == "deep-topic-store":
            positions = pb.StoreBatchResponse.FromString(answer).positions
            if positions:
                self.deep_position = (positions[0].shard, positions[0].timestamp_us)

    def _send_generated(self) -> None:
        """One request (or stream) the generator built for a random method, recorded under its method."""
        live = self.cluster.live()
        if not live:
            return
        node = self.rng.choice(sorted(live))
        path, method = self.rng.choice(self.generated)
        raws = hostile_requests.requests(method, self.rng)
        proof = path not in hostile_requests.DESTRUCTIVE and self.rng.random() < 0.5
        metadata = [(SECRET_HEADER, self.cluster.secret), (NODE_HEADER, "chaos-hostile")] if proof else None
        try:
            channel = self._channel(node)
        except KeyError:  # the node just left (membership)
            return
        streaming = method.client_streaming or method.server_streaming
        timeout_s = GENERATED_STREAM_S if streaming else self.call_timeout_s
        code = hostile_requests.call(channel, path, method, raws, metadata, timeout_s)
        self.history.record_hostile(_generated_kind(path), node, code.name)

    def _undo_join(self) -> None:
        """The intruder's join went through (a violation, recorded): forget it again, or the metadata group
        would count an unreachable member in its majorities for the rest of the run."""
        try:
            self.cluster.admin("ForgetNode", clpb.ForgetNodeRequest(node_id=INTRUDER), timeout_s=60)
        except (grpc.RpcError, MqdsError, TimeoutError) as err:
            self.history.record_anomaly("hostile-accepted", f"the intruder's join could not be undone: {err}")

    def _record(self, request: Request, node: str, err: grpc.RpcError) -> None:
        code = err.code()
        self.history.record_hostile(
            request.kind, node, code.name if code is not None else "UNKNOWN", f"{err.details() or ''}"
        )
