from mqds.v1 import storage_pb2 as _storage_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeliveryMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUBSUB: _ClassVar[DeliveryMode]
    QUEUE: _ClassVar[DeliveryMode]
    DELIVERY: _ClassVar[DeliveryMode]
    NACK: _ClassVar[DeliveryMode]
    RELEASE: _ClassVar[DeliveryMode]

class ConsumerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSIONS: _ClassVar[ConsumerKind]
    READ_POSITIONS: _ClassVar[ConsumerKind]
    SHARE_GROUPS: _ClassVar[ConsumerKind]
    PUSH_SUBSCRIPTIONS: _ClassVar[ConsumerKind]
PUBSUB: DeliveryMode
QUEUE: DeliveryMode
DELIVERY: DeliveryMode
NACK: DeliveryMode
RELEASE: DeliveryMode
SESSIONS: ConsumerKind
READ_POSITIONS: ConsumerKind
SHARE_GROUPS: ConsumerKind
PUSH_SUBSCRIPTIONS: ConsumerKind

class ClientState(_message.Message):
    __slots__ = ("clientid", "online", "node", "online_at_us", "offline_at_us", "session_expiry_s", "expires_at_us")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ONLINE_AT_US_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_AT_US_FIELD_NUMBER: _ClassVar[int]
    SESSION_EXPIRY_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_US_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    online: bool
    node: str
    online_at_us: int
    offline_at_us: int
    session_expiry_s: int
    expires_at_us: int
    def __init__(self, clientid: _Optional[str] = ..., online: _Optional[bool] = ..., node: _Optional[str] = ..., online_at_us: _Optional[int] = ..., offline_at_us: _Optional[int] = ..., session_expiry_s: _Optional[int] = ..., expires_at_us: _Optional[int] = ...) -> None: ...

class ClientConnectedRequest(_message.Message):
    __slots__ = ("clientid", "node", "session_expiry_s")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_EXPIRY_S_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    node: str
    session_expiry_s: int
    def __init__(self, clientid: _Optional[str] = ..., node: _Optional[str] = ..., session_expiry_s: _Optional[int] = ...) -> None: ...

class ClientDisconnectedRequest(_message.Message):
    __slots__ = ("clientid", "node", "session_expiry_s")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_EXPIRY_S_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    node: str
    session_expiry_s: int
    def __init__(self, clientid: _Optional[str] = ..., node: _Optional[str] = ..., session_expiry_s: _Optional[int] = ...) -> None: ...

class GetClientStateRequest(_message.Message):
    __slots__ = ("clientid", "stale_ok")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    stale_ok: bool
    def __init__(self, clientid: _Optional[str] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class ClientStateResponse(_message.Message):
    __slots__ = ("found", "state")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    state: ClientState
    def __init__(self, found: _Optional[bool] = ..., state: _Optional[_Union[ClientState, _Mapping]] = ...) -> None: ...

class ClientsOnNodeRequest(_message.Message):
    __slots__ = ("node", "shards", "stale_ok")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    node: str
    shards: _containers.RepeatedScalarFieldContainer[int]
    stale_ok: bool
    def __init__(self, node: _Optional[str] = ..., shards: _Optional[_Iterable[int]] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class ClientsOnNodeResponse(_message.Message):
    __slots__ = ("clientids",)
    CLIENTIDS_FIELD_NUMBER: _ClassVar[int]
    clientids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, clientids: _Optional[_Iterable[str]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("clientid", "topic_filter", "qos")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    topic_filter: str
    qos: int
    def __init__(self, clientid: _Optional[str] = ..., topic_filter: _Optional[str] = ..., qos: _Optional[int] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnsubscribeRequest(_message.Message):
    __slots__ = ("clientid", "topic_filter")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    topic_filter: str
    def __init__(self, clientid: _Optional[str] = ..., topic_filter: _Optional[str] = ...) -> None: ...

class UnsubscribeResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class GetSubscriptionsRequest(_message.Message):
    __slots__ = ("clientid", "stale_ok")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    stale_ok: bool
    def __init__(self, clientid: _Optional[str] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class Subscription(_message.Message):
    __slots__ = ("topic_filter", "qos")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    qos: int
    def __init__(self, topic_filter: _Optional[str] = ..., qos: _Optional[int] = ...) -> None: ...

class GetSubscriptionsResponse(_message.Message):
    __slots__ = ("subscriptions",)
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    subscriptions: _containers.RepeatedCompositeFieldContainer[Subscription]
    def __init__(self, subscriptions: _Optional[_Iterable[_Union[Subscription, _Mapping]]] = ...) -> None: ...

class RetainRequest(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: _storage_pb2.Message
    def __init__(self, message: _Optional[_Union[_storage_pb2.Message, _Mapping]] = ...) -> None: ...

class RetainResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: _storage_pb2.Message
    def __init__(self, message: _Optional[_Union[_storage_pb2.Message, _Mapping]] = ...) -> None: ...

class GetRetainedRequest(_message.Message):
    __slots__ = ("topic_filter", "shards", "stale_ok")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    shards: _containers.RepeatedScalarFieldContainer[int]
    stale_ok: bool
    def __init__(self, topic_filter: _Optional[str] = ..., shards: _Optional[_Iterable[int]] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class GetRetainedResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_storage_pb2.Message]
    def __init__(self, messages: _Optional[_Iterable[_Union[_storage_pb2.Message, _Mapping]]] = ...) -> None: ...

class ReadPosition(_message.Message):
    __slots__ = ("acked_us", "start_us")
    class AckedUsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    ACKED_US_FIELD_NUMBER: _ClassVar[int]
    START_US_FIELD_NUMBER: _ClassVar[int]
    acked_us: _containers.ScalarMap[int, int]
    start_us: int
    def __init__(self, acked_us: _Optional[_Mapping[int, int]] = ..., start_us: _Optional[int] = ...) -> None: ...

class GetReadPositionRequest(_message.Message):
    __slots__ = ("clientid", "topic_filter", "stale_ok")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    topic_filter: str
    stale_ok: bool
    def __init__(self, clientid: _Optional[str] = ..., topic_filter: _Optional[str] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class GetReadPositionResponse(_message.Message):
    __slots__ = ("found", "position")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    found: bool
    position: ReadPosition
    def __init__(self, found: _Optional[bool] = ..., position: _Optional[_Union[ReadPosition, _Mapping]] = ...) -> None: ...

class ReadPositionPair(_message.Message):
    __slots__ = ("clientid", "topic_filter")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    topic_filter: str
    def __init__(self, clientid: _Optional[str] = ..., topic_filter: _Optional[str] = ...) -> None: ...

class ReadPositionsRequest(_message.Message):
    __slots__ = ("pairs", "stale_ok")
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    pairs: _containers.RepeatedCompositeFieldContainer[ReadPositionPair]
    stale_ok: bool
    def __init__(self, pairs: _Optional[_Iterable[_Union[ReadPositionPair, _Mapping]]] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class PairReadPosition(_message.Message):
    __slots__ = ("clientid", "topic_filter", "found", "started", "position")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    topic_filter: str
    found: bool
    started: bool
    position: ReadPosition
    def __init__(self, clientid: _Optional[str] = ..., topic_filter: _Optional[str] = ..., found: _Optional[bool] = ..., started: _Optional[bool] = ..., position: _Optional[_Union[ReadPosition, _Mapping]] = ...) -> None: ...

class ReadPositionsResponse(_message.Message):
    __slots__ = ("positions",)
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedCompositeFieldContainer[PairReadPosition]
    def __init__(self, positions: _Optional[_Iterable[_Union[PairReadPosition, _Mapping]]] = ...) -> None: ...

class FetchMessagesRequest(_message.Message):
    __slots__ = ("topic_filter", "shards", "after_us", "time_range_us", "max_count", "include_qos0", "skip_acked", "stale_ok", "after_all_us")
    class AfterUsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    AFTER_US_FIELD_NUMBER: _ClassVar[int]
    TIME_RANGE_US_FIELD_NUMBER: _ClassVar[int]
    MAX_COUNT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_QOS0_FIELD_NUMBER: _ClassVar[int]
    SKIP_ACKED_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    AFTER_ALL_US_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    shards: _containers.RepeatedScalarFieldContainer[int]
    after_us: _containers.ScalarMap[int, int]
    time_range_us: int
    max_count: int
    include_qos0: bool
    skip_acked: bool
    stale_ok: bool
    after_all_us: int
    def __init__(self, topic_filter: _Optional[str] = ..., shards: _Optional[_Iterable[int]] = ..., after_us: _Optional[_Mapping[int, int]] = ..., time_range_us: _Optional[int] = ..., max_count: _Optional[int] = ..., include_qos0: _Optional[bool] = ..., skip_acked: _Optional[bool] = ..., stale_ok: _Optional[bool] = ..., after_all_us: _Optional[int] = ...) -> None: ...

class FetchMessagesResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_storage_pb2.Message]
    def __init__(self, messages: _Optional[_Iterable[_Union[_storage_pb2.Message, _Mapping]]] = ...) -> None: ...

class SharedFetchSession(_message.Message):
    __slots__ = ("topic_filter", "after_us", "after_all_us", "time_range_us", "max_count", "include_qos0", "skip_acked", "shards")
    class AfterUsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    AFTER_US_FIELD_NUMBER: _ClassVar[int]
    AFTER_ALL_US_FIELD_NUMBER: _ClassVar[int]
    TIME_RANGE_US_FIELD_NUMBER: _ClassVar[int]
    MAX_COUNT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_QOS0_FIELD_NUMBER: _ClassVar[int]
    SKIP_ACKED_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    after_us: _containers.ScalarMap[int, int]
    after_all_us: int
    time_range_us: int
    max_count: int
    include_qos0: bool
    skip_acked: bool
    shards: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, topic_filter: _Optional[str] = ..., after_us: _Optional[_Mapping[int, int]] = ..., after_all_us: _Optional[int] = ..., time_range_us: _Optional[int] = ..., max_count: _Optional[int] = ..., include_qos0: _Optional[bool] = ..., skip_acked: _Optional[bool] = ..., shards: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchMessagesSharedRequest(_message.Message):
    __slots__ = ("shards", "sessions", "stale_ok")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SharedFetchSession]
    stale_ok: bool
    def __init__(self, shards: _Optional[_Iterable[int]] = ..., sessions: _Optional[_Iterable[_Union[SharedFetchSession, _Mapping]]] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class SharedFetchResult(_message.Message):
    __slots__ = ("indexes", "more")
    INDEXES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    indexes: _containers.RepeatedScalarFieldContainer[int]
    more: bool
    def __init__(self, indexes: _Optional[_Iterable[int]] = ..., more: _Optional[bool] = ...) -> None: ...

class FetchMessagesSharedResponse(_message.Message):
    __slots__ = ("messages", "sessions", "shards")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_storage_pb2.Message]
    sessions: _containers.RepeatedCompositeFieldContainer[SharedFetchResult]
    shards: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, messages: _Optional[_Iterable[_Union[_storage_pb2.Message, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SharedFetchResult, _Mapping]]] = ..., shards: _Optional[_Iterable[int]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("clientid", "topic_filter", "mode", "shard", "timestamp_us")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_US_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    topic_filter: str
    mode: DeliveryMode
    shard: int
    timestamp_us: int
    def __init__(self, clientid: _Optional[str] = ..., topic_filter: _Optional[str] = ..., mode: _Optional[_Union[DeliveryMode, str]] = ..., shard: _Optional[int] = ..., timestamp_us: _Optional[int] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForgetReadPositionRequest(_message.Message):
    __slots__ = ("clientid", "topic_filter")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    topic_filter: str
    def __init__(self, clientid: _Optional[str] = ..., topic_filter: _Optional[str] = ...) -> None: ...

class ForgetReadPositionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class StartReadPositionRequest(_message.Message):
    __slots__ = ("clientid", "topic_filter")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    topic_filter: str
    def __init__(self, clientid: _Optional[str] = ..., topic_filter: _Optional[str] = ...) -> None: ...

class StartReadPositionResponse(_message.Message):
    __slots__ = ("started", "position")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    started: bool
    position: ReadPosition
    def __init__(self, started: _Optional[bool] = ..., position: _Optional[_Union[ReadPosition, _Mapping]] = ...) -> None: ...

class ForgetSessionRequest(_message.Message):
    __slots__ = ("clientid",)
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    def __init__(self, clientid: _Optional[str] = ...) -> None: ...

class ForgetSessionResponse(_message.Message):
    __slots__ = ("subscriptions", "read_positions")
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    READ_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    subscriptions: int
    read_positions: int
    def __init__(self, subscriptions: _Optional[int] = ..., read_positions: _Optional[int] = ...) -> None: ...

class ShareGroupRequest(_message.Message):
    __slots__ = ("group", "topic_filter", "member", "lease_s")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    group: str
    topic_filter: str
    member: str
    lease_s: int
    def __init__(self, group: _Optional[str] = ..., topic_filter: _Optional[str] = ..., member: _Optional[str] = ..., lease_s: _Optional[int] = ...) -> None: ...

class ShareGroupResponse(_message.Message):
    __slots__ = ("members", "shards", "position_clientid")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_CLIENTID_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedScalarFieldContainer[str]
    shards: _containers.RepeatedScalarFieldContainer[int]
    position_clientid: str
    def __init__(self, members: _Optional[_Iterable[str]] = ..., shards: _Optional[_Iterable[int]] = ..., position_clientid: _Optional[str] = ...) -> None: ...

class ConsumerPageStart(_message.Message):
    __slots__ = ("shard", "start")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    shard: int
    start: bytes
    def __init__(self, shard: _Optional[int] = ..., start: _Optional[bytes] = ...) -> None: ...

class ListConsumersRequest(_message.Message):
    __slots__ = ("kind", "shards", "starts", "max_count", "clientid", "clientid_prefix", "group", "stale_ok", "lag_cap")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    MAX_COUNT_FIELD_NUMBER: _ClassVar[int]
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    CLIENTID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    LAG_CAP_FIELD_NUMBER: _ClassVar[int]
    kind: ConsumerKind
    shards: _containers.RepeatedScalarFieldContainer[int]
    starts: _containers.RepeatedCompositeFieldContainer[ConsumerPageStart]
    max_count: int
    clientid: str
    clientid_prefix: str
    group: str
    stale_ok: bool
    lag_cap: int
    def __init__(self, kind: _Optional[_Union[ConsumerKind, str]] = ..., shards: _Optional[_Iterable[int]] = ..., starts: _Optional[_Iterable[_Union[ConsumerPageStart, _Mapping]]] = ..., max_count: _Optional[int] = ..., clientid: _Optional[str] = ..., clientid_prefix: _Optional[str] = ..., group: _Optional[str] = ..., stale_ok: _Optional[bool] = ..., lag_cap: _Optional[int] = ...) -> None: ...

class ConsumerSession(_message.Message):
    __slots__ = ("clientid", "has_state", "state", "subscriptions", "shard")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    HAS_STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    has_state: bool
    state: ClientState
    subscriptions: _containers.RepeatedCompositeFieldContainer[Subscription]
    shard: int
    def __init__(self, clientid: _Optional[str] = ..., has_state: _Optional[bool] = ..., state: _Optional[_Union[ClientState, _Mapping]] = ..., subscriptions: _Optional[_Iterable[_Union[Subscription, _Mapping]]] = ..., shard: _Optional[int] = ...) -> None: ...

class ConsumerPosition(_message.Message):
    __slots__ = ("clientid", "topic_filter", "position", "shard")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    topic_filter: str
    position: ReadPosition
    shard: int
    def __init__(self, clientid: _Optional[str] = ..., topic_filter: _Optional[str] = ..., position: _Optional[_Union[ReadPosition, _Mapping]] = ..., shard: _Optional[int] = ...) -> None: ...

class ConsumerShareGroup(_message.Message):
    __slots__ = ("group", "topic_filter", "members", "position_clientid", "has_position", "position", "shard")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    POSITION_CLIENTID_FIELD_NUMBER: _ClassVar[int]
    HAS_POSITION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    group: str
    topic_filter: str
    members: _containers.RepeatedScalarFieldContainer[str]
    position_clientid: str
    has_position: bool
    position: ReadPosition
    shard: int
    def __init__(self, group: _Optional[str] = ..., topic_filter: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., position_clientid: _Optional[str] = ..., has_position: _Optional[bool] = ..., position: _Optional[_Union[ReadPosition, _Mapping]] = ..., shard: _Optional[int] = ...) -> None: ...

class ShardLag(_message.Message):
    __slots__ = ("shard", "messages", "at_least", "oldest_us", "now_us")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    AT_LEAST_FIELD_NUMBER: _ClassVar[int]
    OLDEST_US_FIELD_NUMBER: _ClassVar[int]
    NOW_US_FIELD_NUMBER: _ClassVar[int]
    shard: int
    messages: int
    at_least: bool
    oldest_us: int
    now_us: int
    def __init__(self, shard: _Optional[int] = ..., messages: _Optional[int] = ..., at_least: _Optional[bool] = ..., oldest_us: _Optional[int] = ..., now_us: _Optional[int] = ...) -> None: ...

class ConsumerPush(_message.Message):
    __slots__ = ("call", "peer", "shard", "topic_filter", "position_us", "subscriptions", "first_id", "lag")
    CALL_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    POSITION_US_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    call: int
    peer: str
    shard: int
    topic_filter: str
    position_us: int
    subscriptions: int
    first_id: int
    lag: ShardLag
    def __init__(self, call: _Optional[int] = ..., peer: _Optional[str] = ..., shard: _Optional[int] = ..., topic_filter: _Optional[str] = ..., position_us: _Optional[int] = ..., subscriptions: _Optional[int] = ..., first_id: _Optional[int] = ..., lag: _Optional[_Union[ShardLag, _Mapping]] = ...) -> None: ...

class ListConsumersResponse(_message.Message):
    __slots__ = ("sessions", "positions", "share_groups", "push_subscriptions", "unfinished")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SHARE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PUSH_SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    UNFINISHED_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[ConsumerSession]
    positions: _containers.RepeatedCompositeFieldContainer[ConsumerPosition]
    share_groups: _containers.RepeatedCompositeFieldContainer[ConsumerShareGroup]
    push_subscriptions: _containers.RepeatedCompositeFieldContainer[ConsumerPush]
    unfinished: _containers.RepeatedCompositeFieldContainer[ConsumerPageStart]
    def __init__(self, sessions: _Optional[_Iterable[_Union[ConsumerSession, _Mapping]]] = ..., positions: _Optional[_Iterable[_Union[ConsumerPosition, _Mapping]]] = ..., share_groups: _Optional[_Iterable[_Union[ConsumerShareGroup, _Mapping]]] = ..., push_subscriptions: _Optional[_Iterable[_Union[ConsumerPush, _Mapping]]] = ..., unfinished: _Optional[_Iterable[_Union[ConsumerPageStart, _Mapping]]] = ...) -> None: ...

class LagItem(_message.Message):
    __slots__ = ("topic_filter", "after_us", "after_all_us", "include_qos0")
    class AfterUsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    AFTER_US_FIELD_NUMBER: _ClassVar[int]
    AFTER_ALL_US_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_QOS0_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    after_us: _containers.ScalarMap[int, int]
    after_all_us: int
    include_qos0: bool
    def __init__(self, topic_filter: _Optional[str] = ..., after_us: _Optional[_Mapping[int, int]] = ..., after_all_us: _Optional[int] = ..., include_qos0: _Optional[bool] = ...) -> None: ...

class ConsumerLagRequest(_message.Message):
    __slots__ = ("shards", "items", "cap", "stale_ok")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CAP_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[int]
    items: _containers.RepeatedCompositeFieldContainer[LagItem]
    cap: int
    stale_ok: bool
    def __init__(self, shards: _Optional[_Iterable[int]] = ..., items: _Optional[_Iterable[_Union[LagItem, _Mapping]]] = ..., cap: _Optional[int] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class ItemLag(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardLag]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardLag, _Mapping]]] = ...) -> None: ...

class ConsumerLagResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ItemLag]
    def __init__(self, items: _Optional[_Iterable[_Union[ItemLag, _Mapping]]] = ...) -> None: ...

class DeliveryPolicy(_message.Message):
    __slots__ = ("ack_wait_ms", "max_deliveries", "backoff_ms", "max_unacked", "dead_letter_topic")
    ACK_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_UNACKED_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTER_TOPIC_FIELD_NUMBER: _ClassVar[int]
    ack_wait_ms: int
    max_deliveries: int
    backoff_ms: _containers.RepeatedScalarFieldContainer[int]
    max_unacked: int
    dead_letter_topic: str
    def __init__(self, ack_wait_ms: _Optional[int] = ..., max_deliveries: _Optional[int] = ..., backoff_ms: _Optional[_Iterable[int]] = ..., max_unacked: _Optional[int] = ..., dead_letter_topic: _Optional[str] = ...) -> None: ...

class DeliverRequest(_message.Message):
    __slots__ = ("clientid", "topic_filter", "shards", "policy", "max_count", "queue", "include_qos0", "start_after_us")
    CLIENTID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_COUNT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_QOS0_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_US_FIELD_NUMBER: _ClassVar[int]
    clientid: str
    topic_filter: str
    shards: _containers.RepeatedScalarFieldContainer[int]
    policy: DeliveryPolicy
    max_count: int
    queue: bool
    include_qos0: bool
    start_after_us: int
    def __init__(self, clientid: _Optional[str] = ..., topic_filter: _Optional[str] = ..., shards: _Optional[_Iterable[int]] = ..., policy: _Optional[_Union[DeliveryPolicy, _Mapping]] = ..., max_count: _Optional[int] = ..., queue: _Optional[bool] = ..., include_qos0: _Optional[bool] = ..., start_after_us: _Optional[int] = ...) -> None: ...

class DeliverResponse(_message.Message):
    __slots__ = ("messages", "deliveries", "dead_lettered", "unacked")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    UNACKED_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_storage_pb2.Message]
    deliveries: _containers.RepeatedScalarFieldContainer[int]
    dead_lettered: int
    unacked: int
    def __init__(self, messages: _Optional[_Iterable[_Union[_storage_pb2.Message, _Mapping]]] = ..., deliveries: _Optional[_Iterable[int]] = ..., dead_lettered: _Optional[int] = ..., unacked: _Optional[int] = ...) -> None: ...
