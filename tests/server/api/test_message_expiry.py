"""MQTT 5 Message Expiry Interval of stored messages (issue 47), on a real 3-node cluster.

A stored message with ``message_expiry_s`` is handed out by offline fetches
(``FetchMessages``, ``FetchMessagesShared``) and push subscriptions
(``Follow``) only until that long after it was stored, and with what is left
of its interval (whole seconds, rounded up), as MQTT 5 wants a server to
forward it. Replay reads it as stored, original interval and all, until the
shard leader's expiry steps removed it from every replica (docs/client.md,
"Message expiry").
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest

from mqds.client import Client, Message, Subscription
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.waiting import wait_until

pytestmark = pytest.mark.integration

N_SHARDS = 4
SHORT_S = 1
LONG_S = 600


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("message-expiry") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        yield c


def store_mix(c: Client, prefix: str) -> tuple[list[Message], list[Message], list[Message]]:
    """Messages of eight senders (so every shard holds some): with a 1 s interval, with a long one, with none.

    Interleaved, so an expired message sits between ones that are returned. Returns the three kinds as stored.
    """
    messages = []
    for i in range(24):
        expiry = (SHORT_S, LONG_S, 0)[i % 3]
        messages.append(
            Message(
                topic=f"{prefix}/{i % 8}",
                payload=str(i).encode(),
                sender=f"{prefix}-{i % 8}",
                qos=1,
                message_expiry_s=expiry,
            )
        )
    stored = c.store_batch(messages)
    kinds = ([m for m in stored if m.message_expiry_s == e] for e in (SHORT_S, LONG_S, 0))
    short, long, none = kinds
    return short, long, none


def wait_past(messages: list[Message], interval_s: int) -> None:
    """Sleep until every one of ``messages`` is more than ``interval_s`` old (a bounded wait: about a second)."""
    newest = max(m.timestamp_us or 0 for m in messages) / 1e6
    time.sleep(max(0.0, newest + interval_s - time.time()) + 0.3)


def payload_set(messages: list[Message]) -> set[bytes]:
    return {m.payload for m in messages}


def check_remaining(got: list[Message], long: list[Message]) -> None:
    """Each long-lived message carries what is left of its interval (rounded up), not the original; the
    others carry none. Called more than a second after they were stored (``wait_past``)."""
    by_payload = {m.payload: m for m in long}
    for m in got:
        original = by_payload.get(m.payload)
        if original is None:
            assert m.message_expiry_s == 0, m
            continue
        age_s = time.time() - (original.timestamp_us or 0) / 1e6
        # Sent before this line, more than a second after the message was stored: at least what is left now,
        # at most the interval less that second.
        assert math.ceil(LONG_S - age_s) <= m.message_expiry_s <= LONG_S - SHORT_S, (m, age_s)


def test_offline_fetches_leave_out_expired_messages_and_send_what_is_left_of_the_others(
    cluster: LocalCluster,
) -> None:
    with Client(cluster.addresses, timeout_s=30) as c:
        short, long, none = store_mix(c, "mx/fetch")
        wait_past(short + long, SHORT_S)  # old enough that the long ones' remaining interval is below the original
        wanted = payload_set(long + none)
        got = c.fetch_offline("mx-fetch", "mx/fetch/#", max_count=100)  # Sessions.FetchMessages
        assert payload_set(got) == wanted
        check_remaining(got, long)
        # A queue fetch and a shared fetch of many sessions (what the brokers use) read the same way.
        queue = c.fetch_offline("mx-fetch-q", "mx/fetch/#", mode="queue", max_count=100)
        assert payload_set(queue) == wanted
        shared = c.fetch_offline_many(
            [("mx-fetch-a", "mx/fetch/#"), ("mx-fetch-b", "mx/fetch/+/"), ("mx-fetch-c", "mx/fetch/3")], max_count=100
        )  # Sessions.FetchMessagesShared
        assert payload_set(shared[0]) == wanted
        assert shared[1] == []
        assert payload_set(shared[2]) == {m.payload for m in long + none if m.topic == "mx/fetch/3"}
        check_remaining(shared[0], long)
        # max_count counts what is returned: an expired message takes no place in the page.
        page = c.fetch_offline("mx-fetch-page", "mx/fetch/#", max_count=len(wanted))
        assert payload_set(page) == wanted


def take_until_quiet(sub: Subscription, count: int, timeout_s: float = 30) -> list[Message]:
    """What ``sub`` pushes until it brought ``count`` messages and then nothing for a second (bounded)."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout_s
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        batch = sub.poll(0.2)
        if batch is not None and batch.messages:
            got += batch.messages
            quiet_since = None
        elif len(got) >= count:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= 1.0:
                return got
    raise AssertionError(f"{len(got)} of {count} messages came, or more kept coming, in {timeout_s}s")


def test_push_subscriptions_leave_out_expired_messages_and_send_what_is_left_of_the_others(
    cluster: LocalCluster,
) -> None:
    with Client(cluster.addresses, timeout_s=30) as c:
        short, long, none = store_mix(c, "mx/follow")
        wait_past(short + long, SHORT_S)
        wanted = payload_set(long + none)
        # From the start: read from disk (the catch-up reads), by two subscribers that share them.
        subs = [c.follow("mx/follow/#", start_time_us=0) for _ in range(2)]
        try:
            for sub in subs:
                got = take_until_quiet(sub, len(wanted))
                assert payload_set(got) == wanted and len(got) == len(wanted)
                check_remaining(got, long)
        finally:
            for sub in subs:
                sub.close()


def test_expired_messages_are_removed_from_every_replica_by_the_leaders_expiry_steps(cluster: LocalCluster) -> None:
    """Replay reads what is stored: once the expiry steps ran (logged by each shard's leader within a maintenance
    round, a second by default), the expired messages are gone from it, and every replica holds the same."""
    with Client(cluster.addresses, timeout_s=30) as c:
        short, long, none = store_mix(c, "mx/removal")
        wait_past(short, SHORT_S)
        wanted = payload_set(long + none)
        wait_until(
            "the expired messages removed",
            lambda: payload_set(list(c.replay("mx/removal/#"))) == wanted,
            30,
        )
    # The leaders' own replicas and the followers alike: the steps are logged commands.
    cluster.assert_replicas_identical()


def test_pipelined_stores_keep_the_interval(cluster: LocalCluster) -> None:
    """``publish`` (pipelined stores, what ``mqds broker`` and ``mqds exhook`` store through) sends the interval
    too: a message stored so with a short one expires like one stored with ``store_batch``."""
    with Client(cluster.addresses, timeout_s=30) as c:
        stored = c.publish(
            [
                Message(topic="mx/pipelined/a", payload=b"short", sender="mx-p", qos=1, message_expiry_s=SHORT_S),
                Message(topic="mx/pipelined/a", payload=b"long", sender="mx-p", qos=1, message_expiry_s=LONG_S),
            ]
        )
        assert [m.message_expiry_s for m in stored] == [SHORT_S, LONG_S]
        wait_past(stored, SHORT_S)
        got = c.fetch_offline("mx-pipelined", "mx/pipelined/#")
        assert [m.payload for m in got] == [b"long"]
        check_remaining(got, [m for m in stored if m.payload == b"long"])
