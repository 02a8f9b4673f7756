r"""The EMQX persistence backends' own ``.conf`` lines, read as hook rules.

EMQX's Redis, Cassandra and DynamoDB backends are configured with lines
such as::

    backend.redis.hook.message.publish.1 = {"topic": "#", "action": {"function": "on_message_publish"}, "pool": "pool1"}

:func:`read_seed_conf` turns such a file into the mapping
:func:`mqds.broker.hooks.parse_config` checks, so a seed's lines load as
they are written: each ``backend.<db>.hook.<hook>.<n>`` line is a rule (in
file order), ``backend.<db>.max_returned_count`` and
``backend.<db>.time_range`` are the defaults of the fetch rules (the
Cassandra backend's), and what mqds has no use for is accepted and ignored
with a note: the database connections (``backend.dynamo.region``, a pool's
``server``, ``pool_size``, keys and passwords: the note names the key, never
its value), a rule's ``pool``, and a rule whose action is raw CQL (mqds has
no tables to run it on). Blank lines and ``#`` comments are skipped, so the
lines a seed comments out stay out. Any other key is refused, naming the
line: a key no seed uses is more likely a mistake than a setting.

>>> data, notes, names = read_seed_conf(
...     'backend.redis.pool1.server = 127.0.0.1:6379\n'
...     'backend.redis.hook.message.publish.1 = {"topic": "#", "action": {"function": "on_message_publish"}}\n',
...     "redis.conf",
... )
>>> data["rule"]
[{'hook': 'message.publish', 'topic': '#', 'action': {'function': 'on_message_publish'}}]
>>> names
['line 2 (backend.redis.hook.message.publish.1)']
>>> print(*notes)  # doctest: +ELLIPSIS
redis.conf: line 1: backend.redis.pool1.server accepted and ignored: mqds is the store; the database connection ...
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["POOL_SETTINGS", "SeedConfError", "read_seed_conf"]


class SeedConfError(ValueError):
    """A ``.conf`` line that is not a seed's: the message names the file and the line."""


_HOOK_KEY = re.compile(r"backend\.([a-z][a-z0-9_]*)\.hook\.([a-z_.]+?)\.(\d+)")
_OPTION_KEY = re.compile(r"backend\.([a-z][a-z0-9_]*)\.(max_returned_count|time_range)")
_POOL_KEY = re.compile(r"backend\.([a-z][a-z0-9_]*)\.([A-Za-z][A-Za-z0-9_]*)\.([a-z_]+)")
_BACKEND_KEY = re.compile(r"backend\.([a-z][a-z0-9_]*)\.([a-z_]+)")

POOL_SETTINGS = frozenset(
    {
        # DynamoDB
        "server",
        "pool_size",
        "aws_access_key_id",
        "aws_secret_access_key",
        # Cassandra (ecql)
        "nodes",
        "size",
        "auto_reconnect",
        "username",
        "password",
        "keyspace",
        "logger",
    }
)
"""The connection-pool settings the seeds set (``backend.<db>.<pool>.<setting>``): accepted and ignored."""

_BACKEND_SETTINGS = frozenset({"region"})
"""The backend-wide connection settings the seeds set (``backend.dynamo.region``): accepted and ignored."""

_RULE_KEYS = ("topic", "action", "pool", "offline_opts")
_RAW_ACTIONS = ("cql",)
"""Action forms holding database statements (the Cassandra seed's ``{"cql": [...]}``): accepted, not run."""

_IGNORED_CONNECTION = "mqds is the store; the database connection settings have no counterpart"


def read_seed_conf(text: str, source: str) -> tuple[dict[str, Any], tuple[str, ...], list[str]]:
    """The mapping of a seed ``.conf`` file for ``parse_config``, its notes, and each rule's name for messages.

    Raises :class:`SeedConfError` for a line that is not ``key = value``, a
    key no seed uses, a hook line whose value is not a JSON object of the
    seeds' keys, and a hook line given twice.
    """
    rules: list[dict[str, Any]] = []
    names: list[str] = []
    notes: list[str] = []
    offline: dict[str, Any] = {}
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{source}: line {number}"
        key, sep, value = (part.strip() for part in stripped.partition("="))
        if not sep or not key:
            raise SeedConfError(f"{where}: expected KEY = VALUE, as the EMQX backends' .conf lines are")
        if key in seen:
            raise SeedConfError(f"{where}: {key} is given twice (first on line {seen[key]})")
        seen[key] = number
        hook = _HOOK_KEY.fullmatch(key)
        if hook is not None:
            rule = _hook_rule(hook.group(2), value, f"{where} ({key})")
            if rule is None:
                notes.append(f"{where}: {key}: a raw CQL action accepted and ignored: mqds has no tables to run it on")
                continue
            rules.append(rule)
            names.append(f"line {number} ({key})")
            continue
        option = _OPTION_KEY.fullmatch(key)
        if option is not None:
            name = option.group(2)
            offline[name] = int(value) if name == "max_returned_count" and value.isdigit() else value
            continue
        pool = _POOL_KEY.fullmatch(key)
        backend = _BACKEND_KEY.fullmatch(key)
        if (pool is not None and pool.group(3) in POOL_SETTINGS) or (
            backend is not None and backend.group(2) in _BACKEND_SETTINGS
        ):
            notes.append(f"{where}: {key} accepted and ignored: {_IGNORED_CONNECTION}")
            continue
        raise SeedConfError(
            f"{where}: unknown key {key!r}; a seed's .conf has backend.<db>.hook.<hook>.<n> rules, "
            "backend.<db>.max_returned_count and backend.<db>.time_range, and the connection settings "
            f"backend.<db>.region and backend.<db>.<pool>.<setting> ({', '.join(sorted(POOL_SETTINGS))})"
        )
    data: dict[str, Any] = {"rule": rules}
    if offline:
        data["offline_opts"] = offline
    return data, tuple(notes), names


def _hook_rule(hook: str, value: str, where: str) -> dict[str, Any] | None:
    """The rule of one hook line; None for a raw CQL action (ignored)."""
    try:
        raw = json.loads(value)
    except json.JSONDecodeError as err:
        raise SeedConfError(f"{where}: the value is not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(raw, dict):
        raise SeedConfError(f'{where}: the value must be a JSON object such as {{"action": {{"function": NAME}}}}')
    unknown = [k for k in raw if k not in _RULE_KEYS]
    if unknown:
        raise SeedConfError(f"{where}: unknown key {unknown[0]!r}; a hook line has {', '.join(_RULE_KEYS)}")
    action = raw.get("action")
    if isinstance(action, dict) and len(action) == 1 and next(iter(action)) in _RAW_ACTIONS:
        return None
    return {"hook": hook, **raw}
