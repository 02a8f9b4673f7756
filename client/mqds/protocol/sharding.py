"""Which shard a message belongs to.

Messages are sharded by the publisher's clientid with CRC-32 (IEEE, as zlib
computes it) of its UTF-8 bytes modulo the database's shard count. The hash is
stable across processes, machines and Python versions, so clients and nodes
agree on it; the shard count is fixed when the database is created.

>>> shard_of("pub-1", 16)
7
>>> shard_of("", 16)
0
"""

from __future__ import annotations

import zlib


def shard_of(sender: str, n_shards: int) -> int:
    """The shard that holds the messages of clientid ``sender``."""
    return zlib.crc32(sender.encode("utf-8")) % n_shards
