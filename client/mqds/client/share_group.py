"""Share groups through the client: the join and leave calls, and the assignment they answer with.

The members of a group ``$share/<group>/<filter>`` share one read position
per shard (that of the pseudo-client ``$share/<group>``,
``mqds.protocol.share_groups``), and each shard is read by one member at a
time. :func:`share_group_call` builds ``JoinShareGroup`` and
``LeaveShareGroup``, sent to the shard that keeps the group, for both
clients' ``join_share_group`` / ``leave_share_group``; a member that
fetches, acknowledges and renews is :mod:`mqds.client.share_members`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mqds.client.operations import ShardCall
from mqds.protocol import share_groups
from mqds.protocol.sharding import shard_of
from mqds.v1 import sessions_pb2 as spb


@dataclass(frozen=True)
class ShareAssignment:
    """A share group after a join or a leave: its live members, the shards of the member that asked."""

    members: list[str]
    shards: list[int]
    position_clientid: str
    """The pseudo-client whose read positions the members share (``$share/<group>``)."""


def share_group_call(
    method: str, group: str, topic_filter: str, member: str, lease_s: int, n_shards: int
) -> ShardCall[ShareAssignment]:
    """JoinShareGroup or LeaveShareGroup, sent to the shard that keeps the group."""
    share_groups.check(group, topic_filter, member, lease_s or 1)
    request = spb.ShareGroupRequest(group=group, topic_filter=topic_filter, member=member, lease_s=lease_s)
    return ShardCall(
        method,
        shard_of(share_groups.position_client(group), n_shards),
        request,
        lambda r: ShareAssignment(list(r.members), list(r.shards), r.position_clientid),
        service="Sessions",
    )
