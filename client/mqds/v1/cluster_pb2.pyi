from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_ACTIVE: _ClassVar[NodeState]
    NODE_STATE_LEAVING: _ClassVar[NodeState]

class RetentionDiscard(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETENTION_DISCARD_UNSPECIFIED: _ClassVar[RetentionDiscard]
    RETENTION_DISCARD_OLD: _ClassVar[RetentionDiscard]
    RETENTION_DISCARD_NEW: _ClassVar[RetentionDiscard]

class RaftRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RAFT_ROLE_UNSPECIFIED: _ClassVar[RaftRole]
    RAFT_ROLE_FOLLOWER: _ClassVar[RaftRole]
    RAFT_ROLE_CANDIDATE: _ClassVar[RaftRole]
    RAFT_ROLE_LEADER: _ClassVar[RaftRole]
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_ACTIVE: NodeState
NODE_STATE_LEAVING: NodeState
RETENTION_DISCARD_UNSPECIFIED: RetentionDiscard
RETENTION_DISCARD_OLD: RetentionDiscard
RETENTION_DISCARD_NEW: RetentionDiscard
RAFT_ROLE_UNSPECIFIED: RaftRole
RAFT_ROLE_FOLLOWER: RaftRole
RAFT_ROLE_CANDIDATE: RaftRole
RAFT_ROLE_LEADER: RaftRole

class ClusterNode(_message.Message):
    __slots__ = ("id", "address", "state")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    state: NodeState
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ...) -> None: ...

class VnodeInfo(_message.Message):
    __slots__ = ("shard", "replicas", "leader", "term")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    shard: int
    replicas: _containers.RepeatedScalarFieldContainer[str]
    leader: str
    term: int
    def __init__(self, shard: _Optional[int] = ..., replicas: _Optional[_Iterable[str]] = ..., leader: _Optional[str] = ..., term: _Optional[int] = ...) -> None: ...

class GetClusterMapRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterMap(_message.Message):
    __slots__ = ("cluster_id", "n_shards", "replication_factor", "nodes", "vnodes", "version", "answered_by", "meta_leader", "retention")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    N_SHARDS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    VNODES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    META_LEADER_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    n_shards: int
    replication_factor: int
    nodes: _containers.RepeatedCompositeFieldContainer[ClusterNode]
    vnodes: _containers.RepeatedCompositeFieldContainer[VnodeInfo]
    version: int
    answered_by: str
    meta_leader: str
    retention: RetentionPolicy
    def __init__(self, cluster_id: _Optional[str] = ..., n_shards: _Optional[int] = ..., replication_factor: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[ClusterNode, _Mapping]]] = ..., vnodes: _Optional[_Iterable[_Union[VnodeInfo, _Mapping]]] = ..., version: _Optional[int] = ..., answered_by: _Optional[str] = ..., meta_leader: _Optional[str] = ..., retention: _Optional[_Union[RetentionPolicy, _Mapping]] = ...) -> None: ...

class RetentionPolicy(_message.Message):
    __slots__ = ("rules", "default_s")
    RULES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_S_FIELD_NUMBER: _ClassVar[int]
    rules: _containers.RepeatedCompositeFieldContainer[RetentionRule]
    default_s: int
    def __init__(self, rules: _Optional[_Iterable[_Union[RetentionRule, _Mapping]]] = ..., default_s: _Optional[int] = ...) -> None: ...

class RetentionRule(_message.Message):
    __slots__ = ("topic_filter", "period_s", "max_messages", "max_bytes", "max_messages_per_topic", "discard")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    PERIOD_S_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_PER_TOPIC_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    period_s: int
    max_messages: int
    max_bytes: int
    max_messages_per_topic: int
    discard: RetentionDiscard
    def __init__(self, topic_filter: _Optional[str] = ..., period_s: _Optional[int] = ..., max_messages: _Optional[int] = ..., max_bytes: _Optional[int] = ..., max_messages_per_topic: _Optional[int] = ..., discard: _Optional[_Union[RetentionDiscard, str]] = ...) -> None: ...

class SetRetentionRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: RetentionPolicy
    def __init__(self, policy: _Optional[_Union[RetentionPolicy, _Mapping]] = ...) -> None: ...

class GetNodeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("group", "role", "term", "leader", "commit_index", "applied_index", "last_log_index", "log_entries", "log_bytes", "members", "follower_lag", "snapshots_installed", "last_applied", "match_index", "generations", "disk_bytes")
    class FollowerLagEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MatchIndexEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    APPLIED_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_LOG_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOG_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_LAG_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_INSTALLED_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_FIELD_NUMBER: _ClassVar[int]
    MATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    group: int
    role: RaftRole
    term: int
    leader: str
    commit_index: int
    applied_index: int
    last_log_index: int
    log_entries: int
    log_bytes: int
    members: _containers.RepeatedScalarFieldContainer[str]
    follower_lag: _containers.ScalarMap[str, int]
    snapshots_installed: int
    last_applied: int
    match_index: _containers.ScalarMap[str, int]
    generations: int
    disk_bytes: int
    def __init__(self, group: _Optional[int] = ..., role: _Optional[_Union[RaftRole, str]] = ..., term: _Optional[int] = ..., leader: _Optional[str] = ..., commit_index: _Optional[int] = ..., applied_index: _Optional[int] = ..., last_log_index: _Optional[int] = ..., log_entries: _Optional[int] = ..., log_bytes: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., follower_lag: _Optional[_Mapping[str, int]] = ..., snapshots_installed: _Optional[int] = ..., last_applied: _Optional[int] = ..., match_index: _Optional[_Mapping[str, int]] = ..., generations: _Optional[int] = ..., disk_bytes: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "address", "replicas", "dropped_raft_messages", "ready", "data_dir_bytes", "disk_free_bytes", "disk_total_bytes", "disk_quota_bytes", "disk_min_free_bytes", "writes_refused", "raft_wal_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RAFT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DATA_DIR_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_MIN_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    RAFT_WAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    dropped_raft_messages: int
    ready: bool
    data_dir_bytes: int
    disk_free_bytes: int
    disk_total_bytes: int
    disk_quota_bytes: int
    disk_min_free_bytes: int
    writes_refused: str
    raft_wal_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., dropped_raft_messages: _Optional[int] = ..., ready: _Optional[bool] = ..., data_dir_bytes: _Optional[int] = ..., disk_free_bytes: _Optional[int] = ..., disk_total_bytes: _Optional[int] = ..., disk_quota_bytes: _Optional[int] = ..., disk_min_free_bytes: _Optional[int] = ..., writes_refused: _Optional[str] = ..., raft_wal_bytes: _Optional[int] = ...) -> None: ...

class JoinNodeRequest(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class LeaveNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class ForgetNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MembershipResponse(_message.Message):
    __slots__ = ("moves", "leader_moves", "map")
    MOVES_FIELD_NUMBER: _ClassVar[int]
    LEADER_MOVES_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    moves: _containers.RepeatedScalarFieldContainer[str]
    leader_moves: _containers.RepeatedScalarFieldContainer[str]
    map: ClusterMap
    def __init__(self, moves: _Optional[_Iterable[str]] = ..., leader_moves: _Optional[_Iterable[str]] = ..., map: _Optional[_Union[ClusterMap, _Mapping]] = ...) -> None: ...

class GetReplicaDigestRequest(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: int
    def __init__(self, shard: _Optional[int] = ...) -> None: ...

class ReplicaDigest(_message.Message):
    __slots__ = ("shard", "applied_index", "sha256", "keys")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    APPLIED_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    applied_index: int
    sha256: str
    keys: int
    def __init__(self, shard: _Optional[int] = ..., applied_index: _Optional[int] = ..., sha256: _Optional[str] = ..., keys: _Optional[int] = ...) -> None: ...
