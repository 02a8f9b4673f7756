"""The Python client of mqds.

>>> from mqds.client import Client, ConnectionSettings, Message
>>> c = Client(["127.0.0.1:7101"], settings=ConnectionSettings(timeout_s=10))  # doctest: +SKIP
>>> c.store_batch([Message(topic="t/1", payload=b"x", sender="pub-1", qos=1)])  # doctest: +SKIP

:mod:`mqds.client.aio` has the asyncio client, with the same methods.
"""

from mqds.client import aio, errors
from mqds.client.backup import BackupReport, RestoreReport
from mqds.client.backup_files import BackupError, VerifyReport
from mqds.client.backup_files import verify_place as verify_backup
from mqds.client.batch import MessageBatch, NextResult
from mqds.client.client import Client
from mqds.client.connection import ConnectionSettings
from mqds.client.deletes import DeleteReport, ShardDeleted
from mqds.client.follow import FollowBatch, FollowPosition
from mqds.client.follow_sync import Subscription
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
from mqds.client.offline import OfflineFetch
from mqds.client.share_group import ShareAssignment
from mqds.client.share_members import SharedSubscription
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
