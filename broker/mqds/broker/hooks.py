"""Broker persistence rules: which broker hook runs which mqds action, on which topics.

A broker integration (the EMQX ExHook provider, the amqtt plugin) calls
:class:`mqds.broker.actions.BrokerHooks` at its hook points; the rules loaded
here decide what each call does. The format follows the rules of EMQX's
Redis, Cassandra and DynamoDB persistence backends (``hook``, ``topic``,
``action``), so their configurations translate line by line; the
``deploy/hooks/`` examples are such translations.

A configuration file is TOML (``.toml``), YAML (``.yaml``/``.yml``, needs
PyYAML: ``pip install 'mqds-broker[cli]'``), or an EMQX backend's own lines
as its documentation writes them (``.conf``: :mod:`mqds.broker.seedconf`)::

    node = "broker-1"            # optional: the broker node recorded with online clients
    keep_qos0 = false            # store QoS 0 messages with on_message_publish too
    offline_opts = { max_returned_count = 500, time_range = "2h" }   # defaults of the fetch rules

    [[rule]]
    hook = "message.publish"
    topic = "#"
    action = "on_message_publish"

    [[rule]]
    hook = "session.subscribed"
    topic = "queue/#"
    action = "on_message_fetch_for_queue"
    offline_opts = { max_returned_count = 100 }

A rule applies when its ``topic`` filter matches the hook's topic: the
published or acknowledged message's topic, or, for ``session.subscribed`` and
``session.unsubscribed``, the subscription's filter read as a topic (rule
``queue/#`` applies to subscription ``queue/a/+``). A rule without ``topic``
applies to everything. ``action`` may also be written as the seed backends
write it, ``{ function = "on_message_publish" }``. Every mistake is reported
with the file and the rule's number, and the configuration is refused.

>>> config = parse_config({"rule": [{"hook": "message.publish", "topic": "#", "action": "on_message_publish"}]})
>>> [rule.action for rule in config.rules_for("message.publish", "sensor/1")]
['on_message_publish']
>>> parse_duration("1h30m")
5400.0
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mqds.broker.catalogue import ACTIONS, HOOKS, OTHER_BROKER_HOOKS, TOPIC_HOOKS, ActionSpec, Kind, Mode
from mqds.broker.seedconf import SeedConfError, read_seed_conf
from mqds.protocol.topics import TopicError, matches, validate_filter

# The catalogue's names are re-exported: ``mqds.broker.hooks.ACTIONS`` and ``HOOKS`` were here first.
__all__ = [
    "ACTIONS",
    "HOOKS",
    "ActionSpec",
    "HookConfig",
    "HookConfigError",
    "OfflineOpts",
    "Rule",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_seed_conf",
]

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d|w)")
_DURATION_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
DURATION_HELP = "a duration such as 45s, 30m, 2h, 1d or 1h30m (units s m h d w), a number of seconds, or infinity"


class HookConfigError(ValueError):
    """A hook configuration that cannot be used; the message names the file and the rule."""


def parse_duration(value: object) -> float | None:
    """Seconds of a ``time_range``: ``"2h"``, ``"1h30m"``, ``90`` (seconds); None for ``"infinity"``.

    Raises ValueError (saying what is accepted) for anything else, zero and
    negative durations included.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not {DURATION_HELP}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text == "infinity":
            return None
        if not text or _DURATION_PART.sub("", text) != "":
            raise ValueError(f"{value!r} is not {DURATION_HELP}")
        seconds = sum(float(n) * _DURATION_UNIT_S[unit] for n, unit in _DURATION_PART.findall(text))
    else:
        raise ValueError(f"{value!r} is not {DURATION_HELP}")
    if seconds <= 0:
        raise ValueError(f"{value!r}: a time range must be above 0 (or infinity for no limit)")
    return seconds


@dataclass(frozen=True)
class OfflineOpts:
    """How a fetch rule reads offline messages.

    ``max_returned_count``: at most this many per subscription at a time, the
    rest page by page (None: ``infinity``, no limit: pages of
    :data:`UNLIMITED_PAGE`); ``time_range_s``: only messages newer than that
    many seconds (None: any age); ``include_qos0``: QoS 0 messages too (None:
    when the configuration stores them, see :attr:`HookConfig.stores_qos0`).
    """

    max_returned_count: int | None = 500
    time_range_s: float | None = None
    include_qos0: bool | None = None

    @property
    def page(self) -> int:
        """How many messages one offline fetch asks for: the count, or a page of an unlimited one."""
        return UNLIMITED_PAGE if self.max_returned_count is None else self.max_returned_count


UNLIMITED_PAGE = 1_000
"""The page of a fetch rule with ``max_returned_count = "infinity"``: every message comes, this many at a time."""


@dataclass(frozen=True)
class Rule:
    """One rule: on ``hook``, for topics matching ``topic`` (None: all), run ``action``.

    ``number`` is the rule's position in its file, from 1, for messages.
    ``offline_opts`` is set on fetch rules only (the file's defaults merged
    with the rule's own).
    """

    hook: str
    action: str
    topic: str | None = None
    offline_opts: OfflineOpts | None = None
    number: int = 0

    @property
    def spec(self) -> ActionSpec:
        return ACTIONS[self.action]

    @property
    def kind(self) -> Kind:
        return ACTIONS[self.action].kind

    @property
    def mode(self) -> Mode | None:
        return ACTIONS[self.action].mode

    def applies_to(self, topic: str | None) -> bool:
        """True when the rule runs for ``topic`` (a topic, or a subscription filter read as a topic)."""
        return self.topic is None or (topic is not None and matches(self.topic, topic))

    def describe(self) -> str:
        where = f" on {self.topic!r}" if self.topic is not None else ""
        return f"rule {self.number} ({self.hook}{where} -> {self.action})"


@dataclass(frozen=True)
class HookConfig:
    """A validated set of rules and the options they share; build it with :func:`load_config`."""

    rules: tuple[Rule, ...]
    node: str | None = None
    keep_qos0: bool = False
    source: str = "<config>"
    notes: tuple[str, ...] = ()
    """What the file says that mqds accepts and does not use (the seeds' ``pool``), one line each."""

    def rules_for(self, hook: str, topic: str | None = None) -> list[Rule]:
        """The rules of ``hook`` that apply to ``topic``, in file order."""
        return [rule for rule in self.rules if rule.hook == hook and rule.applies_to(topic)]

    @property
    def hooks(self) -> list[str]:
        """The hooks some rule uses, in the order of :data:`HOOKS`."""
        used = {rule.hook for rule in self.rules}
        return [hook for hook in HOOKS if hook in used]

    def topics_for(self, hook: str) -> list[str]:
        """The topic filters a message hook is needed for; [] when some rule of it has no topic (every topic)."""
        topics: list[str] = []
        for rule in self.rules:
            if rule.hook != hook:
                continue
            if rule.topic is None:
                return []
            if rule.topic not in topics:
                topics.append(rule.topic)
        return topics

    @property
    def stores_qos0(self) -> bool:
        """True when some published QoS 0 messages are stored (keep_qos0, or an on_message_store rule)."""
        stores = [rule for rule in self.rules if rule.kind == "store"]
        return any(rule.spec.stores_qos0 for rule in stores) or (self.keep_qos0 and bool(stores))

    def fetch_rule(self, topic_filter: str) -> Rule | None:
        """The first fetch rule that applies to a subscription filter: it decides its delivery mode."""
        return next((r for r in self.rules_for("session.subscribed", topic_filter) if r.kind == "fetch"), None)


# -- loading -------------------------------------------------------------------

_TOP_KEYS = ("node", "keep_qos0", "offline_opts", "rule", "rules")
_RULE_KEYS = ("hook", "topic", "action", "offline_opts", "pool")
# Keys of the seeds' rules that mqds accepts and ignores, with why (a note when a file has them).
_IGNORED_KEYS = {"pool": "mqds has one connection to the cluster (the client's), not pools"}
_OFFLINE_KEYS = ("max_returned_count", "time_range", "include_qos0")


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _offline_opts(raw: object, base: OfflineOpts, where: str) -> OfflineOpts:
    if not isinstance(raw, Mapping):
        raise HookConfigError(f"{where}: offline_opts must be a table of {', '.join(_OFFLINE_KEYS)}")
    unknown = [str(k) for k in raw if k not in _OFFLINE_KEYS]
    if unknown:
        raise HookConfigError(
            f"{where}: unknown offline_opts key {unknown[0]!r}{_suggest(unknown[0], list(_OFFLINE_KEYS))}; "
            f"known: {', '.join(_OFFLINE_KEYS)}"
        )
    count = raw.get("max_returned_count", base.max_returned_count)
    if isinstance(count, str) and count.strip().lower() == "infinity":
        count = None  # the seeds' word for no limit
    elif isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise HookConfigError(
            f'{where}: offline_opts.max_returned_count must be a whole number above 0 or "infinity", not {count!r}'
        )
    time_range_s = base.time_range_s
    if "time_range" in raw:
        try:
            time_range_s = parse_duration(raw["time_range"])
        except ValueError as err:
            raise HookConfigError(f"{where}: offline_opts.time_range: {err}") from None
    include_qos0 = raw.get("include_qos0", base.include_qos0)
    if include_qos0 is not None and not isinstance(include_qos0, bool):
        raise HookConfigError(f"{where}: offline_opts.include_qos0 must be true or false, not {include_qos0!r}")
    return OfflineOpts(count, time_range_s, include_qos0)


def _action_name(raw: object, where: str) -> str:
    if isinstance(raw, Mapping):
        # The seeds' form: {"action": {"function": "on_message_publish"}}.
        if set(raw) != {"function"}:
            raise HookConfigError(f"{where}: action must be a name or {{ function = NAME }}, not {dict(raw)!r}")
        raw = raw["function"]
    if not isinstance(raw, str) or not raw:
        raise HookConfigError(f"{where}: action must be an action name, not {raw!r}")
    if raw not in ACTIONS:
        raise HookConfigError(
            f"{where}: unknown action {raw!r}{_suggest(raw, list(ACTIONS))}; actions: {', '.join(ACTIONS)}"
        )
    return raw


def _rule(raw: object, number: int, defaults: OfflineOpts, source: str, name: str | None = None) -> Rule:
    label = name or f"rule {number}"
    where = f"{source}: {label}"
    if not isinstance(raw, Mapping):
        raise HookConfigError(f"{where}: a rule must be a table with hook, action and optionally topic")
    unknown = [str(k) for k in raw if k not in _RULE_KEYS]
    if unknown:
        raise HookConfigError(
            f"{where}: unknown key {unknown[0]!r}{_suggest(unknown[0], list(_RULE_KEYS))}; "
            f"a rule has {', '.join(_RULE_KEYS)}"
        )
    hook = raw.get("hook")
    if not isinstance(hook, str) or not hook:
        raise HookConfigError(f"{where}: hook is missing; hooks: {', '.join(HOOKS)}")
    if hook not in HOOKS:
        known = hook in OTHER_BROKER_HOOKS
        why = " has no persistence actions" if known else f" is not a hook{_suggest(hook, list(HOOKS))}"
        raise HookConfigError(f"{where}: {hook!r}{why}; hooks with actions: {', '.join(HOOKS)}")
    where = f"{where} (hook {hook!r})"
    if "action" not in raw:
        raise HookConfigError(f"{where}: action is missing; actions of {hook}: {', '.join(_actions_of(hook))}")
    action = _action_name(raw["action"], where)
    where = f"{source}: {label} ({hook} -> {action})"
    spec = ACTIONS[action]
    if hook not in spec.hooks:
        raise HookConfigError(
            f"{where}: {action} does not run on {hook}; it runs on {', '.join(sorted(spec.hooks))}. "
            f"Actions of {hook}: {', '.join(_actions_of(hook))}"
        )
    topic = raw.get("topic")
    if topic is not None:
        if hook not in TOPIC_HOOKS:
            raise HookConfigError(
                f"{where}: {hook} has no topic, so a rule on it cannot have one (topics are for "
                f"{', '.join(sorted(TOPIC_HOOKS))})"
            )
        try:
            validate_filter(topic)
        except TopicError as err:
            raise HookConfigError(f"{where}: topic: {err}") from None
    offline: OfflineOpts | None = None
    if spec.kind == "fetch":
        offline = _offline_opts(raw["offline_opts"], defaults, where) if "offline_opts" in raw else defaults
    elif "offline_opts" in raw:
        raise HookConfigError(f"{where}: offline_opts is only for the fetch actions ({', '.join(_fetch_actions())})")
    return Rule(hook=hook, action=action, topic=topic, offline_opts=offline, number=number)


def _actions_of(hook: str) -> list[str]:
    return [name for name, spec in ACTIONS.items() if hook in spec.hooks]


def _fetch_actions() -> list[str]:
    return [name for name, spec in ACTIONS.items() if spec.kind == "fetch"]


def parse_config(
    data: Mapping[str, Any],
    source: str = "<config>",
    *,
    names: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> HookConfig:
    """Validate a configuration already read into a mapping (what the TOML or YAML file holds).

    ``names``: what messages call each rule (a seed ``.conf``'s line and
    key), "rule N" by default; ``notes``: what the reader accepted and
    ignored already, kept before the notes of the rules.
    """
    if not isinstance(data, Mapping):
        raise HookConfigError(f"{source}: expected a table of node, keep_qos0, offline_opts and rule entries")
    unknown = [str(k) for k in data if k not in _TOP_KEYS]
    if unknown:
        raise HookConfigError(
            f"{source}: unknown key {unknown[0]!r}{_suggest(unknown[0], list(_TOP_KEYS))}; "
            f"known: node, keep_qos0, offline_opts, rule (or rules)"
        )
    node = data.get("node")
    if node is not None and (not isinstance(node, str) or not node):
        raise HookConfigError(f"{source}: node must be a non-empty string, not {node!r}")
    keep_qos0 = data.get("keep_qos0", False)
    if not isinstance(keep_qos0, bool):
        raise HookConfigError(f"{source}: keep_qos0 must be true or false, not {keep_qos0!r}")
    defaults = OfflineOpts()
    if "offline_opts" in data:
        defaults = _offline_opts(data["offline_opts"], defaults, source)
    if "rule" in data and "rules" in data:
        raise HookConfigError(f"{source}: give the rules as rule or as rules, not both")
    raw_rules = data.get("rule", data.get("rules"))
    if raw_rules is None or raw_rules == []:
        raise HookConfigError(f"{source}: no rules: add [[rule]] tables (TOML) or a rules: list (YAML)")
    if not isinstance(raw_rules, list):
        raise HookConfigError(f"{source}: rules must be a list of tables ([[rule]] in TOML)")
    labels = [names[n - 1] if n <= len(names) else f"rule {n}" for n in range(1, len(raw_rules) + 1)]
    rules = tuple(_rule(raw, n, defaults, source, labels[n - 1]) for n, raw in enumerate(raw_rules, start=1))
    rule_notes = tuple(
        f"{source}: {labels[n - 1]}: {key} {raw[key]!r} accepted and ignored: {why}"
        for n, raw in enumerate(raw_rules, start=1)
        for key, why in _IGNORED_KEYS.items()
        if isinstance(raw, Mapping) and key in raw
    )
    return HookConfig(rules=rules, node=node, keep_qos0=keep_qos0, source=source, notes=(*notes, *rule_notes))


def load_config(path: str | os.PathLike[str]) -> HookConfig:
    """Read and validate a configuration file: TOML (``.toml``), YAML (``.yaml``, ``.yml``), or an EMQX
    backend's own lines (``.conf``, :mod:`mqds.broker.seedconf`), by suffix."""
    file = Path(path)
    source = str(path)
    suffix = file.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".conf"):
        raise HookConfigError(
            f"{source}: unknown configuration format {suffix or '(no suffix)'!r}; use .toml, .yaml or .conf "
            "(an EMQX backend's lines)"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise HookConfigError(f"{source}: cannot read: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise HookConfigError(f"{source}: not UTF-8 text ({err.reason})") from None
    if suffix == ".conf":
        return parse_seed_conf(text, source)
    if suffix == ".toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise HookConfigError(f"{source}: not valid TOML: {err}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise HookConfigError(
                f"{source}: reading YAML needs PyYAML: pip install 'mqds-broker[cli]' (or use TOML)"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise HookConfigError(f"{source}: not valid YAML: {err}") from None
    if data is None:
        data = {}
    return parse_config(data, source)


def parse_seed_conf(text: str, source: str = "<conf>") -> HookConfig:
    """Validate an EMQX backend's ``.conf`` lines, as a seed writes them (see :mod:`mqds.broker.seedconf`)."""
    try:
        data, notes, names = read_seed_conf(text, source)
    except SeedConfError as err:
        raise HookConfigError(str(err)) from None
    return parse_config(data, source, names=names, notes=notes)
