"""Client tokens and their roles, and the deadline of the call a handler serves.

Clients authenticate with a bearer token (``authorization: Bearer <token>``
metadata; ``mqds --token``, ``ConnectionSettings(auth_token=...)``). The node
reads the tokens and their roles from ``auth_tokens_file``; without that
file, client authentication is off (for development and for clusters
reachable only by trusted brokers; a node refuses to listen beyond loopback
that way unless told to).

Roles, each including the ones before it:

- ``reader``: reads messages, streams, fences, generations, broker state and
  the cluster map (analytics, Spark, dashboards), push subscriptions;
- ``broker``: also stores messages and writes broker state (client state,
  subscriptions, retained messages, acknowledgements);
- ``admin``: also changes generations and membership, deletes, digests of
  whole replicas, and exports and imports whole shards (backup and restore).

A node of the cluster (one presenting the cluster secret) is an admin. Which
role each method needs, and every other rule a call meets before its
handler, is in one table (``api/methods.py``) that the guard
(``api/guard.py``) applies to every call.
"""

from __future__ import annotations

import contextvars
import time
from pathlib import Path

ROLES = ("reader", "broker", "admin")
"""The roles, weakest first; each may do what the ones before it may."""

READ, WRITE, ADMIN = "reader", "broker", "admin"

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("mqds_call_deadline", default=None)


def set_deadline(deadline: float) -> None:
    """Record the current call's deadline (``time.monotonic()`` seconds); the guard does, first thing."""
    _deadline.set(deadline)


def time_left(limit_s: float) -> float:
    """``limit_s``, or less: what is left of the current public call's deadline (0 once it passed).

    gRPC runs each call in a context of its own, so this is the deadline of
    the call the current handler serves; outside one it is ``limit_s``.
    """
    deadline = _deadline.get()
    if deadline is None:
        return limit_s
    return max(0.0, min(limit_s, deadline - time.monotonic()))


class TokenFileError(ValueError):
    """The tokens file cannot be used; the message says which line and why."""


def load_tokens(path: str) -> dict[str, str]:
    """token -> role from a file of ``<role> <token>`` lines (``#`` starts a comment)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise TokenFileError(f"auth_tokens_file {path}: cannot read it: {err.strerror}") from None
    tokens: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenFileError(f"auth_tokens_file {path}, line {number}: expected '<role> <token>'")
        role, token = parts
        if role not in ROLES:
            raise TokenFileError(
                f"auth_tokens_file {path}, line {number}: unknown role {role!r}; roles are {', '.join(ROLES)}"
            )
        if len(token) < 16:
            raise TokenFileError(f"auth_tokens_file {path}, line {number}: a token needs at least 16 characters")
        if token in tokens:
            raise TokenFileError(f"auth_tokens_file {path}, line {number}: this token is listed twice")
        tokens[token] = role
    if not tokens:
        raise TokenFileError(f"auth_tokens_file {path}: no tokens in it; remove the setting to turn auth off")
    return tokens
