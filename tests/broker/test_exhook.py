"""The EMQX ExHook provider against a real 3-node cluster: EMQX's hook calls replayed over gRPC, state checked in mqds.

`mqds exhook` runs as a real process with deploy/hooks/redis-style.toml and its
mqds additions uncommented (queue delivery on queue/#, pubsub on pubsub/#,
acknowledgements), serving mutual TLS as EMQX's exhook
ssl option connects; a gRPC client with EMQX's client certificate plays EMQX,
calling the hooks in the order EMQX does for a client's life, and callers
without that certificate are refused. What the provider wrote
is read back with the mqds client. The dispatcher itself is also driven
in-process with the DynamoDB-style rules (queue mode, a restarted dispatcher
that has to look subscriptions up). Acknowledgements survive a restart of the
provider process, and deliveries count as acknowledgements with
on_message_delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from hook_files import write_with_mqds_additions
from repo_paths import ROOT
from tls_certs import TestCA

from mqds.broker.actions import BrokerHooks
from mqds.broker.exhook.provider import HookProvider
from mqds.broker.exhook.v3 import exhook_pb2 as pb
from mqds.broker.exhook.v3 import exhook_pb2_grpc as pb_grpc
from mqds.broker.hooks import load_config, parse_config
from mqds.client import Client, Message, aio
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MQDS = str(Path(sys.executable).with_name("mqds"))
EXAMPLES = ROOT / "deploy" / "hooks"
N_SHARDS = 4
CALL_TIMEOUT_S = 20

T = TypeVar("T")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("exhook") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        yield c


@pytest.fixture(scope="module")
def mqds(cluster: LocalCluster) -> Iterator[Client]:
    with cluster.client(timeout_s=CALL_TIMEOUT_S) as client:
        yield client


@dataclass
class Provider:
    process: subprocess.Popen[str]
    address: str
    banner: str
    lines: queue.Queue[str]
    pump: threading.Thread
    stub: pb_grpc.HookProviderStub
    channel: grpc.Channel
    ca: TestCA

    def stop(self) -> tuple[int, str]:
        """Ctrl-C it; its exit code and what it printed after the banner."""
        self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout=30)
        self.pump.join(timeout=10)  # it ends with the process's stdout
        rest = []
        while not self.lines.empty():
            rest.append(self.lines.get_nowait())
        return code, "".join(rest)


def _pump(stream: Any, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


def tls_channel(address: str, ca: TestCA, client: TestCA | None, name: str = "emqx") -> grpc.Channel:
    """A channel as EMQX's exhook ssl option makes: checks the provider against ``ca``; presents a
    certificate of ``client`` (None: none)."""
    issued = client.issue(name) if client is not None else None
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.pem,
        private_key=issued.key_pem if issued else None,
        certificate_chain=issued.cert_pem if issued else None,
    )
    return grpc.secure_channel(address, credentials)


@pytest.fixture(scope="module")
def provider(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    folder = tmp_path_factory.mktemp("exhook")
    rules = write_with_mqds_additions(EXAMPLES / "redis-style.toml", folder)
    with running_provider(cluster, rules, folder) as started:
        yield started


@contextlib.contextmanager
def running_provider(cluster: LocalCluster, rules: Path, folder: Path) -> Iterator[Provider]:
    """A `mqds exhook` process with ``rules``, its certificates and log in ``folder``; killed if still running."""
    address = f"127.0.0.1:{free_port()}"
    certs = folder / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    # One CA issues the provider's certificate and EMQX's client certificate (as cert-manager would).
    ca = TestCA(certs / "ca")
    served = ca.issue("mqds-exhook")
    stderr = open(folder / "stderr.log", "w+")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        [
            *(MQDS, "--endpoints", ",".join(cluster.addresses), "exhook"),
            *("--config", str(rules), "--listen", address, "--verbose"),
            *("--server-cert", str(served.cert_file), "--server-key", str(served.key_file)),
            *("--client-ca", str(ca.file)),
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    pump = threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True)
    pump.start()
    channel = tls_channel(address, ca, ca)
    try:
        try:
            banner = lines.get(timeout=30)
        except queue.Empty:
            stderr.seek(0)
            pytest.fail(f"mqds exhook printed nothing in 30 s; stderr: {stderr.read()}")
        yield Provider(process, address, banner, lines, pump, pb_grpc.HookProviderStub(channel), channel, ca)
    finally:
        channel.close()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        stderr.seek(0)
        assert "Traceback" not in stderr.read()
        stderr.close()
        stderr.close()


def info(clientid: str, node: str = "emqx@n1") -> pb.ClientInfo:
    return pb.ClientInfo(
        node=node, clientid=clientid, username="user", peerhost="127.0.0.1", sockport=1883, protocol="mqtt"
    )


def emqx_message(
    msg_id: str, topic: str, payload: bytes, qos: int = 1, sender: str = "pub-1", retain: bool = False
) -> pb.Message:
    headers = {"username": "user", "protocol": "mqtt", "peerhost": "127.0.0.1"}
    if retain:
        headers["retain"] = "true"
    return pb.Message(
        node="emqx@n1",
        id=msg_id,
        qos=qos,
        topic=topic,
        payload=payload,
        timestamp=int(time.time() * 1000),
        headers=headers,
        **{"from": sender},
    )


def publish(provider: Provider, message: pb.Message) -> None:
    answer = provider.stub.OnMessagePublish(pb.MessagePublishRequest(message=message), timeout=CALL_TIMEOUT_S)
    # EMQX goes on with the message as it was.
    assert answer.type == pb.ValuedResponse.CONTINUE and answer.message == message


def payloads(messages: list[Message]) -> list[bytes]:
    return [m.payload for m in messages]


def test_a_client_lifecycle_in_emqx_hook_order(provider: Provider, mqds: Client) -> None:
    stub = provider.stub
    assert provider.banner.startswith(
        f"mqds exhook: serving emqx.exhook.v3.HookProvider on {provider.address} (mutual TLS)"
    )
    assert "14 rules" in provider.banner and "hooks: client.connected" in provider.banner

    loaded = stub.OnProviderLoaded(
        pb.ProviderLoadedRequest(broker=pb.BrokerInfo(version="5.9.0"), meta=pb.RequestMeta(node="emqx@n1")),
        timeout=CALL_TIMEOUT_S,
    )
    assert {spec.name: list(spec.topics) for spec in loaded.hooks} == {
        "client.connected": [],
        "client.disconnected": [],
        "session.subscribed": [],
        "session.unsubscribed": [],
        "message.publish": ["#"],
        "message.acked": ["queue/#", "pubsub/#"],
    }

    # The subscriber connects to emqx@n1 (MQTT 5, a session kept for an hour after it leaves) and subscribes.
    conninfo = pb.ConnInfo(node="emqx@n1", clientid="sub-1", proto_name="MQTT", proto_ver="5", keepalive=60)
    props = [pb.Property(name="Session-Expiry-Interval", value="3600")]
    stub.OnClientConnect(pb.ClientConnectRequest(conninfo=conninfo, props=props), timeout=CALL_TIMEOUT_S)
    stub.OnClientConnack(pb.ClientConnackRequest(conninfo=conninfo, result_code="success"), timeout=CALL_TIMEOUT_S)
    stub.OnClientConnected(pb.ClientConnectedRequest(clientinfo=info("sub-1")), timeout=CALL_TIMEOUT_S)
    state = mqds.client_state("sub-1")
    assert state is not None and state.online and state.node == "emqx@n1" and state.offline_at_us == 0
    assert state.session_expiry_s == 3600
    stub.OnSessionCreated(pb.SessionCreatedRequest(clientinfo=info("sub-1")), timeout=CALL_TIMEOUT_S)
    filters = [pb.TopicFilter(name="pubsub/news/#", subopts=pb.SubOpts(qos=1)), pb.TopicFilter(name="queue/jobs")]
    stub.OnClientSubscribe(
        pb.ClientSubscribeRequest(clientinfo=info("sub-1"), topic_filters=filters), timeout=CALL_TIMEOUT_S
    )
    for name, qos in (("pubsub/news/#", 1), ("queue/jobs", 2)):
        stub.OnSessionSubscribed(
            pb.SessionSubscribedRequest(clientinfo=info("sub-1"), topic=name, subopts=pb.SubOpts(qos=qos)),
            timeout=CALL_TIMEOUT_S,
        )
    assert mqds.subscriptions("sub-1") == {"pubsub/news/#": 1, "queue/jobs": 2}

    # A publisher publishes; QoS 0 is not kept (on_message_publish without keep_qos0).
    publish(provider, emqx_message("id-1", "pubsub/news/a", b"m1"))
    publish(provider, emqx_message("id-2", "pubsub/news/b", b"m2", qos=2))
    publish(provider, emqx_message("id-3", "pubsub/news/c", b"qos0", qos=0))
    publish(provider, emqx_message("id-4", "queue/jobs", b"j1"))
    publish(provider, emqx_message("id-5", "queue/jobs", b"j2"))
    publish(provider, emqx_message("id-6", "pubsub/news/state", b"on", retain=True))
    assert payloads(mqds.fetch_offline("sub-1", "pubsub/news/#")) == [b"m1", b"m2", b"on"]
    # Not even there to be fetched with include_qos0: it was never stored.
    assert payloads(mqds.fetch_offline("sub-1", "pubsub/news/#", include_qos0=True)) == [b"m1", b"m2", b"on"]
    assert [(m.topic, m.payload) for m in mqds.retained("pubsub/#")] == [("pubsub/news/state", b"on")]

    # EMQX delivers; the subscriber acknowledges m1 (pubsub) and j1 (queue).
    for msg_id, topic, payload in (("id-1", "pubsub/news/a", b"m1"), ("id-4", "queue/jobs", b"j1")):
        message = emqx_message(msg_id, topic, payload)
        delivered = pb.MessageDeliveredRequest(clientinfo=info("sub-1"), message=message)
        stub.OnMessageDelivered(delivered, timeout=CALL_TIMEOUT_S)
        stub.OnMessageAcked(pb.MessageAckedRequest(clientinfo=info("sub-1"), message=message), timeout=CALL_TIMEOUT_S)
    # The read position of (sub-1, pubsub/news/#) moved past m1; j1 is gone for every queue reader.
    assert payloads(mqds.fetch_offline("sub-1", "pubsub/news/#")) == [b"m2", b"on"]
    assert payloads(mqds.fetch_offline("someone-else", "pubsub/news/#")) == [b"m1", b"m2", b"on"]
    assert payloads(mqds.fetch_offline("someone-else", "queue/jobs", mode="queue")) == [b"j2"]

    stub.OnClientDisconnected(
        pb.ClientDisconnectedRequest(clientinfo=info("sub-1"), reason="normal"), timeout=CALL_TIMEOUT_S
    )
    state = mqds.client_state("sub-1")
    assert state is not None and not state.online and state.offline_at_us >= state.online_at_us > 0
    assert state.expires_at_us == state.offline_at_us + 3600 * 1_000_000

    # While it is away: one more message, and the retained message is deleted (RETAIN, empty payload).
    publish(provider, emqx_message("id-7", "pubsub/news/a", b"m3"))
    publish(provider, emqx_message("id-8", "pubsub/news/state", b"", retain=True))
    assert mqds.retained("pubsub/#") == []

    # It comes back through another EMQX node: online there, and its stored subscriptions are found.
    stub.OnClientConnected(pb.ClientConnectedRequest(clientinfo=info("sub-1", "emqx@n2")), timeout=CALL_TIMEOUT_S)
    stub.OnSessionSubscribed(
        pb.SessionSubscribedRequest(clientinfo=info("sub-1", "emqx@n2"), topic="pubsub/news/#"),
        timeout=CALL_TIMEOUT_S,
    )
    assert payloads(mqds.fetch_offline("sub-1", "pubsub/news/#")) == [b"m2", b"on", b"m3", b""]
    # A late disconnect from the node it left does not mark it offline.
    stub.OnClientDisconnected(pb.ClientDisconnectedRequest(clientinfo=info("sub-1", "emqx@n1")), timeout=CALL_TIMEOUT_S)
    state = mqds.client_state("sub-1")
    assert state is not None and state.online and state.node == "emqx@n2"
    assert mqds.clients_on_node("emqx@n2") == ["sub-1"] and mqds.clients_on_node("emqx@n1") == []

    # Unsubscribing deletes the stored subscription and the read position (on_acked_delete).
    stub.OnSessionUnsubscribed(
        pb.SessionUnsubscribedRequest(clientinfo=info("sub-1", "emqx@n2"), topic="pubsub/news/#"),
        timeout=CALL_TIMEOUT_S,
    )
    assert mqds.subscriptions("sub-1") == {"queue/jobs": 2}
    assert payloads(mqds.fetch_offline("sub-1", "pubsub/news/#")) == [b"m1", b"m2", b"on", b"m3", b""]

    # An acknowledgement of a message the provider never saw published is counted, not an error.
    unknown = emqx_message("never-published", "queue/jobs", b"?")
    stub.OnMessageAcked(pb.MessageAckedRequest(clientinfo=info("sub-1"), message=unknown), timeout=CALL_TIMEOUT_S)

    # Sessions that end: an MQTT 5 client that asked for 1 s is gone soon after it leaves (its state and its
    # subscriptions); an MQTT 3.1.1 client gets the node's default (session_expiry_default_s, 2 h).
    brief = pb.ConnInfo(node="emqx@n1", clientid="brief-1", proto_name="MQTT", proto_ver="5", keepalive=60)
    props = [pb.Property(name="Session-Expiry-Interval", value="1")]
    stub.OnClientConnect(pb.ClientConnectRequest(conninfo=brief, props=props), timeout=CALL_TIMEOUT_S)
    stub.OnClientConnected(pb.ClientConnectedRequest(clientinfo=info("brief-1")), timeout=CALL_TIMEOUT_S)
    stub.OnSessionSubscribed(
        pb.SessionSubscribedRequest(clientinfo=info("brief-1"), topic="pubsub/news/#"), timeout=CALL_TIMEOUT_S
    )
    assert mqds.subscriptions("brief-1") == {"pubsub/news/#": 0}
    stub.OnClientDisconnected(pb.ClientDisconnectedRequest(clientinfo=info("brief-1")), timeout=CALL_TIMEOUT_S)
    deadline = time.monotonic() + 30
    while mqds.client_state("brief-1") is not None or mqds.subscriptions("brief-1"):
        assert time.monotonic() < deadline, "brief-1's session never ended"
        time.sleep(0.2)
    old_style = pb.ConnInfo(node="emqx@n1", clientid="v311-1", proto_name="MQTT", proto_ver="4", keepalive=60)
    stub.OnClientConnect(pb.ClientConnectRequest(conninfo=old_style), timeout=CALL_TIMEOUT_S)
    stub.OnClientConnected(pb.ClientConnectedRequest(clientinfo=info("v311-1")), timeout=CALL_TIMEOUT_S)
    v311 = mqds.client_state("v311-1")
    assert v311 is not None and v311.session_expiry_s == 7200

    # A retained message published with a Message-Expiry-Interval keeps it, and is gone once it runs out.
    expiring = emqx_message("id-9", "pubsub/news/flash", b"soon gone", retain=True)
    answer = stub.OnMessagePublish(
        pb.MessagePublishRequest(message=expiring, props=[pb.Property(name="Message-Expiry-Interval", value="1")]),
        timeout=CALL_TIMEOUT_S,
    )
    assert answer.type == pb.ValuedResponse.CONTINUE
    (flash,) = mqds.retained("pubsub/news/flash")
    assert flash.message_expiry_s == 1
    deadline = time.monotonic() + 30
    while mqds.retained("pubsub/news/flash"):
        assert time.monotonic() < deadline, "the retained message never expired"
        time.sleep(0.2)


def test_malformed_requests_get_clear_errors_and_the_provider_goes_on(provider: Provider, mqds: Client) -> None:
    stub = provider.stub
    bad_calls = [
        (lambda: stub.OnClientConnected(pb.ClientConnectedRequest(), timeout=CALL_TIMEOUT_S), "clientid is empty"),
        (
            lambda: stub.OnClientConnect(
                pb.ClientConnectRequest(
                    conninfo=pb.ConnInfo(clientid="c-bad", proto_ver="5"),
                    props=[pb.Property(name="Session-Expiry-Interval", value="4294967296")],
                ),
                timeout=CALL_TIMEOUT_S,
            ),
            "Session-Expiry-Interval 4294967296 is out of range",
        ),
        (
            lambda: stub.OnMessagePublish(
                pb.MessagePublishRequest(message=emqx_message("x1", "a/+/b", b"p")), timeout=CALL_TIMEOUT_S
            ),
            "wildcards",
        ),
        (
            lambda: stub.OnMessagePublish(
                pb.MessagePublishRequest(message=emqx_message("x2", "a/b", b"p", qos=5)), timeout=CALL_TIMEOUT_S
            ),
            "qos must be 0, 1 or 2",
        ),
        (lambda: stub.OnMessagePublish(pb.MessagePublishRequest(), timeout=CALL_TIMEOUT_S), "message is missing"),
        (
            lambda: stub.OnMessageDelivered(
                pb.MessageDeliveredRequest(clientinfo=info("sub-x")), timeout=CALL_TIMEOUT_S
            ),
            "message is missing",
        ),
        (
            lambda: stub.OnMessageAcked(
                pb.MessageAckedRequest(message=emqx_message("x3", "queue/a", b"p")), timeout=CALL_TIMEOUT_S
            ),
            "clientid is empty",
        ),
        (
            lambda: stub.OnSessionSubscribed(
                pb.SessionSubscribedRequest(clientinfo=info("sub-x"), topic="a/#/b"), timeout=CALL_TIMEOUT_S
            ),
            "'#' must be the last level",
        ),
        (
            lambda: stub.OnSessionSubscribed(
                pb.SessionSubscribedRequest(clientinfo=info("sub-x"), topic="$share/g"), timeout=CALL_TIMEOUT_S
            ),
            "invalid shared subscription",
        ),
    ]
    for call, expected in bad_calls:
        with pytest.raises(grpc.RpcError) as failure:
            call()
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
        assert expected in failure.value.details() and "invalid request" in failure.value.details()

    # Bytes that are no protobuf message at all.
    raw = provider.channel.unary_unary("/emqx.exhook.v3.HookProvider/OnMessagePublish")
    with pytest.raises(grpc.RpcError) as failure:
        raw(b"\xff\xff\xff\xff", timeout=CALL_TIMEOUT_S)
    # gRPC itself refuses them, before the provider sees them.
    assert failure.value.code() == grpc.StatusCode.UNKNOWN
    assert "Error parsing message with type 'emqx.exhook.v3.MessagePublishRequest'" in failure.value.details()

    # Still serving, and still storing.
    loaded = stub.OnProviderLoaded(pb.ProviderLoadedRequest(), timeout=CALL_TIMEOUT_S)
    assert "message.publish" in [spec.name for spec in loaded.hooks]
    publish(provider, emqx_message("after-errors", "queue/after", b"still here"))
    assert payloads(mqds.fetch_offline("anyone", "queue/after", mode="queue")) == [b"still here"]


def test_callers_without_emqx_s_certificate_store_nothing(provider: Provider, mqds: Client, tmp_path: Path) -> None:
    """Mutual TLS: no client certificate, one of another CA, or plaintext: OnMessagePublish never runs."""
    forged = pb.MessagePublishRequest(message=emqx_message("forged-1", "forged/topic", b"forged", sender="mallory"))
    stranger = TestCA(tmp_path / "stranger", name="another CA")
    callers = {
        "no client certificate": tls_channel(provider.address, provider.ca, None),
        "a certificate of another CA": tls_channel(provider.address, provider.ca, stranger),
        "plaintext": grpc.insecure_channel(provider.address),
    }
    for what, channel in callers.items():
        with channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.HookProviderStub(channel).OnMessagePublish(forged, timeout=10)
        # The handshake fails: no call is read, nothing is answered by the provider.
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (what, refused.value.details())
    assert list(mqds.replay("forged/#")) == []
    # EMQX's certificate still gets in, on the same port.
    publish(provider, emqx_message("after-forgeries", "queue/after-forgeries", b"from emqx"))
    assert payloads(mqds.fetch_offline("anyone", "queue/after-forgeries", mode="queue")) == [b"from emqx"]


def test_ctrl_c_prints_what_was_handled(provider: Provider) -> None:
    code, out = provider.stop()
    assert code == 0, out
    assert out.startswith("mqds exhook: stopped; handled "), out
    lines = {line.strip().split(": ", 1)[0]: line.strip().split(": ", 1)[1] for line in out.splitlines()[1:]}
    counts = {
        part: {name: int(n) for name, n in (item.rsplit(" ", 1) for item in text.split(", "))}
        for part, text in lines.items()
    }
    calls, errors, done = counts["calls"], counts["errors"], counts["done"]
    # Publishes: 9 in the lifecycle, 3 refused and 1 more after them (the undecodable bytes never reach it),
    # 1 after the forgeries (which never reached it either).
    assert calls["OnMessagePublish"] == 14 and errors["OnMessagePublish"] == 3
    assert calls["OnMessageAcked"] == 4 and calls["OnClientConnected"] == 5 and errors["OnClientConnected"] == 1
    assert errors == {
        "OnClientConnect": 1,
        "OnClientConnected": 1,
        "OnMessageAcked": 1,
        "OnMessageDelivered": 1,
        "OnMessagePublish": 3,
        "OnSessionSubscribed": 2,
    }
    assert calls["OnClientConnect"] == 4 and calls["OnMessageDelivered"] == 3
    assert {name: done.get(name) for name in ("stored", "retained", "retained deleted", "acked")} == {
        "stored": 10,  # QoS 1/2 only: the QoS 0 message was not kept
        "retained": 2,
        "retained deleted": 1,
        "acked": 2,
    }
    assert done["acks of unknown messages"] == 1
    assert done["late disconnects ignored"] == 1 and done["clients disconnected"] == 2
    # What ExHook cannot hand back to EMQX is counted: the reconnect's lookup and the resubscription's backlog.
    assert done["proxy subscriptions found"] == 2 and done["offline messages found"] == 4
    # The stores went through the client's pipeline: its calls, batches and their messages.
    assert counts["pipeline"]["messages"] == 10 and 1 <= counts["pipeline"]["batches"] <= 10


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_dispatcher_with_dynamodb_rules(cluster: LocalCluster, mqds: Client, tmp_path: Path) -> None:
    """Queue delivery, shared subscriptions, and acknowledgements after a dispatcher restart (the DynamoDB
    seed's rules, with the mqds additions that store subscriptions for its session.created lookup)."""
    config = load_config(write_with_mqds_additions(EXAMPLES / "dynamodb-style.toml", tmp_path))

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with aio.Client(cluster.addresses, timeout_s=CALL_TIMEOUT_S) as client:
            hooks = BrokerHooks(client, config, node="amqtt-1")
            assert await hooks.client_connected("worker-1") == {}  # no lookup on client.connected here
            assert await hooks.session_created("worker-1") == {}
            first = await hooks.session_subscribed("worker-1", "$share/pool/dyn/jobs/+", 1)
            out["first"] = first
            stored = [
                await hooks.message_publish(
                    Message(topic=f"dyn/jobs/{n}", payload=f"job{n}".encode(), sender="p", qos=1)
                )
                for n in range(3)
            ]
            out["stored"] = stored
            # The seed's on_message_publish keeps QoS 1/2 only (its on_message_store line is commented out).
            out["qos0"] = await hooks.message_publish(Message(topic="dyn/jobs/9", payload=b"qos0", sender="p"))
            out["retained_publish"] = await hooks.message_publish(
                Message(topic="dyn/state", payload=b"up", sender="p", qos=1, retain=True)
            )
            # The dispatcher is gone (a broker restart); a new one must find the subscription in mqds.
            hooks = BrokerHooks(client, config, node="amqtt-1")
            assert hooks.known_filters("worker-1") == {}
            await hooks.message_acked("worker-1", stored[0])
            out["after_ack"] = await client.fetch_offline("x", "dyn/jobs/+", mode="queue", include_qos0=True)
            out["known"] = hooks.known_filters("worker-1")
            out["second"] = await hooks.session_subscribed("worker-2", "dyn/#", 1)
            out["lookup"] = await hooks.session_created("worker-1")
            with pytest.raises(ValueError, match="stored position"):
                await hooks.message_acked("worker-1", Message(topic="dyn/jobs/1", payload=b"job1"))
            await hooks.client_disconnected("worker-1")
            out["stats"] = dict(hooks.stats)
        return out

    got = run(scenario())
    assert got["first"].messages == [] and got["first"].modes == {"dyn/jobs/+": "queue"}
    assert [m.qos for m in got["stored"]] == [1, 1, 1] and all(m.shard is not None for m in got["stored"])
    assert got["qos0"] is None  # not stored, so never fetched offline
    assert got["retained_publish"] is not None  # QoS 1: stored too
    assert payloads(got["after_ack"]) == [b"job1", b"job2"]
    assert got["known"] == {"dyn/jobs/+": 1}
    second = got["second"]
    assert payloads(second.offline) == [b"job1", b"job2", b"up"] and second.modes == {"dyn/#": "queue"}
    assert [(m.topic, m.payload) for m in second.retained] == [("dyn/state", b"up")]
    assert second.messages == second.offline + second.retained
    # The shared subscription was stored as given, prefix and all.
    assert got["lookup"] == {"$share/pool/dyn/jobs/+": 1}
    assert mqds.subscriptions("worker-1") == {"$share/pool/dyn/jobs/+": 1}
    state = mqds.client_state("worker-1")
    assert state is not None and not state.online and state.node == "amqtt-1"
    # The restarted dispatcher read stored subscriptions for worker-1's ack and worker-2's first subscription.
    assert got["stats"]["subscription_cache_misses"] == 2 and got["stats"]["acked"] == 1


def test_concurrent_publishes_share_stores(cluster: LocalCluster, mqds: Client) -> None:
    """EMQX calls OnMessagePublish once per message: concurrent calls must share batches, each stored once, in order."""
    config = load_config(EXAMPLES / "redis-style.toml")
    n = 200

    async def scenario() -> tuple[list[pb.ValuedResponse], dict[str, int]]:
        async with aio.Client(cluster.addresses, timeout_s=CALL_TIMEOUT_S) as client:
            provider = HookProvider(BrokerHooks(client, config, node="emqx-1"))
            calls = [
                provider.OnMessagePublish(
                    pb.MessagePublishRequest(
                        message=pb.Message(
                            id=f"m{i}", qos=1, topic="pubsub/fast/1", payload=f"{i}".encode(), **{"from": "fast-pub"}
                        )
                    ),
                    None,
                )
                for i in range(n)
            ]
            answers = await asyncio.gather(*calls)
            return list(answers), client.pipeline_stats()

    answers, stats = run(scenario())
    assert all(a.type == pb.ValuedResponse.CONTINUE for a in answers)
    stored = [m.payload for m in mqds.replay("pubsub/fast/#")]
    assert stored == [f"{i}".encode() for i in range(n)]  # each once, in the order EMQX called
    assert stats["calls"] == n and stats["messages"] == n
    assert stats["batches"] <= n // 4, f"{stats['batches']} batches for {n} concurrent publishes"


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Context:
    """What the provider uses of a call's context: ``abort`` ends the call with a status."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


def test_a_publish_with_too_many_user_properties_fails_alone(cluster: LocalCluster, mqds: Client) -> None:
    """Concurrent OnMessagePublish calls share the provider's batches: one with 1,025 user properties (EMQX
    passes MQTT 5's on) fails with its reason, and every other publisher's message is stored. It used to
    fail the batch it shared, so one MQTT client could drop others' messages. (A provider of its own, in
    this process: the module's one was stopped by the Ctrl-C test.)"""
    config = load_config(EXAMPLES / "redis-style.toml")
    too_many = [pb.Property(name=f"k{i}", value="v") for i in range(1025)]
    requests = [
        pb.MessagePublishRequest(
            message=emqx_message(f"props-{i}", f"pubsub/props/{i % 3}", str(i).encode(), sender=f"props-pub-{i % 3}"),
            user_props=too_many if i == 10 else [],
        )
        for i in range(60)
    ]

    async def scenario() -> list[Any]:
        async with aio.Client(cluster.addresses, timeout_s=CALL_TIMEOUT_S) as client:
            provider = HookProvider(BrokerHooks(client, config, node="emqx-1"))
            calls = [provider.OnMessagePublish(request, _Context()) for request in requests]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    answers = run(scenario())
    refused = answers[10]
    assert isinstance(refused, _Aborted), refused
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "1,025 user properties" in refused.details
    for i, answer in enumerate(answers):
        if i != 10:
            assert answer.type == pb.ValuedResponse.CONTINUE, (i, answer)
    stored = sorted(int(m.payload) for m in mqds.replay("pubsub/props/#"))
    assert stored == [i for i in range(60) if i != 10]


def test_mqds_exhook_refuses_what_it_cannot_serve(cluster: LocalCluster, tmp_path: Path) -> None:
    endpoints = ",".join(cluster.addresses)
    config = str(EXAMPLES / "cassandra-style.yaml")

    def exhook(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([MQDS, *args], capture_output=True, text=True, timeout=60)
        assert "Traceback" not in done.stderr, done.stderr
        return done

    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nhook = "message.publish"\naction = "on_message_fetch"\n')
    refused = exhook("--endpoints", endpoints, "exhook", "--config", str(bad), "--listen", "127.0.0.1:0")
    assert refused.returncode == 2
    assert f"mqds exhook: {bad}: rule 1 (message.publish -> on_message_fetch): on_message_fetch does not run" in (
        refused.stderr
    )
    # The listening port of a node is taken: refused, not shared.
    taken = exhook("--endpoints", endpoints, "exhook", "--config", config, "--listen", cluster.addresses[0])
    assert taken.returncode == 1 and f"cannot listen on {cluster.addresses[0]}" in taken.stderr, taken.stderr
    nobody = f"127.0.0.1:{free_port()}"
    unreachable = exhook("--endpoints", nobody, "--timeout", "2", "exhook", "--config", config)
    assert unreachable.returncode == 1 and f"cannot reach the mqds cluster at {nobody}" in unreachable.stderr
    assert exhook("exhook", "--config", config, "--ack-cache-size", "0").returncode == 2

    # Secure by default: an address other machines reach needs mutual TLS. Refused before the cluster is asked
    # (its endpoint answers nothing here) and before anything listens.
    issued = TestCA(tmp_path / "ca").issue("exhook")
    server_tls = ("--server-cert", str(issued.cert_file), "--server-key", str(issued.key_file))
    for listen, extra in (("0.0.0.0:0", ()), ("[::]:0", ()), ("0.0.0.0:0", server_tls)):
        exposed = exhook("--endpoints", nobody, "exhook", "--config", config, "--listen", listen, *extra)
        assert exposed.returncode == 2, exposed.stderr
        assert f"--listen {listen} can be reached from other machines" in exposed.stderr
        assert "authenticates no caller" in exposed.stderr and "--insecure-no-client-auth" in exposed.stderr
    # Asked for by name, with a loud warning: it goes on (and here finds no cluster).
    insecure = exhook(
        *("--endpoints", nobody, "--timeout", "2", "exhook", "--config", config, "--listen", "0.0.0.0:0"),
        "--insecure-no-client-auth",
    )
    assert insecure.returncode == 1 and "WARNING: --insecure-no-client-auth" in insecure.stderr, insecure.stderr
    assert f"cannot reach the mqds cluster at {nobody}" in insecure.stderr
    missing_key = exhook("exhook", "--config", config, "--server-cert", str(issued.cert_file))
    assert missing_key.returncode == 2 and "--server-cert and --server-key go together" in missing_key.stderr


def test_acknowledgements_after_a_provider_restart(cluster: LocalCluster, mqds: Client, tmp_path: Path) -> None:
    """EMQX acknowledges through a new `mqds exhook` process messages the one before it stored: the id ->
    position records are in mqds, so the read position moves (it used to be an in-memory map: skipped)."""
    rules = write_with_mqds_additions(EXAMPLES / "redis-style.toml", tmp_path)
    ids = [uuid.uuid4().hex for _ in range(4)]  # EMQX's ids: its GUIDs in hex
    sent = [emqx_message(ids[n], "pubsub/restart/a", f"r{n}".encode()) for n in range(3)]
    sent.append(emqx_message(ids[3], "queue/restart", b"q0"))
    with running_provider(cluster, rules, tmp_path / "first") as first:
        first.stub.OnClientConnected(pb.ClientConnectedRequest(clientinfo=info("restart-sub")), timeout=CALL_TIMEOUT_S)
        for name in ("pubsub/restart/#", "queue/restart"):
            first.stub.OnSessionSubscribed(
                pb.SessionSubscribedRequest(clientinfo=info("restart-sub"), topic=name, subopts=pb.SubOpts(qos=1)),
                timeout=CALL_TIMEOUT_S,
            )
        for message in sent:
            publish(first, message)
        # EMQX delivers them; r0 is acknowledged before the provider goes.
        first.stub.OnMessageAcked(
            pb.MessageAckedRequest(clientinfo=info("restart-sub"), message=sent[0]), timeout=CALL_TIMEOUT_S
        )
        assert first.stop()[0] == 0
    assert payloads(mqds.fetch_offline("restart-sub", "pubsub/restart/#")) == [b"r1", b"r2"]
    # The records: one per stored message, replicated and expiring, under a $-topic no "#" subscriber matches.
    stored = {m.payload: m for m in mqds.replay("pubsub/restart/#")} | {m.payload: m for m in mqds.replay("queue/#")}
    records = {m.topic.rsplit("/", 1)[1]: m for m in mqds.retained("$mqds/exhook/positions/+")}
    for message in sent:
        copy = stored[message.payload]
        assert records[message.id].payload == f"{copy.shard} {copy.timestamp_us}".encode()
        assert 0 < records[message.id].message_expiry_s <= 86_400
    assert not [m for m in mqds.retained("#") if m.topic.startswith("$mqds/")]

    with running_provider(cluster, rules, tmp_path / "second") as second:
        for message in (sent[1], sent[3]):
            second.stub.OnMessageAcked(
                pb.MessageAckedRequest(clientinfo=info("restart-sub"), message=message), timeout=CALL_TIMEOUT_S
            )
        # An id no provider stored is still counted and skipped.
        unknown = emqx_message(uuid.uuid4().hex, "pubsub/restart/a", b"never stored")
        second.stub.OnMessageAcked(
            pb.MessageAckedRequest(clientinfo=info("restart-sub"), message=unknown), timeout=CALL_TIMEOUT_S
        )
        code, printed = second.stop()
    assert code == 0
    # The read position moved past r1, and the queue message is gone for every reader.
    assert payloads(mqds.fetch_offline("restart-sub", "pubsub/restart/#")) == [b"r2"]
    assert mqds.fetch_offline("someone-else", "queue/restart", mode="queue") == []
    done = dict(
        (what.strip(), int(n)) for what, n in (part.rsplit(" ", 1) for part in _line(printed, "done: ").split(", "))
    )
    assert done["ack positions read"] == 2 and done["acks of unknown messages"] == 1 and done["acked"] == 2


def _line(printed: str, start: str) -> str:
    return next(line.strip()[len(start) :] for line in printed.splitlines() if line.strip().startswith(start))


def test_deliveries_count_as_acknowledgements_with_on_message_delivered(cluster: LocalCluster, mqds: Client) -> None:
    """message.delivered with on_message_delivered: each delivery moves the read position (QoS 0 too, which no
    PUBACK acknowledges), also in a provider started after the message was stored."""
    config = parse_config(
        {
            "rule": [
                {"hook": "message.publish", "topic": "deliv/#", "action": "on_message_store"},
                {"hook": "session.subscribed", "topic": "deliv/#", "action": "on_message_fetch"},
                # A provider that restarts finds the client's filters in mqds.
                {"hook": "session.subscribed", "topic": "deliv/#", "action": "on_subscription_store"},
                {"hook": "message.delivered", "topic": "deliv/#", "action": "on_message_delivered"},
            ]
        }
    )
    sent = [emqx_message(uuid.uuid4().hex, "deliv/a", f"d{n}".encode(), qos=0) for n in range(3)]

    def delivered(message: pb.Message) -> pb.MessageDeliveredRequest:
        return pb.MessageDeliveredRequest(clientinfo=info("deliv-sub"), message=message)

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with aio.Client(cluster.addresses, timeout_s=CALL_TIMEOUT_S) as client:
            first = HookProvider(BrokerHooks(client, config, node="emqx-1"))
            out["needed"] = first.hooks.needed_hooks()
            subscribe = pb.SessionSubscribedRequest(
                clientinfo=info("deliv-sub"), topic="deliv/#", subopts=pb.SubOpts(qos=0)
            )
            await first.OnSessionSubscribed(subscribe, _Context())
            for message in sent:
                await first.OnMessagePublish(pb.MessagePublishRequest(message=message), _Context())
            await first.OnMessageDelivered(delivered(sent[0]), _Context())
            out["after_first"] = await client.fetch_offline("deliv-sub", "deliv/#", include_qos0=True)
            # Another provider (a restart): it knows neither the ids nor the client's filters.
            second = HookProvider(BrokerHooks(client, config, node="emqx-1"))
            await second.OnMessageDelivered(delivered(sent[1]), _Context())
            out["after_second"] = await client.fetch_offline("deliv-sub", "deliv/#", include_qos0=True)
            # Ids that are no EMQX id (a topic's wildcards, 100,000 characters) resolve to nothing: counted.
            for hostile in ("x/#/+", "a" * 100_000):
                message = emqx_message(hostile, "deliv/a", b"d0", qos=0)
                await second.OnMessageDelivered(delivered(message), _Context())
            out["stats"] = second.hooks.stats + second.stats + second.positions.stats
        return out

    got = run(scenario())
    assert got["needed"]["message.delivered"] == ["deliv/#"]
    assert payloads(got["after_first"]) == [b"d1", b"d2"]
    assert payloads(got["after_second"]) == [b"d2"]
    assert got["stats"]["acked_on_delivery"] == 1 and got["stats"]["ack_positions_read"] == 1
    assert got["stats"]["deliveries_of_unknown_messages"] == 2
