"""Hook configurations: the format, the seed examples in deploy/hooks/, and every refusal naming file and rule."""

from __future__ import annotations

import doctest
from pathlib import Path
from typing import Any

import pytest
from hook_files import write_with_mqds_additions
from repo_paths import ROOT

from mqds.broker import hooks, seedconf, subscriptions
from mqds.broker.actions import BrokerHooks, real_filter
from mqds.broker.hooks import ACTIONS, HOOKS, HookConfigError, OfflineOpts, load_config, parse_config, parse_duration
from mqds.client import aio

EXAMPLES = ROOT / "deploy" / "hooks"

TOML = """
node = "broker-1"
keep_qos0 = true
offline_opts = { max_returned_count = 50, time_range = "30m" }

[[rule]]
hook = "message.publish"
topic = "#"
action = "on_message_publish"

[[rule]]
hook = "session.subscribed"
topic = "queue/#"
action = "on_message_fetch_for_queue"
offline_opts = { max_returned_count = 7 }

[[rule]]
hook = "session.subscribed"
action = { function = "on_message_fetch" }

[[rule]]
hook = "client.connected"
action = "on_subscription_lookup"
"""

YAML = """
node: broker-1
keep_qos0: true
offline_opts: {max_returned_count: 50, time_range: 30m}
rules:
  - hook: message.publish
    topic: "#"
    action: on_message_publish
  - hook: session.subscribed
    topic: queue/#
    action: on_message_fetch_for_queue
    offline_opts: {max_returned_count: 7}
  - hook: session.subscribed
    action: {function: on_message_fetch}
  - hook: client.connected
    action: on_subscription_lookup
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def rule(**fields: Any) -> dict[str, Any]:
    return {"rule": [fields]}


def test_toml_and_yaml_give_the_same_configuration(tmp_path: Path) -> None:
    from_toml = load_config(write(tmp_path, "hooks.toml", TOML))
    from_yaml = load_config(write(tmp_path, "hooks.yml", YAML))
    assert from_toml.rules == from_yaml.rules
    config = from_toml
    assert config.node == "broker-1" and config.keep_qos0 is True
    assert config.source.endswith("hooks.toml")
    assert [r.number for r in config.rules] == [1, 2, 3, 4]
    publish, queue, pubsub, lookup = config.rules
    assert (publish.kind, publish.offline_opts) == ("store", None)
    # A rule's own offline_opts override the file's defaults key by key.
    assert queue.offline_opts == OfflineOpts(max_returned_count=7, time_range_s=1800.0)
    assert pubsub.action == "on_message_fetch" and pubsub.mode == "pubsub"
    assert pubsub.offline_opts == OfflineOpts(max_returned_count=50, time_range_s=1800.0)
    assert lookup.kind == "subscription_lookup"
    assert config.stores_qos0  # keep_qos0 with a store rule
    assert config.hooks == ["client.connected", "session.subscribed", "message.publish"]


def test_rules_apply_by_topic_and_subscriptions_match_as_topics() -> None:
    config = parse_config(
        {
            "rule": [
                {"hook": "session.subscribed", "topic": "queue/#", "action": "on_message_fetch_for_queue"},
                {"hook": "session.subscribed", "topic": "#", "action": "on_message_fetch"},
                {"hook": "session.subscribed", "action": "on_retain_lookup"},
                {"hook": "message.publish", "topic": "sensor/+/temp", "action": "on_message_publish"},
                {"hook": "message.publish", "topic": "alarm/#", "action": "on_message_store"},
            ]
        }
    )
    names = [r.action for r in config.rules_for("session.subscribed", "queue/a/+")]
    assert names == ["on_message_fetch_for_queue", "on_message_fetch", "on_retain_lookup"]
    # The first fetch rule in file order decides a subscription's mode.
    fetch_queue = config.fetch_rule("queue/a/+")
    fetch_other = config.fetch_rule("pubsub/x")
    assert fetch_queue is not None and fetch_queue.mode == "queue"
    assert fetch_other is not None and fetch_other.mode == "pubsub"
    # A filter starting with a wildcard does not match $-topics; a rule without topic applies to all.
    assert [r.action for r in config.rules_for("session.subscribed", "$SYS/#")] == ["on_retain_lookup"]
    assert [r.action for r in config.rules_for("message.publish", "sensor/1/temp")] == ["on_message_publish"]
    assert config.rules_for("message.publish", "sensor/1/hum") == []
    assert config.topics_for("message.publish") == ["sensor/+/temp", "alarm/#"]
    assert config.topics_for("session.subscribed") == []  # a rule without topic: every topic
    assert config.stores_qos0  # on_message_store keeps QoS 0
    assert not parse_config(rule(hook="message.publish", action="on_message_publish")).stores_qos0


@pytest.mark.parametrize(("action", "hook"), [(a, h) for a, spec in ACTIONS.items() for h in sorted(spec.hooks)])
def test_every_action_loads_on_each_of_its_hooks(action: str, hook: str) -> None:
    config = parse_config(rule(hook=hook, action=action))
    assert config.rules[0].action == action and config.rules[0].hook in HOOKS


def test_the_seed_actions_are_all_supported() -> None:
    seeds = {
        "on_client_connected",
        "on_client_disconnected",
        "on_subscribe_lookup",
        "on_subscription_lookup",
        "on_message_publish",
        "on_message_store",
        "on_message_retain",
        "on_retain_delete",
        "on_retain_lookup",
        "on_message_fetch",
        "on_message_fetch_for_pubsub",
        "on_message_fetch_for_queue",
        "on_message_acked",
        "on_message_acked_for_pubsub",
        "on_message_acked_for_queue",
        "on_acked_delete",
    }
    assert seeds <= set(ACTIONS)


def test_redis_style_example(tmp_path: Path) -> None:
    config = load_config(EXAMPLES / "redis-style.toml")
    queue, pubsub = config.fetch_rule("queue/jobs"), config.fetch_rule("pubsub/news/#")
    assert queue is not None and queue.mode == "queue"
    assert pubsub is not None and pubsub.mode == "pubsub"
    assert config.fetch_rule("other/topic") is None
    # The Redis guide lists no acknowledgement, unsubscribe or retained-lookup line: neither does the file.
    assert config.hooks == ["client.connected", "client.disconnected", "session.subscribed", "message.publish"]
    assert [r.action for r in config.rules_for("client.connected")] == ["on_client_connected", "on_subscribe_lookup"]
    assert not config.stores_qos0
    # Its mqds additions, uncommented, acknowledge in each fetch rule's mode.
    added = load_config(write_with_mqds_additions(EXAMPLES / "redis-style.toml", tmp_path))
    assert added.rules[: len(config.rules)] == config.rules
    acked = {r.topic: r.mode for r in added.rules if r.hook == "message.acked"}
    assert acked == {"queue/#": "queue", "pubsub/#": "pubsub"}


def test_cassandra_style_example() -> None:
    config = load_config(EXAMPLES / "cassandra-style.yaml")
    fetch = config.fetch_rule("a/b")
    assert fetch is not None and fetch.action == "on_message_fetch" and fetch.mode == "pubsub"
    # The seed comments its max_returned_count and time_range out: any age, page by page.
    assert fetch.offline_opts == OfflineOpts()
    assert fetch.offline_opts.time_range_s is None
    assert "on_subscription_lookup" in [r.action for r in config.rules_for("client.connected")]
    assert {r.action for r in config.rules_for("message.publish", "x")} == {
        "on_message_publish",
        "on_message_retain",
        "on_retain_delete",
    }
    assert [r.mode for r in config.rules_for("message.acked", "x")] == ["pubsub"]
    # The seed's CQL unsubscribe line deletes the acked record: on_acked_delete.
    assert [r.action for r in config.rules_for("session.unsubscribed", "x")] == ["on_acked_delete"]


def test_dynamodb_style_example() -> None:
    config = load_config(EXAMPLES / "dynamodb-style.toml")
    assert [r.action for r in config.rules_for("session.created")] == ["on_subscribe_lookup"]
    assert config.rules_for("client.connected")[0].action == "on_client_connected"
    # The seed stores with on_message_publish (QoS 1/2) and leaves on_message_store commented out.
    assert [r.action for r in config.rules_for("message.publish", "x")] == [
        "on_message_publish",
        "on_message_retain",
        "on_retain_delete",
    ]
    assert not config.stores_qos0
    fetch = config.fetch_rule("anything")
    assert fetch is not None and fetch.mode == "queue" and fetch.offline_opts == OfflineOpts()
    assert [r.mode for r in config.rules_for("message.acked", "x")] == ["queue"]


def test_needed_hooks_add_what_acknowledgements_rely_on() -> None:
    # The dispatcher is built, never used: the client connects on its first call only.
    client = aio.Client(["127.0.0.1:1"])
    acks_only = parse_config(rule(hook="message.acked", topic="pubsub/#", action="on_message_acked"))
    assert BrokerHooks(client, acks_only).needed_hooks() == {
        "client.disconnected": [],
        "session.subscribed": [],
        "session.unsubscribed": [],
        "message.acked": ["pubsub/#"],
    }
    delivered = parse_config(rule(hook="message.delivered", topic="q/#", action="on_message_delivered"))
    assert BrokerHooks(client, delivered).needed_hooks() == {
        "client.disconnected": [],
        "session.subscribed": [],
        "session.unsubscribed": [],
        "message.delivered": ["q/#"],
    }
    redis = BrokerHooks(client, load_config(EXAMPLES / "redis-style.toml"))
    needed = redis.needed_hooks()
    assert needed["message.publish"] == ["#"] and "message.acked" not in needed
    assert "session.created" not in needed and "session.unsubscribed" not in needed


def test_durations() -> None:
    assert parse_duration("2h") == 7200.0
    assert parse_duration("30m") == 1800.0
    assert parse_duration("1d") == 86400.0
    assert parse_duration("45s") == 45.0
    assert parse_duration("1h30m") == 5400.0
    assert parse_duration(90) == 90.0
    assert parse_duration("infinity") is None
    for bad in ("2x", "", "h", "0s", "-1h", "2 hours", True, None, [1]):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_shared_subscription_filters() -> None:
    assert real_filter("$share/g/a/+") == "a/+"
    assert real_filter("$queue/a/#") == "a/#"
    for bad in ("$share/g", "$share//a", "$queue/"):
        with pytest.raises(ValueError, match="invalid shared subscription"):
            real_filter(bad)


@pytest.mark.parametrize("module", [hooks, seedconf, subscriptions], ids=lambda m: m.__name__)
def test_doctests_pass(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# -- refusals: each names the file, the rule and what is wrong ------------------------------------------

PUBLISH = {"hook": "message.publish", "action": "on_message_publish"}


def fetch_with(offline_opts: object) -> dict[str, Any]:
    return {"hook": "session.subscribed", "action": "on_message_fetch", "offline_opts": offline_opts}


BAD_RULES: list[tuple[dict[str, Any], str]] = [
    (
        {"hook": "client.connectd", "action": "on_client_connected"},
        r"'client\.connectd' is not a hook \(did you mean 'client\.connected'\?\)",
    ),
    ({"hook": "message.dropped", "action": "on_message_publish"}, r"'message\.dropped' has no persistence actions"),
    (
        {"hook": "message.delivered", "action": "on_message_acked"},
        "on_message_acked does not run on message.delivered; it runs on message.acked. Actions of message.delivered: "
        "on_message_delivered",
    ),
    ({"action": "on_message_publish"}, "hook is missing"),
    ({"hook": "message.publish"}, "action is missing; actions of message.publish: on_message_publish"),
    (
        {"hook": "message.publish", "action": "on_message_pubish"},
        r"unknown action 'on_message_pubish' \(did you mean 'on_message_publish'\?\)",
    ),
    (
        {"hook": "message.publish", "action": {"function": "on_message_publish", "pool": "pool1"}},
        "action must be a name or",
    ),
    ({"hook": "message.publish", "action": 3}, "action must be an action name"),
    (
        {"hook": "client.connected", "action": "on_message_publish"},
        "on_message_publish does not run on client.connected; it runs on message.publish",
    ),
    (
        {"hook": "session.subscribed", "action": "on_message_acked"},
        "on_message_acked does not run on session.subscribed",
    ),
    (
        {"hook": "message.publish", "topic": "a/#/b", "action": "on_message_publish"},
        "topic: invalid topic filter 'a/#/b'",
    ),
    ({"hook": "message.publish", "topic": "", "action": "on_message_publish"}, "topic: topic filter must not be empty"),
    ({"hook": "message.publish", "topic": "a/b+", "action": "on_message_publish"}, "must occupy the whole level"),
    ({"hook": "client.connected", "topic": "#", "action": "on_client_connected"}, "client.connected has no topic"),
    ({**PUBLISH, "offline_opts": {}}, "offline_opts is only for the fetch actions"),
    (fetch_with({"max_returned_count": 0}), 'max_returned_count must be a whole number above 0 or "infinity", not 0'),
    (fetch_with({"max_returned_count": -5}), '"infinity", not -5'),
    (fetch_with({"max_returned_count": "500"}), "\"infinity\", not '500'"),
    (fetch_with({"max_returned_count": True}), '"infinity", not True'),
    (fetch_with({"time_range": "2x"}), "time_range: '2x' is not a duration such as 45s"),
    (fetch_with({"time_range": "0s"}), "time range must be above 0"),
    (fetch_with({"time_range": "two hours"}), "is not a duration"),
    (fetch_with({"time_rnage": "2h"}), r"unknown offline_opts key 'time_rnage' \(did you mean 'time_range'\?\)"),
    (fetch_with({"include_qos0": "yes"}), "include_qos0 must be true or false"),
    (fetch_with(500), "offline_opts must be a table"),
    ({**PUBLISH, "pol": "pool1"}, r"unknown key 'pol' \(did you mean 'pool'\?\)"),
]


@pytest.mark.parametrize(("raw", "expected"), BAD_RULES, ids=[expected[:40] for _, expected in BAD_RULES])
def test_bad_rules_are_refused_with_file_and_rule(raw: dict[str, Any], expected: str) -> None:
    good = {"hook": "client.connected", "action": "on_client_connected"}
    with pytest.raises(HookConfigError, match=expected) as info:
        parse_config({"rule": [good, raw]}, "etc/hooks.toml")
    assert str(info.value).startswith("etc/hooks.toml: rule 2")


BAD_FILES: list[tuple[dict[str, Any] | list[Any], str]] = [
    ({}, "no rules: add"),
    ({"rule": []}, "no rules"),
    ({"rule": {"hook": "client.connected"}}, "rules must be a list"),
    ({"rule": ["client.connected"]}, "rule 1: a rule must be a table"),
    ({"rule": [{"hook": "client.connected", "action": "on_client_connected"}], "rules": []}, "not both"),
    ({"rules": [], "backend": "redis"}, "unknown key 'backend'"),
    ({"node": "", "rule": []}, "node must be a non-empty string"),
    ({"keep_qos0": "no", "rule": []}, "keep_qos0 must be true or false"),
    ({"offline_opts": {"max_returned_count": 0}, "rule": []}, "max_returned_count must be a whole number above 0"),
    ([{"hook": "client.connected"}], "expected a table"),
]


@pytest.mark.parametrize(("data", "expected"), BAD_FILES, ids=[expected for _, expected in BAD_FILES])
def test_bad_files_are_refused_with_the_file(data: Any, expected: str) -> None:
    with pytest.raises(HookConfigError, match=expected) as info:
        parse_config(data, "etc/hooks.yaml")
    assert str(info.value).startswith("etc/hooks.yaml: ")


def test_unreadable_files_are_refused(tmp_path: Path) -> None:
    cases = [
        (write(tmp_path, "hooks.json", "{}"), "unknown configuration format '.json'; use .toml, .yaml or .conf"),
        (tmp_path / "missing.toml", "cannot read: No such file or directory"),
        (write(tmp_path, "broken.toml", "[[rule]\nhook = 1"), "not valid TOML"),
        (write(tmp_path, "broken.yaml", "rules: [\n  - hook: a\n"), "not valid YAML"),
        (write(tmp_path, "list.yaml", "- hook: client.connected\n"), "expected a table"),
        (write(tmp_path, "empty.yaml", ""), "no rules"),
        (write(tmp_path, "bad-topic.yaml", YAML.replace("queue/#", "queue/#/x")), "rule 2 .*invalid topic filter"),
    ]
    for path, expected in cases:
        with pytest.raises(HookConfigError, match=expected) as info:
            load_config(path)
        assert str(info.value).startswith(f"{path}: "), info.value
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(HookConfigError, match="not UTF-8"):
        load_config(binary)


def test_the_seeds_pool_is_accepted_and_ignored_with_a_note() -> None:
    # The seeds' rules name a connection pool ("pool": "pool1"); a seed's line loads as written.
    config = parse_config({"rule": [{**PUBLISH, "topic": "#", "pool": "pool1"}]}, "etc/hooks.toml")
    assert [rule.action for rule in config.rules] == ["on_message_publish"]
    assert config.notes == (
        "etc/hooks.toml: rule 1: pool 'pool1' accepted and ignored: mqds has one connection to the cluster "
        "(the client's), not pools",
    )
    assert parse_config({"rule": [PUBLISH]}).notes == ()


def test_an_unlimited_count_reads_every_message_page_by_page() -> None:
    # The seeds' commented Cassandra line has no limit; "infinity" is the word for it, as for time_range.
    config = parse_config({"rule": [fetch_with({"max_returned_count": "infinity", "time_range": "infinity"})]})
    opts = config.rules[0].offline_opts
    assert opts is not None and opts.max_returned_count is None and opts.time_range_s is None
    assert opts.page == hooks.UNLIMITED_PAGE
    assert OfflineOpts(max_returned_count=25).page == 25
