"""What ends in a shard: retained messages and sessions, each found through an index by the time it ends.

A retained message with ``message_expiry_s`` (MQTT 5's Message Expiry
Interval) ends that long after it was retained; the session of a client
(its state, proxy subscriptions and read positions) ends ``session_expiry_s``
after the client disconnected (MQTT 5's Session Expiry Interval, or the
node's default for a client that reported none; 0 at the disconnect,
:data:`NEVER` never). Each has an entry in an index ordered by that time
(``keys.expiry_key``: ``x:`` retained messages by topic, ``y:`` sessions by
clientid), written in the same batch as the change that sets the time and
removed with the change that cancels it (a new retained message, a
reconnect).

Removal is a logged change like any other: the leader asks ``due`` now and
then and logs an ``Expire`` command with its clock and a bounded step; each
replica applies it by walking the indexes from their heads, so every replica
removes the same keys whatever its own clock says. Reads leave out what is
due but not removed yet (a few entries at the indexes' heads).
"""

from __future__ import annotations

from rocksdict import WriteBatch

from mqds.protocol.limits import SESSION_NEVER_EXPIRES
from mqds.server.storage import keys
from mqds.server.storage.metadata import MetadataFamily
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

NEVER = SESSION_NEVER_EXPIRES
"""A Session Expiry Interval that never ends (MQTT 5)."""


def message_expires_us(message: pb.Message) -> int | None:
    """When a retained message ends (None: it does not)."""
    if not message.message_expiry_s:
        return None
    return message.timestamp_us + message.message_expiry_s * 1_000_000


def session_expires_us(state: spb.ClientState) -> int | None:
    """When an offline client's session ends (None: online, or it never does)."""
    if state.online or state.session_expiry_s == NEVER:
        return None
    return state.offline_at_us + state.session_expiry_s * 1_000_000


class ExpiryIndex:
    """One index of what ends when, in a shard's ``default`` family: entries by time, then name."""

    def __init__(self, metadata: MetadataFamily, prefix: bytes) -> None:
        self._meta = metadata
        self.prefix = prefix

    def put(self, batch: WriteBatch, at_us: int, name: str) -> None:
        batch.put(keys.expiry_key(self.prefix, at_us, name), b"", self._meta.handle)

    def delete(self, batch: WriteBatch, at_us: int, name: str) -> None:
        batch.delete(keys.expiry_key(self.prefix, at_us, name), self._meta.handle)

    def due(self, now_us: int, limit: int | None = None) -> list[tuple[bytes, str]]:
        """The entries due at ``now_us`` (at most ``limit``), earliest first: (key, name)."""
        out: list[tuple[bytes, str]] = []
        for key, _ in self._meta.scan(self.prefix):
            at_us, name = keys.read_expiry_key(self.prefix, key)
            if at_us > now_us or (limit is not None and len(out) >= limit):
                break
            out.append((key, name))
        return out

    def any_due(self, now_us: int) -> bool:
        return bool(self.due(now_us, 1))
