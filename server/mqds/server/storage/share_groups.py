"""Share groups in a shard's metadata: who is a member of ``$share/<group>/<filter>``, and until when.

A group lives in the shard of its pseudo-client ``$share/<group>``
(``mqds.protocol.share_groups``), beside the read positions its members
share. Each member is one ``h:`` key whose value is the end of its lease.
Joining (or renewing) and leaving are logged commands with the leader's
clock: each removes the group's members whose lease ended by then, so every
replica keeps the same members; the members a call reports are those whose
lease has not ended at its ``now_us``.
"""

from __future__ import annotations

from rocksdict import WriteBatch

from mqds.server.storage import keys
from mqds.server.storage.metadata import MetadataFamily

MAX_MEMBERS = 1024
"""Members one group may have; a join past it is refused (INVALID_REQUEST)."""


class ShareGroups:
    """The share groups kept in one shard (its metadata family)."""

    def __init__(self, metadata: MetadataFamily) -> None:
        self._meta = metadata

    def members(self, group: str, topic_filter: str, now_us: int) -> list[str]:
        """The members whose lease has not ended at ``now_us``, in name order."""
        prefix = keys.share_group_prefix(group, topic_filter)
        return sorted(
            key[len(prefix) :].decode("utf-8")
            for key, value in self._meta.scan(prefix)
            if keys.read_u64(value) > now_us
        )

    def join(
        self, group: str, topic_filter: str, member: str, lease_s: int, now_us: int, *, applied_index: int | None
    ) -> list[str] | None:
        """Add ``member`` (or renew it) until ``now_us + lease_s``; the live members, or None when the group is full."""
        meta = self._meta
        prefix = keys.share_group_prefix(group, topic_filter)
        batch = WriteBatch(raw_mode=True)
        live = self._drop_ended(batch, prefix, now_us)
        if member not in live and len(live) >= MAX_MEMBERS:
            meta.write(WriteBatch(raw_mode=True), applied_index)
            return None
        batch.put(prefix + member.encode("utf-8"), keys.u64(now_us + lease_s * 1_000_000), meta.handle)
        meta.write(batch, applied_index)
        return sorted({*live, member})

    def leave(self, group: str, topic_filter: str, member: str, now_us: int, *, applied_index: int | None) -> list[str]:
        """Remove ``member``; the live members left."""
        meta = self._meta
        prefix = keys.share_group_prefix(group, topic_filter)
        batch = WriteBatch(raw_mode=True)
        live = self._drop_ended(batch, prefix, now_us)
        batch.delete(prefix + member.encode("utf-8"), meta.handle)
        meta.write(batch, applied_index)
        return sorted(m for m in live if m != member)

    def _drop_ended(self, batch: WriteBatch, prefix: bytes, now_us: int) -> list[str]:
        """Delete the members whose lease ended by ``now_us`` (into ``batch``); the others' names."""
        live = []
        for key, value in self._meta.scan(prefix):
            if keys.read_u64(value) > now_us:
                live.append(key[len(prefix) :].decode("utf-8"))
            else:
                batch.delete(key, self._meta.handle)
        return live
