"""The Python client of mqds.

>>> from mqds.client import Client, ConnectionSettings, Message
>>> c = Client(["127.0.0.1:7101"], settings=ConnectionSettings(timeout_s=10))  # doctest: +SKIP
>>> c.store_batch([Message(topic="t/1", payload=b"x", sender="pub-1", qos=1)])  # doctest: +SKIP

:mod:`mqds.client.aio` has the asyncio client, with the same methods (the synchronous one is
generated from it: ``client/mqds/client/DESIGN.md``). ``core/`` is the I/O-free part both share,
``sync/`` and ``aio/`` the two drivers.
"""

from mqds.client import aio, errors
from mqds.client.batch import MessageBatch, NextResult
from mqds.client.connection import ConnectionSettings
from mqds.client.core.backup_files import BackupError, VerifyReport
from mqds.client.core.backup_files import verify_place as verify_backup
from mqds.client.core.backup_runs import BackupReport, RestoreReport
from mqds.client.core.deletes import DeleteReport, ShardDeleted
from mqds.client.core.follow import FollowBatch, FollowPosition
from mqds.client.core.offline import OfflineFetch
from mqds.client.core.share_group import ShareAssignment
from mqds.client.model import (
    ClientState,
    Fence,
    Generation,
    Iterator,
    Message,
    Rank,
    ReadPosition,
    Stream,
)
from mqds.client.sync.client import Client
from mqds.client.sync.follow import Subscription
from mqds.client.sync.share_members import SharedSubscription
from mqds.protocol.limits import SESSION_NEVER_EXPIRES

__all__ = [
    "SESSION_NEVER_EXPIRES",
    "BackupError",
    "BackupReport",
    "Client",
    "ClientState",
    "ConnectionSettings",
    "DeleteReport",
    "Fence",
    "FollowBatch",
    "FollowPosition",
    "Generation",
    "Iterator",
    "Message",
    "MessageBatch",
    "NextResult",
    "OfflineFetch",
    "Rank",
    "ReadPosition",
    "RestoreReport",
    "ShardDeleted",
    "ShareAssignment",
    "SharedSubscription",
    "Stream",
    "Subscription",
    "VerifyReport",
    "aio",
    "errors",
    "verify_backup",
]
