"""The seeds' hook lines as written: docs/brokers.md quotes each seed's .conf lines, which load unchanged, and
deploy/hooks/ holds the same rules.

The lists below are the hook lines of the three seed documents (EMQX's DynamoDB, Cassandra and Redis
persistence backends), in their order; the tests read the docs' quoted blocks, so neither the docs nor the
files can drift from what loads.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT

from mqds.broker.hooks import HookConfig, HookConfigError, OfflineOpts, load_config, parse_seed_conf

MQDS = str(Path(sys.executable).with_name("mqds"))
DOCS = ROOT / "docs" / "brokers.md"
EXAMPLES = ROOT / "deploy" / "hooks"

Line = tuple[str, str | None, str]

SEEDS: dict[str, list[Line]] = {
    "dynamo": [
        ("client.connected", None, "on_client_connected"),
        ("session.created", None, "on_subscribe_lookup"),
        ("client.disconnected", None, "on_client_disconnected"),
        ("session.subscribed", "#", "on_message_fetch_for_queue"),
        ("session.subscribed", "#", "on_retain_lookup"),
        ("session.unsubscribed", "#", "on_acked_delete"),
        ("message.publish", "#", "on_message_publish"),
        ("message.publish", "#", "on_message_retain"),
        ("message.publish", "#", "on_retain_delete"),
        ("message.acked", "#", "on_message_acked_for_queue"),
    ],
    "cassa": [
        ("client.connected", None, "on_client_connected"),
        ("client.connected", None, "on_subscription_lookup"),
        ("client.disconnected", None, "on_client_disconnected"),
        ("session.subscribed", "#", "on_message_fetch"),
        ("session.subscribed", None, "on_retain_lookup"),
        ("message.publish", "#", "on_message_publish"),
        # backend.cassa.hook.session.unsubscribed.1 is raw CQL: accepted and ignored from the .conf
        ("message.publish", "#", "on_message_retain"),
        ("message.publish", "#", "on_retain_delete"),
        ("message.acked", "#", "on_message_acked"),
    ],
    "redis": [
        ("client.connected", None, "on_client_connected"),
        ("client.disconnected", None, "on_client_disconnected"),
        ("client.connected", None, "on_subscribe_lookup"),
        ("message.publish", "#", "on_message_publish"),
        ("session.subscribed", "queue/#", "on_message_fetch_for_queue"),
        ("session.subscribed", "pubsub/#", "on_message_fetch_for_pubsub"),
        ("message.publish", "#", "on_message_retain"),
        ("message.publish", "#", "on_retain_delete"),
    ],
}
"""Each seed document's active hook lines: (hook, topic, function), in the document's order."""

FILES = {"dynamo": "dynamodb-style.toml", "cassa": "cassandra-style.yaml", "redis": "redis-style.toml"}

# The Cassandra seed's CQL unsubscribe line ("delete from acked where clientid = ${clientid} and topic =
# ${topic}") is on_acked_delete in the translated file, at its place in the seed's order.
TRANSLATED_CQL: dict[str, tuple[int, Line]] = {"cassa": (6, ("session.unsubscribed", "#", "on_acked_delete"))}

SETTINGS: dict[str, list[str]] = {
    "dynamo": [
        "backend.dynamo.region",
        "backend.dynamo.pool1.server",
        "backend.dynamo.pool1.pool_size",
        "backend.dynamo.pool1.aws_access_key_id",
        "backend.dynamo.pool1.aws_secret_access_key",
    ],
    "cassa": [
        "backend.ecql.pool1.nodes",
        "backend.ecql.pool1.size",
        "backend.ecql.pool1.auto_reconnect",
        "backend.ecql.pool1.username",
        "backend.ecql.pool1.password",
        "backend.ecql.pool1.keyspace",
        "backend.ecql.pool1.logger",
    ],
    "redis": ["backend.redis.pool1.server"],
}
"""The connection settings each seed sets: accepted and ignored."""


def quoted_blocks() -> dict[str, str]:
    """docs/brokers.md's ```conf blocks, by the backend their hook lines name."""
    blocks: dict[str, str] = {}
    for block in re.findall(r"^```conf\n(.*?)^```", DOCS.read_text(encoding="utf-8"), re.S | re.M):
        names = set(re.findall(r"^#*\s*backend\.([a-z]+)\.hook\.", block, re.M))
        assert len(names) == 1, f"a quoted block with the hook lines of {names or 'no backend'}"
        (name,) = names
        assert name not in blocks, f"two quoted blocks of {name}"
        blocks[name] = block
    assert set(blocks) == set(SEEDS), f"docs/brokers.md quotes the seeds {sorted(blocks)}"
    return blocks


def lines_of(config: HookConfig) -> list[Line]:
    return [(rule.hook, rule.topic, rule.action) for rule in config.rules]


@pytest.mark.parametrize("db", sorted(SEEDS))
def test_the_seed_lines_quoted_in_the_docs_load_unchanged(db: str, tmp_path: Path) -> None:
    block = quoted_blocks()[db]
    conf = tmp_path / f"emqx_backend_{db}.conf"
    conf.write_text(block, encoding="utf-8")
    config = load_config(conf)
    assert lines_of(config) == SEEDS[db]
    # What mqds has no use for is a note, one each: the connection settings (by key, never by value), each
    # rule's pool, the raw CQL line.
    for key in SETTINGS[db]:
        assert sum(f": {key} accepted and ignored: mqds is the store" in note for note in config.notes) == 1, key
    pools = [note for note in config.notes if "pool 'pool1' accepted and ignored" in note]
    assert len(pools) == len(SEEDS[db])
    cql = [note for note in config.notes if "raw CQL action accepted and ignored" in note]
    assert len(cql) == (1 if db == "cassa" else 0)
    assert len(config.notes) == len(SETTINGS[db]) + len(pools) + len(cql)
    values = re.findall(r"^backend\.[a-z]+\.(?:pool1\.)?[a-z_]+\s*=\s*(\S+)$", block, re.M)
    values = [v for v in values if len(v) > 3]  # "8" is in "line 8"
    assert values and not [v for v in values if any(v in note for note in config.notes)], "a setting's value"
    # The seeds set no offline options (the Cassandra seed comments its two out): any age, page by page.
    assert all(rule.offline_opts == OfflineOpts() for rule in config.rules if rule.kind == "fetch")


@pytest.mark.parametrize("db", sorted(SEEDS))
def test_the_shipped_file_holds_the_seeds_rules(db: str) -> None:
    expected = list(SEEDS[db])
    if db in TRANSLATED_CQL:
        at, line = TRANSLATED_CQL[db]
        expected.insert(at, line)
    config = load_config(EXAMPLES / FILES[db])
    assert lines_of(config) == expected
    assert config.notes == ()
    assert all(rule.offline_opts == OfflineOpts() for rule in config.rules if rule.kind == "fetch")
    # What a seed comments out is commented out: no QoS 0 store, so QoS 0 messages are not fetched offline.
    assert not config.stores_qos0
    text = (EXAMPLES / FILES[db]).read_text(encoding="utf-8")
    # Every rule is attributed to the seed's line it translates, and no seed line is claimed twice.
    claimed = [
        found.group(1)
        for line in text.splitlines()
        if (found := re.match(rf"\s*# (backend\.{db}\.hook\.[a-z_.]+\.\d+)", line))
        and "commented out in the seed" not in line
    ]
    quoted = re.findall(rf"^(backend\.{db}\.hook\.[a-z_.]+\.\d+)\s*=", quoted_blocks()[db], re.M)
    active = [key for key in claimed if key in quoted]
    assert sorted(set(active)) == sorted(quoted) and len(active) == len(set(active)), (active, quoted)


def test_the_seeds_own_offline_options_load(tmp_path: Path) -> None:
    """The Cassandra seed's commented options, uncommented, are the fetch rules' defaults; its commented
    subscribed.1 line with offline_opts, uncommented instead of the active one, sets the rule's own."""
    block = quoted_blocks()["cassa"]
    options = block.replace("## backend.cassa.max_returned_count = 500", "backend.cassa.max_returned_count = 500")
    options = options.replace("## backend.cassa.time_range = 2h", "backend.cassa.time_range = 2h")
    fetch = parse_seed_conf(options, "cassa.conf").fetch_rule("a/b")
    assert fetch is not None and fetch.offline_opts == OfflineOpts(max_returned_count=500, time_range_s=7200.0)
    unlimited = block.replace(
        "## backend.cassa.max_returned_count = 500", "backend.cassa.max_returned_count = infinity"
    )
    fetch = parse_seed_conf(unlimited, "cassa.conf").fetch_rule("a/b")
    assert fetch is not None and fetch.offline_opts is not None and fetch.offline_opts.max_returned_count is None
    active = 'backend.cassa.hook.session.subscribed.1  = {"topic": "#", "action": {"function": "on_message_fetch"}, '
    with_opts = "\n".join(
        line[3:] if line.startswith("## backend.cassa.hook.session.subscribed.1") else line
        for line in block.splitlines()
        if not line.startswith(active)
    )
    fetch = parse_seed_conf(with_opts, "cassa.conf").fetch_rule("a/b")
    assert fetch is not None and fetch.offline_opts == OfflineOpts(max_returned_count=500, time_range_s=7200.0)


BAD_CONF: list[tuple[str, str]] = [
    ("backend.redis.pool1.sever = 127.0.0.1:6379", r"line 1: unknown key 'backend\.redis\.pool1\.sever'; a seed's"),
    ("backend.redis.max_count = 5", r"line 1: unknown key 'backend\.redis\.max_count'"),
    ("node.name = emqx@127.0.0.1", r"line 1: unknown key 'node\.name'"),
    ("backend.redis.hook.message.publish.1", r"line 1: expected KEY = VALUE"),
    ('backend.redis.hook.message.publish.1 = {"topic": "#", action}', r"line 1 \(backend\.redis\.hook\.message"),
    ("backend.redis.hook.message.publish.1 = [1]", "the value must be a JSON object"),
    (
        'backend.redis.hook.message.publish.1 = {"topic": "#", "action": {"function": "on_message_publish"}, '
        '"poll": "pool1"}',
        r"unknown key 'poll'; a hook line has topic, action, pool, offline_opts",
    ),
    (
        'backend.pgsql.hook.message.publish.1 = {"action": {"sql": ["insert into msg values (${topic})"]}}',
        r"line 1 \(backend\.pgsql\.hook\.message\.publish\.1\) \(hook 'message\.publish'\): action must be a name",
    ),
    (
        'backend.redis.hook.message.dropped.1 = {"action": {"function": "on_message_publish"}}',
        r"line 1 \(backend\.redis\.hook\.message\.dropped\.1\): 'message\.dropped' has no persistence actions",
    ),
    (
        'backend.redis.hook.message.acked.1 = {"action": {"function": "on_message_fetch"}}',
        r"on_message_fetch does not run on message\.acked",
    ),
    (
        'backend.redis.hook.client.connected.1 = {"action": {"function": "on_client_connected"}}\n'
        'backend.redis.hook.client.connected.1 = {"action": {"function": "on_client_connected"}}',
        r"line 2: backend\.redis\.hook\.client\.connected\.1 is given twice \(first on line 1\)",
    ),
    ("backend.cassa.max_returned_count = 0", r"max_returned_count must be a whole number above 0"),
    ("backend.cassa.time_range = 2hours", r"offline_opts\.time_range: '2hours' is not a duration"),
]


@pytest.mark.parametrize(("text", "expected"), BAD_CONF, ids=[expected[:40] for _, expected in BAD_CONF])
def test_conf_lines_no_seed_writes_are_refused_naming_the_line(text: str, expected: str, tmp_path: Path) -> None:
    conf = tmp_path / "emqx_backend.conf"
    hook = 'backend.redis.hook.client.connected.9 = {"action": {"function": "on_client_connected"}}\n'
    conf.write_text(text + "\n" + (hook if "hook" not in text else ""), encoding="utf-8")
    with pytest.raises(HookConfigError, match=expected) as info:
        load_config(conf)
    assert str(info.value).startswith(f"{conf}: "), info.value


def test_mqds_exhook_prints_the_notes_of_a_seed_conf(tmp_path: Path) -> None:
    """`mqds exhook --config` reads a seed's .conf and prints its notes at start (here it then refuses an exposed
    listener, before it asks any cluster)."""
    conf = tmp_path / "emqx_backend_dynamo.conf"
    conf.write_text(quoted_blocks()["dynamo"], encoding="utf-8")
    done = subprocess.run(
        [MQDS, "exhook", "--config", str(conf), "--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "can be reached from other machines" in done.stderr, done.stderr
    notes = [line for line in done.stdout.splitlines() if line.startswith(f"mqds exhook: {conf}: line ")]
    assert len(notes) == len(SETTINGS["dynamo"]) + len(SEEDS["dynamo"]), done.stdout
    assert "YOUR_SECRET_ACCESS_KEY" not in done.stdout and "Traceback" not in done.stderr
