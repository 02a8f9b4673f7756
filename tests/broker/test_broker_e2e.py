"""The amqtt broker with the mqds plugin, end to end: a real 3-node cluster, `mqds broker` as a process, paho clients.

One cluster and one broker (restarted by the last test) serve the module; each
test uses topics and clientids of its own. The hook rules are the EMQX-style
file written below: everything stored, pubsub offline delivery on
``e2e/pubsub/#`` and ``e2e/offline/#`` and ``e2e/retfetch/#``, queue delivery on ``e2e/queue/#``, no
offline fetch for ``e2e/retained/#`` and ``e2e/proxy/#`` (so what those
tests receive is the retained lookup or amqtt's live routing alone).
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import MQDS, cluster_up
from mqtt_support import BrokerProcess, Mqtt, payloads

from mqds.client import Client, ClientState
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_SHARDS = 4
NODE = "broker-e2e"
HOOKS = """
[[rule]]
hook = "client.connected"
action = "on_client_connected"

[[rule]]
hook = "client.connected"
action = "on_subscribe_lookup"

[[rule]]
hook = "client.disconnected"
action = "on_client_disconnected"

[[rule]]
hook = "message.publish"
topic = "#"
action = "on_message_publish"

[[rule]]
hook = "message.publish"
topic = "#"
action = "on_message_retain"

[[rule]]
hook = "session.subscribed"
topic = "#"
action = "on_subscription_store"

[[rule]]
hook = "session.subscribed"
topic = "#"
action = "on_retain_lookup"

[[rule]]
hook = "session.subscribed"
topic = "e2e/queue/#"
action = "on_message_fetch_for_queue"

[[rule]]
hook = "session.subscribed"
topic = "e2e/pubsub/#"
action = "on_message_fetch_for_pubsub"

[[rule]]
hook = "session.subscribed"
topic = "e2e/offline/#"
action = "on_message_fetch_for_pubsub"
# Smaller than the offline story's backlog: it must come page by page, none skipped.
offline_opts = { max_returned_count = 25 }

[[rule]]
hook = "session.subscribed"
topic = "e2e/retfetch/#"
action = "on_message_fetch_for_pubsub"

[[rule]]
hook = "session.subscribed"
topic = "e2e/will/#"
action = "on_message_fetch_for_pubsub"

[[rule]]
hook = "session.unsubscribed"
topic = "#"
action = "on_subscription_delete"

[[rule]]
hook = "message.acked"
topic = "#"
action = "on_message_acked"
"""


@dataclass
class Cluster:
    data_dir: Path
    endpoints: str
    client: Client

    def harness(self) -> LocalCluster:
        return LocalCluster.load(self.data_dir)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    data_dir = tmp_path_factory.mktemp("broker-e2e") / "cluster"
    with cluster_up(data_dir, N_SHARDS) as endpoints, Client(endpoints, timeout_s=30) as client:
        yield Cluster(data_dir, endpoints, client)


@pytest.fixture(scope="module")
def broker(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    workdir = tmp_path_factory.mktemp("broker")
    hooks = workdir / "hooks.toml"
    hooks.write_text(HOOKS)
    process = BrokerProcess(workdir, cluster.endpoints, hooks, NODE)
    try:
        process.start()
        yield process
    finally:
        process.kill()


@pytest.fixture
def connect(broker: BrokerProcess) -> Iterator[Callable[..., Mqtt]]:
    """connect(clientid, clean_session=..., ...) -> a connected client; all are closed after the test."""
    made: list[Mqtt] = []

    def make(
        clientid: str, *, clean_session: bool = True, will: tuple[str, bytes] | None = None, max_inflight: int = 20
    ) -> Mqtt:
        client = Mqtt(broker.port, clientid, clean_session=clean_session, will=will, max_inflight=max_inflight)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def test_broker_command_explains_itself_and_refuses_bad_input(tmp_path: Path) -> None:
    shown = subprocess.run([MQDS, "broker", "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0
    options = ("--listen", "--hooks", "--node", "--amqtt-config", "--max-inflight", "--early-puback", "--endpoints")
    for option in (*options, "--tls-ca"):
        assert option in shown.stdout
    bad = tmp_path / "hooks.toml"
    bad.write_text('[[rule]]\nhook = "message.publish"\naction = "on_mesage_publish"\n')
    refused = subprocess.run([MQDS, "broker", "--hooks", str(bad)], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2
    assert f"{bad}: rule 1" in refused.stderr and "did you mean 'on_message_publish'" in refused.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run(
            [MQDS, "broker", "--endpoints", "127.0.0.1:1", "--timeout", "1", "--listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert busy.returncode == 1 and "the broker did not start" in busy.stderr and "Traceback" not in busy.stderr


def state_when(cluster: Cluster, broker: BrokerProcess, clientid: str, online: bool) -> ClientState:
    """The client's recorded state once it says ``online``: within 25 s, past the broker's 20 s call deadline
    (its one call that records a connect or a disconnect may retry that long on a loaded machine). The broker
    logs a client's step that takes over 5 s, and the failure shows its output."""

    def check() -> ClientState | None:
        state = cluster.client.client_state(clientid)
        return state if state is not None and state.online == online else None

    try:
        return wait_until(f"{clientid} recorded {'online' if online else 'offline'}", check, 25)
    except TimeoutError as err:
        raise TimeoutError(f"{err}; the broker's output:\n{broker.output()[-3000:]}") from None


def test_client_state_follows_connect_and_disconnect(
    cluster: Cluster, broker: BrokerProcess, connect: Callable[..., Mqtt]
) -> None:
    """A persistent session's state: online on this node, then offline (kept: its session outlives the
    connection). A clean session's offline state is not waited for here: it ends at the disconnect, and the
    node's expiry removes it within a second (the next test)."""
    client = connect("e2e-state", clean_session=False)
    state = state_when(cluster, broker, "e2e-state", online=True)
    assert state.node == NODE and state.online_at_us > 0 and state.offline_at_us == 0
    assert "e2e-state" in cluster.client.clients_on_node(NODE)
    client.close()
    state = state_when(cluster, broker, "e2e-state", online=False)
    assert state.node == NODE and state.offline_at_us >= state.online_at_us
    assert "e2e-state" not in cluster.client.clients_on_node(NODE)


def test_a_clean_sessions_state_ends_with_its_connection(
    cluster: Cluster, broker: BrokerProcess, connect: Callable[..., Mqtt]
) -> None:
    """MQTT 3.1.1's clean session lasts as long as its connection: the broker records it with a session expiry
    of 0, so after the disconnect the client's state is gone, not left offline (within the record's 20 s call
    deadline and the node's expiry check, every second)."""
    client = connect("e2e-state-clean")
    state = state_when(cluster, broker, "e2e-state-clean", online=True)
    assert state.node == NODE and state.session_expiry_s == 0
    client.close()
    try:
        wait_until(
            "e2e-state-clean's state removed", lambda: cluster.client.client_state("e2e-state-clean") is None, 30
        )
    except TimeoutError as err:
        raise TimeoutError(f"{err}; the broker's output:\n{broker.output()[-3000:]}") from None
    assert "e2e-state-clean" not in cluster.client.clients_on_node(NODE)


def test_proxy_subscription_applies_on_connect(cluster: Cluster, connect: Callable[..., Mqtt]) -> None:
    cluster.client.subscribe("e2e-proxy", "e2e/proxy/#", qos=1)
    listener = connect("e2e-proxy", clean_session=False)  # a persistent session subscribing to nothing itself
    publisher = connect("e2e-proxy-pub")

    def probe() -> bool:
        publisher.publish("e2e/proxy/probe", b"p")
        return not listener.messages.empty()

    # The plugin adds the proxy subscription just after CONNACK: probe until it is in place.
    wait_until("the proxy subscription delivers", probe, 10, interval_s=0.2)
    listener.quiet(0.5)
    publisher.publish("e2e/proxy/door", b"open")
    assert listener.take(1) == [("e2e/proxy/door", b"open", 1, False)]


def test_retained_lookup_and_delete(cluster: Cluster, connect: Callable[..., Mqtt]) -> None:
    publisher = connect("e2e-ret-pub")
    publisher.publish("e2e/retained/lamp", b"on", retain=True)
    wait_until("the retained message in mqds", lambda: cluster.client.retained("e2e/retained/#"), 10)
    first = connect("e2e-ret-sub-1")
    first.subscribe("e2e/retained/#")
    # Exactly once: mqds's copy; amqtt's in-memory copy was dropped.
    assert first.take(1) == [("e2e/retained/lamp", b"on", 1, True)]
    assert first.quiet(1.0) == []

    publisher.publish("e2e/retained/lamp", b"", retain=True)  # an empty retained payload deletes it
    assert first.take(1) == [("e2e/retained/lamp", b"", 1, False)]  # routed live like any message
    wait_until("the retained message deleted", lambda: cluster.client.retained("e2e/retained/#") == [], 10)
    second = connect("e2e-ret-sub-2")
    second.subscribe("e2e/retained/#")
    assert second.quiet(1.0) == []


def stored_count(cluster: Cluster, topic_filter: str) -> int:
    return len(list(cluster.client.replay(topic_filter)))


def test_a_new_clean_subscriber_gets_only_what_is_published_after_its_subscribe(
    cluster: Cluster, connect: Callable[..., Mqtt]
) -> None:
    publisher = connect("e2e-new-pub")
    for i in range(5):
        publisher.publish("e2e/pubsub/new/dev", f"history-{i}")
    assert stored_count(cluster, "e2e/pubsub/new/#") == 5  # PUBACK came once stored
    subscriber = connect("e2e-new-clean")
    subscriber.subscribe("e2e/pubsub/new/#")
    assert subscriber.quiet(1.0) == []  # MQTT: a new subscription gets what is published after it
    for i in range(3):
        publisher.publish("e2e/pubsub/new/dev", f"live-{i}")
    assert payloads(subscriber.take(3)) == ["live-0", "live-1", "live-2"]
    assert subscriber.quiet(1.0) == []
    subscriber.close()
    # A clean session keeps nothing in mqds: no subscription, no read position to come back to.
    assert cluster.client.subscriptions("e2e-new-clean") == {}
    assert not cluster.client.read_position("e2e-new-clean", "e2e/pubsub/new/#").found
    again = connect("e2e-new-clean")
    again.subscribe("e2e/pubsub/new/#")
    assert again.quiet(1.0) == []
    publisher.publish("e2e/pubsub/new/dev", "after-again")
    assert payloads(again.take(1)) == ["after-again"]


def test_a_persistent_session_gets_what_was_published_while_away_from_its_subscribe_on(
    cluster: Cluster, connect: Callable[..., Mqtt]
) -> None:
    publisher = connect("e2e-away-pub")
    for i in range(4):
        publisher.publish("e2e/pubsub/away/dev", f"before-{i}")
    assert stored_count(cluster, "e2e/pubsub/away/#") == 4
    subscriber = connect("e2e-away-sub", clean_session=False)
    subscriber.subscribe("e2e/pubsub/away/#")
    assert subscriber.quiet(1.0) == []  # nothing from before its SUBSCRIBE
    publisher.publish("e2e/pubsub/away/dev", "online-0")
    publisher.publish("e2e/pubsub/away/dev", "online-1")
    assert payloads(subscriber.take(2)) == ["online-0", "online-1"]
    subscriber.close()
    wait_until(
        "e2e-away-sub's acknowledgements recorded",
        lambda: cluster.client.fetch_offline("e2e-away-sub", "e2e/pubsub/away/#") == [],
        10,
    )
    for i in range(5):
        publisher.publish("e2e/pubsub/away/dev", f"away-{i}")
    back = connect("e2e-away-sub", clean_session=False)  # subscribes to nothing: its session has the filter
    assert back.session_present is True
    assert payloads(back.take(5)) == [f"away-{i}" for i in range(5)]
    assert back.quiet(1.0) == []
    back.close()
    # The same filter subscribed again (a re-subscribe) goes on where it was, not from the start again.
    again = connect("e2e-away-sub", clean_session=False)
    again.subscribe("e2e/pubsub/away/#")
    assert again.quiet(1.0) == []


def test_a_persistent_subscription_made_mid_stream_gets_the_stream_in_order_from_its_subscribe(
    cluster: Cluster, connect: Callable[..., Mqtt]
) -> None:
    """The filter goes live at SUBSCRIBE, its read position starts a moment later: nothing in between is
    lost or sent out of order (each publisher's messages keep their order)."""
    publisher = connect("e2e-stream-pub")
    acked = 0
    stop = threading.Event()

    def publish() -> None:
        nonlocal acked
        while not stop.is_set() and acked < 2000:
            publisher.publish("e2e/pubsub/stream/dev", str(acked))
            acked += 1

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        wait_until("the stream flowing", lambda: acked >= 50, 20)
        subscriber = connect("e2e-stream-sub", clean_session=False)
        subscriber.subscribe("e2e/pubsub/stream/#")
        at_suback = acked
        wait_until("200 more published", lambda: acked >= at_suback + 200, 30)
    finally:
        stop.set()
        thread.join(20)
    total = acked
    # Message at_suback was in flight at SUBACK: it may have reached the broker before the subscription did
    # (then it is not the subscriber's), so wait for those after it, then take whatever else comes.
    got = [int(p) for p in payloads(subscriber.take(total - at_suback - 1, timeout_s=30))]
    got += [int(p) for p in payloads(subscriber.quiet(1.0))]
    first = got[0]
    # Everything acknowledged after SUBACK, in order, once; at most what was in flight at SUBACK before it.
    assert first <= at_suback + 1, (first, at_suback)
    assert got == list(range(first, total)), got


def test_a_clean_connect_discards_the_persistent_session_mqds_kept(
    cluster: Cluster, connect: Callable[..., Mqtt]
) -> None:
    first = connect("e2e-discard", clean_session=False)
    first.subscribe("e2e/pubsub/discard/#")
    first.close()
    wait_until("the subscription stored", lambda: cluster.client.subscriptions("e2e-discard") != {}, 10)
    publisher = connect("e2e-discard-pub")
    for i in range(3):
        publisher.publish("e2e/pubsub/discard/dev", f"missed-{i}")
    clean = connect("e2e-discard")
    assert clean.session_present is False
    assert clean.quiet(1.0) == []  # neither the stored subscription nor its offline messages
    assert cluster.client.subscriptions("e2e-discard") == {}
    assert not cluster.client.read_position("e2e-discard", "e2e/pubsub/discard/#").found
    publisher.publish("e2e/pubsub/discard/dev", "not-subscribed")
    assert clean.quiet(1.0) == []
    clean.close()
    persistent = connect("e2e-discard", clean_session=False)
    assert persistent.session_present is False
    assert persistent.quiet(1.0) == []


def test_queue_acknowledged_message_is_gone_for_everyone(cluster: Cluster, connect: Callable[..., Mqtt]) -> None:
    reader_b = connect("e2e-queue-b", clean_session=False)
    reader_b.subscribe("e2e/queue/#")
    reader_b.close()  # subscribed, now offline
    reader_a = connect("e2e-queue-a", clean_session=False)
    reader_a.subscribe("e2e/queue/#")
    publisher = connect("e2e-queue-pub")
    for i in range(3):
        publisher.publish("e2e/queue/jobs", f"job-{i}")
    assert payloads(reader_a.take(3)) == ["job-0", "job-1", "job-2"]
    # a's PUBACKs removed them from the queue (in mqds, for every reader).
    wait_until(
        "the queue emptied by a's acknowledgements",
        lambda: cluster.client.fetch_offline("e2e-queue-b", "e2e/queue/#", mode="queue") == [],
        10,
    )
    reader_b = connect("e2e-queue-b", clean_session=False)
    assert reader_b.quiet(1.5) == []
    reader_a.close()
    reader_a = connect("e2e-queue-a", clean_session=False)
    assert reader_a.quiet(1.0) == []


def test_pubsub_every_subscriber_gets_every_message(cluster: Cluster, connect: Callable[..., Mqtt]) -> None:
    reader_b = connect("e2e-pubsub-b", clean_session=False)
    reader_b.subscribe("e2e/pubsub/#")
    reader_b.close()
    reader_a = connect("e2e-pubsub-a", clean_session=False)
    reader_a.subscribe("e2e/pubsub/#")
    publisher = connect("e2e-pubsub-pub")
    for i in range(3):
        publisher.publish("e2e/pubsub/news", f"news-{i}")
    assert payloads(reader_a.take(3)) == ["news-0", "news-1", "news-2"]
    reader_b = connect("e2e-pubsub-b", clean_session=False)  # offline meanwhile: its own read position
    assert payloads(reader_b.take(3)) == ["news-0", "news-1", "news-2"]
    assert reader_b.quiet(1.0) == []


def test_will_message_is_stored_and_reaches_persistent_subscribers(
    cluster: Cluster, connect: Callable[..., Mqtt]
) -> None:
    watcher = connect("e2e-will-watch", clean_session=False)
    watcher.subscribe("e2e/will/#")
    device = connect("e2e-will-dev", will=("e2e/will/dev", b"gone"))
    device.publish("e2e/will/dev", b"alive")
    assert watcher.take(1) == [("e2e/will/dev", b"alive", 1, False)]
    device.drop()  # no DISCONNECT: amqtt sends the will, which has no message event of its own
    assert watcher.take(1) == [("e2e/will/dev", b"gone", 1, False)]
    wait_until(
        "the will message stored",
        lambda: [m.payload for m in cluster.client.replay("e2e/will/#")] == [b"alive", b"gone"],
        10,
    )
    watcher.close()
    wait_until(
        "e2e-will-watch's acknowledgements recorded",
        lambda: cluster.client.fetch_offline("e2e-will-watch", "e2e/will/#") == [],
        10,
    )
    assert connect("e2e-will-watch", clean_session=False).quiet(1.0) == []


def test_retained_message_from_the_history_comes_once_with_its_flag(
    cluster: Cluster, connect: Callable[..., Mqtt]
) -> None:
    # e2e/retfetch/# has an offline fetch: the stored copies of retained publishes are in the history too.
    publisher = connect("e2e-retfetch-pub")
    publisher.publish("e2e/retfetch/lamp", b"on", retain=True)
    wait_until("the retained message in mqds", lambda: cluster.client.retained("e2e/retfetch/lamp"), 10)
    for clientid, clean in (("e2e-retfetch-sub-1", True), ("e2e-retfetch-sub-2", False)):
        subscriber = connect(clientid, clean_session=clean)
        subscriber.subscribe("e2e/retfetch/#")
        assert subscriber.take(1) == [("e2e/retfetch/lamp", b"on", 1, True)], clientid
        assert subscriber.quiet(1.0) == [], clientid

    publisher.publish("e2e/retfetch/lamp", b"", retain=True)  # deletes it
    wait_until("the retained message deleted", lambda: cluster.client.retained("e2e/retfetch/lamp") == [], 10)
    late = connect("e2e-retfetch-sub-3")
    late.subscribe("e2e/retfetch/#")
    assert late.quiet(1.5) == []  # neither the old value nor the empty delete marker


def test_a_resumed_session_gets_its_retained_messages_once_not_at_each_reconnect(
    cluster: Cluster, connect: Callable[..., Mqtt]
) -> None:
    # MQTT sends a retained message when a subscription is made, not when a session resumes (before, the
    # plugin sent it again at every reconnect). One filter without an offline fetch, one with.
    topics = ("e2e/retained/resume", "e2e/retfetch/resume")
    publisher = connect("e2e-resume-ret-pub")
    for topic in topics:
        publisher.publish(topic, b"on", retain=True)
        wait_until(f"{topic} retained in mqds", lambda t=topic: cluster.client.retained(t), 10)
    subscriber = connect("e2e-resume-ret-sub", clean_session=False)
    for topic in topics:
        assert subscriber.subscribe(topic) == 1
    assert sorted(subscriber.take(2)) == [(topic, b"on", 1, True) for topic in topics]
    subscriber.close()
    for attempt in range(1, 4):
        again = connect("e2e-resume-ret-sub", clean_session=False)
        assert again.session_present is True
        assert again.quiet(1.5) == [], f"reconnect {attempt}: the retained messages came again"
        again.close()
    # A SUBSCRIBE on the resumed session makes the subscription again: then the retained message comes.
    last = connect("e2e-resume-ret-sub", clean_session=False)
    last.subscribe(topics[0])
    assert last.take(1) == [(topics[0], b"on", 1, True)]
    assert last.quiet(1.0) == []
    for topic in topics:  # leave no retained message for the module's other subscribers
        publisher.publish(topic, b"", retain=True)
        wait_until(f"{topic} no longer retained", lambda t=topic: cluster.client.retained(t) == [], 10)


@pytest.mark.parametrize(
    ("clean", "base"),
    [(True, "e2e/retained/race-clean"), (False, "e2e/retained/race-kept"), (False, "e2e/retfetch/race-kept")],
    ids=["clean", "persistent", "persistent-with-fetch"],
)
def test_a_retained_publish_right_after_suback_comes_once_as_a_live_message(
    cluster: Cluster, connect: Callable[..., Mqtt], clean: bool, base: str
) -> None:
    # Published after the subscription was made, it is a live message: once, without the retained flag.
    # Before, a clean subscriber got it twice (live, then from the retained lookup that ran after SUBACK),
    # and a persistent one twice, or only at its next reconnect.
    publisher = connect(f"e2e-race-pub-{clean}-{base[4:7]}")
    for attempt in range(3):
        topic, clientid = f"{base}/{attempt}", f"e2e-race-{base.replace('/', '-')}-{attempt}"
        subscriber = connect(clientid, clean_session=clean)
        assert subscriber.subscribe(topic) == 1
        publisher.publish(topic, b"v", retain=True)
        assert subscriber.take(1) == [(topic, b"v", 1, False)], f"attempt {attempt}"
        assert subscriber.quiet(1.5) == [], f"attempt {attempt}: it came again"
        subscriber.close()
        if not clean:
            again = connect(clientid, clean_session=False)
            assert again.quiet(1.0) == [], f"attempt {attempt}: it came again at the reconnect"
            again.close()
        publisher.publish(topic, b"", retain=True)  # leave no retained message behind
        wait_until(f"{topic} no longer retained", lambda t=topic: cluster.client.retained(t) == [], 10)


def test_a_shared_subscription_is_served_once_and_a_malformed_one_refused(connect: Callable[..., Mqtt]) -> None:
    # Served by the cluster's share group (test_broker_shared.py has the members and the redelivery); amqtt
    # itself must not deliver it as well (it once granted $share/... as a plain filter, delivering at random).
    member = connect("e2e-share-member")
    assert member.subscribe("$share/g/e2e/share/#") == 1
    for malformed in ("$share/g", "$share//e2e/share/#", "$share/g/", "$queue/"):
        assert member.subscribe(malformed) == 0x80, malformed
    publisher = connect("e2e-share-pub")
    publisher.publish("e2e/share/a", b"x")
    assert member.take(1) == [("e2e/share/a", b"x", 1, False)]
    assert member.quiet(1) == []  # once: not also through amqtt


def test_mqds_pub_retain_makes_the_retained_message(cluster: Cluster, connect: Callable[..., Mqtt]) -> None:
    def pub(payload: str) -> str:
        done = subprocess.run(
            [MQDS, "pub", "e2e/retfetch/cli", "--retain", "-m", payload, "--endpoints", cluster.endpoints],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    assert "retained the last one on e2e/retfetch/cli" in pub("hello")
    assert [m.payload for m in cluster.client.retained("e2e/retfetch/cli")] == [b"hello"]
    first = connect("e2e-retcli-sub-1")
    first.subscribe("e2e/retfetch/cli")
    assert first.take(1) == [("e2e/retfetch/cli", b"hello", 1, True)]
    assert first.quiet(1.0) == []

    assert "deleted e2e/retfetch/cli's retained message" in pub("")
    assert cluster.client.retained("e2e/retfetch/cli") == []
    second = connect("e2e-retcli-sub-2")
    second.subscribe("e2e/retfetch/cli")
    assert second.quiet(1.5) == []


def test_session_present_after_broker_restart(
    cluster: Cluster, broker: BrokerProcess, connect: Callable[..., Mqtt]
) -> None:
    publisher = connect("e2e-resume-pub")
    publisher.publish("e2e/resume/lamp", b"on", retain=True)
    wait_until("the retained message in mqds", lambda: cluster.client.retained("e2e/resume/lamp"), 10)
    publisher.close()
    client = connect("e2e-resume", clean_session=False)
    assert client.session_present is False  # new
    client.subscribe("e2e/resume/#")
    assert client.take(1) == [("e2e/resume/lamp", b"on", 1, True)]
    client.close()
    broker.stop()
    broker.start()  # amqtt has no session in memory now; mqds has the client's subscriptions
    resumed = connect("e2e-resume", clean_session=False)
    assert resumed.session_present is True
    # Its subscription is restored from mqds, not made again: the retained message does not come again.
    assert resumed.quiet(1.5) == []
    resumed.close()
    clean = connect("e2e-resume", clean_session=True)
    assert clean.session_present is False
    clean.close()
    fresh = connect("e2e-resume-never", clean_session=False)
    assert fresh.session_present is False


def burst(device: Mqtt, topic: str, n: int) -> list[bytes]:
    """Publish ``n`` QoS 1 messages pipelined and wait for every PUBACK; the payloads sent."""
    sent = [device.client.publish(topic, str(i), qos=1) for i in range(n)]
    for info in sent:
        info.wait_for_publish(20)
    assert all(info.is_published() for info in sent), f"the broker did not acknowledge the whole burst on {topic}"
    return [str(i).encode() for i in range(n)]


def assert_stored(client: Client, topic_filter: str, expected: list[bytes], timeout_s: float = 20) -> None:
    """Wait until ``expected`` is what is stored under ``topic_filter``, in order; fail naming what is missing."""
    stored: list[bytes] = []

    def all_stored() -> bool:
        stored[:] = [m.payload for m in client.replay(topic_filter)]
        return len(stored) >= len(expected)

    with contextlib.suppress(TimeoutError):  # the comparison below names what is missing
        wait_until(f"{len(expected)} messages stored under {topic_filter}", all_stored, timeout_s)
    have = set(stored)
    missing = [p for p in expected if p not in have]
    assert stored == expected, f"{len(stored)} of {len(expected)} stored; missing {missing}"


def test_a_burst_acknowledged_right_before_disconnect_is_stored_whole(
    cluster: Cluster, connect: Callable[..., Mqtt]
) -> None:
    # amqtt PUBACKs a publish when it queues it in the session, and dropped what was still queued
    # when the connection ended; the plugin hands that on. Without it, about half of this was lost.
    device = connect("e2e-burst-dev", max_inflight=300)
    expected = burst(device, "e2e/burst/dev", 300)
    device.client.disconnect()  # DISCONNECT right after the last PUBACK
    assert_stored(cluster.client, "e2e/burst/#", expected)


def test_offline_subscriber_gets_everything_after_broker_restart_and_node_kill(
    cluster: Cluster, broker: BrokerProcess, connect: Callable[..., Mqtt]
) -> None:
    n = 60
    subscriber = connect("e2e-offline-sub", clean_session=False)
    subscriber.subscribe("e2e/offline/#", qos=1)
    subscriber.close()
    publisher = connect("e2e-offline-pub")
    for i in range(n):
        publisher.publish("e2e/offline/dev", str(i))
    publisher.close()
    # And one still connected at the stop, its last PUBACKs just received.
    expected_burst = burst(connect("e2e-stop-burst", max_inflight=300), "e2e/stopburst/dev", 300)

    stopped = broker.stop()  # the clean stop stores what amqtt acknowledged before it exits
    assert "mqds broker: stopped after" in stopped and "messages stored" in stopped, stopped
    assert re.search(r"\d+ offline fetches in \d+ shared calls", stopped), stopped  # the subscription fetched
    assert_stored(cluster.client, "e2e/stopburst/#", expected_burst, timeout_s=5)
    harness = cluster.harness()
    victim = harness.leader(shard_of("e2e-offline-pub", N_SHARDS))  # the leader holding the messages
    assert victim is not None
    harness.kill(victim)  # kill -9; the cluster fixture's teardown stops the rest
    broker.start()
    subscriber = connect("e2e-offline-sub", clean_session=False)  # subscribes to nothing: mqds restores it
    got = subscriber.take(n, timeout_s=30)
    assert payloads(got) == [str(i) for i in range(n)]
    assert {(topic, qos) for topic, _, qos, _ in got} == {("e2e/offline/dev", 1)}
    assert subscriber.quiet(1.0) == []

    # Its PUBACKs moved its read position: the next reconnect brings nothing again.
    subscriber.close()
    wait_until(
        "e2e-offline-sub's acknowledgements recorded",
        lambda: cluster.client.fetch_offline("e2e-offline-sub", "e2e/offline/#") == [],
        15,
    )
    again = connect("e2e-offline-sub", clean_session=False)
    assert again.quiet(1.5) == []
