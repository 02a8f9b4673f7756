from mqds.v1 import cluster_pb2 as _cluster_pb2
from mqds.v1 import sessions_pb2 as _sessions_pb2
from mqds.v1 import storage_pb2 as _storage_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VnodeCommand(_message.Message):
    __slots__ = ("store", "add_generation", "drop_generation", "session", "delete_messages", "apply_retention", "import_shard", "trim_messages", "expire_messages")
    STORE_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_FIELD_NUMBER: _ClassVar[int]
    DROP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DELETE_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    APPLY_RETENTION_FIELD_NUMBER: _ClassVar[int]
    IMPORT_SHARD_FIELD_NUMBER: _ClassVar[int]
    TRIM_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    store: StoreMessages
    add_generation: AddGeneration
    drop_generation: DropGeneration
    session: SessionCommand
    delete_messages: DeleteMessages
    apply_retention: ApplyRetention
    import_shard: _storage_pb2.ImportShardRequest
    trim_messages: TrimMessages
    expire_messages: ExpireMessages
    def __init__(self, store: _Optional[_Union[StoreMessages, _Mapping]] = ..., add_generation: _Optional[_Union[AddGeneration, _Mapping]] = ..., drop_generation: _Optional[_Union[DropGeneration, _Mapping]] = ..., session: _Optional[_Union[SessionCommand, _Mapping]] = ..., delete_messages: _Optional[_Union[DeleteMessages, _Mapping]] = ..., apply_retention: _Optional[_Union[ApplyRetention, _Mapping]] = ..., import_shard: _Optional[_Union[_storage_pb2.ImportShardRequest, _Mapping]] = ..., trim_messages: _Optional[_Union[TrimMessages, _Mapping]] = ..., expire_messages: _Optional[_Union[ExpireMessages, _Mapping]] = ...) -> None: ...

class ExpireMessages(_message.Message):
    __slots__ = ("now_us", "max_count")
    NOW_US_FIELD_NUMBER: _ClassVar[int]
    MAX_COUNT_FIELD_NUMBER: _ClassVar[int]
    now_us: int
    max_count: int
    def __init__(self, now_us: _Optional[int] = ..., max_count: _Optional[int] = ...) -> None: ...

class TrimMessages(_message.Message):
    __slots__ = ("streams",)
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    streams: _containers.RepeatedCompositeFieldContainer[TrimmedStream]
    def __init__(self, streams: _Optional[_Iterable[_Union[TrimmedStream, _Mapping]]] = ...) -> None: ...

class TrimmedStream(_message.Message):
    __slots__ = ("generation", "stream", "timestamps")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    stream: int
    timestamps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generation: _Optional[int] = ..., stream: _Optional[int] = ..., timestamps: _Optional[_Iterable[int]] = ...) -> None: ...

class ApplyRetention(_message.Message):
    __slots__ = ("now_us", "policy", "after_us", "cursor", "max_keys")
    NOW_US_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    AFTER_US_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_FIELD_NUMBER: _ClassVar[int]
    now_us: int
    policy: _cluster_pb2.RetentionPolicy
    after_us: int
    cursor: _storage_pb2.DeleteCursor
    max_keys: int
    def __init__(self, now_us: _Optional[int] = ..., policy: _Optional[_Union[_cluster_pb2.RetentionPolicy, _Mapping]] = ..., after_us: _Optional[int] = ..., cursor: _Optional[_Union[_storage_pb2.DeleteCursor, _Mapping]] = ..., max_keys: _Optional[int] = ...) -> None: ...

class DeleteMessages(_message.Message):
    __slots__ = ("topic_filter", "sender", "since_us", "until_us", "cursor", "max_keys")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SINCE_US_FIELD_NUMBER: _ClassVar[int]
    UNTIL_US_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    sender: str
    since_us: int
    until_us: int
    cursor: _storage_pb2.DeleteCursor
    max_keys: int
    def __init__(self, topic_filter: _Optional[str] = ..., sender: _Optional[str] = ..., since_us: _Optional[int] = ..., until_us: _Optional[int] = ..., cursor: _Optional[_Union[_storage_pb2.DeleteCursor, _Mapping]] = ..., max_keys: _Optional[int] = ...) -> None: ...

class StoreMessages(_message.Message):
    __slots__ = ("messages", "producer_id", "sequence", "now_us")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NOW_US_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_storage_pb2.Message]
    producer_id: str
    sequence: int
    now_us: int
    def __init__(self, messages: _Optional[_Iterable[_Union[_storage_pb2.Message, _Mapping]]] = ..., producer_id: _Optional[str] = ..., sequence: _Optional[int] = ..., now_us: _Optional[int] = ...) -> None: ...

class VnodeCommandEncoded(_message.Message):
    __slots__ = ("store",)
    STORE_FIELD_NUMBER: _ClassVar[int]
    store: StoreMessagesEncoded
    def __init__(self, store: _Optional[_Union[StoreMessagesEncoded, _Mapping]] = ...) -> None: ...

class StoreMessagesEncoded(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, messages: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AddGeneration(_message.Message):
    __slots__ = ("now_us", "if_current")
    NOW_US_FIELD_NUMBER: _ClassVar[int]
    IF_CURRENT_FIELD_NUMBER: _ClassVar[int]
    now_us: int
    if_current: int
    def __init__(self, now_us: _Optional[int] = ..., if_current: _Optional[int] = ...) -> None: ...

class DropGeneration(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class SessionCommand(_message.Message):
    __slots__ = ("now_us", "connected", "disconnected", "subscribe", "unsubscribe", "retain", "ack", "forget_position", "start_position", "forget_session", "expire", "share_join", "share_leave", "deliver")
    NOW_US_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DISCONNECTED_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    UNSUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    FORGET_POSITION_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    FORGET_SESSION_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_FIELD_NUMBER: _ClassVar[int]
    SHARE_JOIN_FIELD_NUMBER: _ClassVar[int]
    SHARE_LEAVE_FIELD_NUMBER: _ClassVar[int]
    DELIVER_FIELD_NUMBER: _ClassVar[int]
    now_us: int
    connected: _sessions_pb2.ClientConnectedRequest
    disconnected: _sessions_pb2.ClientDisconnectedRequest
    subscribe: _sessions_pb2.SubscribeRequest
    unsubscribe: _sessions_pb2.UnsubscribeRequest
    retain: _storage_pb2.Message
    ack: _sessions_pb2.AckRequest
    forget_position: _sessions_pb2.ForgetReadPositionRequest
    start_position: _sessions_pb2.StartReadPositionRequest
    forget_session: _sessions_pb2.ForgetSessionRequest
    expire: Expire
    share_join: _sessions_pb2.ShareGroupRequest
    share_leave: _sessions_pb2.ShareGroupRequest
    deliver: Deliver
    def __init__(self, now_us: _Optional[int] = ..., connected: _Optional[_Union[_sessions_pb2.ClientConnectedRequest, _Mapping]] = ..., disconnected: _Optional[_Union[_sessions_pb2.ClientDisconnectedRequest, _Mapping]] = ..., subscribe: _Optional[_Union[_sessions_pb2.SubscribeRequest, _Mapping]] = ..., unsubscribe: _Optional[_Union[_sessions_pb2.UnsubscribeRequest, _Mapping]] = ..., retain: _Optional[_Union[_storage_pb2.Message, _Mapping]] = ..., ack: _Optional[_Union[_sessions_pb2.AckRequest, _Mapping]] = ..., forget_position: _Optional[_Union[_sessions_pb2.ForgetReadPositionRequest, _Mapping]] = ..., start_position: _Optional[_Union[_sessions_pb2.StartReadPositionRequest, _Mapping]] = ..., forget_session: _Optional[_Union[_sessions_pb2.ForgetSessionRequest, _Mapping]] = ..., expire: _Optional[_Union[Expire, _Mapping]] = ..., share_join: _Optional[_Union[_sessions_pb2.ShareGroupRequest, _Mapping]] = ..., share_leave: _Optional[_Union[_sessions_pb2.ShareGroupRequest, _Mapping]] = ..., deliver: _Optional[_Union[Deliver, _Mapping]] = ...) -> None: ...

class Deliver(_message.Message):
    __slots__ = ("request", "max_bytes", "strict_bytes")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    STRICT_BYTES_FIELD_NUMBER: _ClassVar[int]
    request: _sessions_pb2.DeliverRequest
    max_bytes: int
    strict_bytes: bool
    def __init__(self, request: _Optional[_Union[_sessions_pb2.DeliverRequest, _Mapping]] = ..., max_bytes: _Optional[int] = ..., strict_bytes: _Optional[bool] = ...) -> None: ...

class Expire(_message.Message):
    __slots__ = ("max_count",)
    MAX_COUNT_FIELD_NUMBER: _ClassVar[int]
    max_count: int
    def __init__(self, max_count: _Optional[int] = ...) -> None: ...

class MetaCommand(_message.Message):
    __slots__ = ("set_address", "add_node", "set_state", "remove_node", "set_replicas", "set_retention")
    SET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ADD_NODE_FIELD_NUMBER: _ClassVar[int]
    SET_STATE_FIELD_NUMBER: _ClassVar[int]
    REMOVE_NODE_FIELD_NUMBER: _ClassVar[int]
    SET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SET_RETENTION_FIELD_NUMBER: _ClassVar[int]
    set_address: SetNodeAddress
    add_node: AddNode
    set_state: SetNodeState
    remove_node: RemoveNode
    set_replicas: SetReplicas
    set_retention: SetRetention
    def __init__(self, set_address: _Optional[_Union[SetNodeAddress, _Mapping]] = ..., add_node: _Optional[_Union[AddNode, _Mapping]] = ..., set_state: _Optional[_Union[SetNodeState, _Mapping]] = ..., remove_node: _Optional[_Union[RemoveNode, _Mapping]] = ..., set_replicas: _Optional[_Union[SetReplicas, _Mapping]] = ..., set_retention: _Optional[_Union[SetRetention, _Mapping]] = ...) -> None: ...

class SetRetention(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: _cluster_pb2.RetentionPolicy
    def __init__(self, policy: _Optional[_Union[_cluster_pb2.RetentionPolicy, _Mapping]] = ...) -> None: ...

class SetNodeAddress(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class AddNode(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class SetNodeState(_message.Message):
    __slots__ = ("node_id", "state")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: _cluster_pb2.NodeState
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[_Union[_cluster_pb2.NodeState, str]] = ...) -> None: ...

class RemoveNode(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class SetReplicas(_message.Message):
    __slots__ = ("shard", "replicas")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    replicas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, shard: _Optional[int] = ..., replicas: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("format", "applied_index", "map")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    APPLIED_INDEX_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    format: int
    applied_index: int
    map: _cluster_pb2.ClusterMap
    def __init__(self, format: _Optional[int] = ..., applied_index: _Optional[int] = ..., map: _Optional[_Union[_cluster_pb2.ClusterMap, _Mapping]] = ...) -> None: ...
