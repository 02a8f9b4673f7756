from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UserProperty(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("topic", "payload", "sender", "qos", "retain", "properties", "timestamp_us", "shard", "message_expiry_s")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_US_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_EXPIRY_S_FIELD_NUMBER: _ClassVar[int]
    topic: str
    payload: bytes
    sender: str
    qos: int
    retain: bool
    properties: _containers.RepeatedCompositeFieldContainer[UserProperty]
    timestamp_us: int
    shard: int
    message_expiry_s: int
    def __init__(self, topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., sender: _Optional[str] = ..., qos: _Optional[int] = ..., retain: _Optional[bool] = ..., properties: _Optional[_Iterable[_Union[UserProperty, _Mapping]]] = ..., timestamp_us: _Optional[int] = ..., shard: _Optional[int] = ..., message_expiry_s: _Optional[int] = ...) -> None: ...

class StoreBatchRequest(_message.Message):
    __slots__ = ("messages", "sync", "producer_id", "sequence")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    sync: bool
    producer_id: str
    sequence: int
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., sync: _Optional[bool] = ..., producer_id: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...

class StoreStreamRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: StoreBatchRequest
    def __init__(self, batch: _Optional[_Union[StoreBatchRequest, _Mapping]] = ...) -> None: ...

class StoreStreamResponse(_message.Message):
    __slots__ = ("sequence", "result")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    result: StoreBatchResponse
    def __init__(self, sequence: _Optional[int] = ..., result: _Optional[_Union[StoreBatchResponse, _Mapping]] = ...) -> None: ...

class MessagePosition(_message.Message):
    __slots__ = ("shard", "timestamp_us")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_US_FIELD_NUMBER: _ClassVar[int]
    shard: int
    timestamp_us: int
    def __init__(self, shard: _Optional[int] = ..., timestamp_us: _Optional[int] = ...) -> None: ...

class StoreBatchResponse(_message.Message):
    __slots__ = ("positions", "failures", "message_failures")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedCompositeFieldContainer[MessagePosition]
    failures: _containers.RepeatedCompositeFieldContainer[ShardFailure]
    message_failures: _containers.RepeatedCompositeFieldContainer[MessageFailure]
    def __init__(self, positions: _Optional[_Iterable[_Union[MessagePosition, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[ShardFailure, _Mapping]]] = ..., message_failures: _Optional[_Iterable[_Union[MessageFailure, _Mapping]]] = ...) -> None: ...

class MessageFailure(_message.Message):
    __slots__ = ("index", "reason", "message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    reason: str
    message: str
    def __init__(self, index: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ShardFailure(_message.Message):
    __slots__ = ("shard", "reason", "message", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SHARD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    shard: int
    reason: str
    message: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, shard: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Rank(_message.Message):
    __slots__ = ("shard", "generation")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    shard: int
    generation: int
    def __init__(self, shard: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class Stream(_message.Message):
    __slots__ = ("shard", "generation", "id", "pattern")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    shard: int
    generation: int
    id: int
    pattern: str
    def __init__(self, shard: _Optional[int] = ..., generation: _Optional[int] = ..., id: _Optional[int] = ..., pattern: _Optional[str] = ...) -> None: ...

class GetStreamsRequest(_message.Message):
    __slots__ = ("topic_filter", "start_time_us", "shards", "stale_ok")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    START_TIME_US_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    start_time_us: int
    shards: _containers.RepeatedScalarFieldContainer[int]
    stale_ok: bool
    def __init__(self, topic_filter: _Optional[str] = ..., start_time_us: _Optional[int] = ..., shards: _Optional[_Iterable[int]] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class RankedStream(_message.Message):
    __slots__ = ("rank", "stream")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    rank: Rank
    stream: Stream
    def __init__(self, rank: _Optional[_Union[Rank, _Mapping]] = ..., stream: _Optional[_Union[Stream, _Mapping]] = ...) -> None: ...

class GetStreamsResponse(_message.Message):
    __slots__ = ("streams",)
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    streams: _containers.RepeatedCompositeFieldContainer[RankedStream]
    def __init__(self, streams: _Optional[_Iterable[_Union[RankedStream, _Mapping]]] = ...) -> None: ...

class IteratorToken(_message.Message):
    __slots__ = ("shard", "generation", "state")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    shard: int
    generation: int
    state: bytes
    def __init__(self, shard: _Optional[int] = ..., generation: _Optional[int] = ..., state: _Optional[bytes] = ...) -> None: ...

class MakeIteratorRequest(_message.Message):
    __slots__ = ("stream", "topic_filter", "start_time_us", "stale_ok")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    START_TIME_US_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    stream: Stream
    topic_filter: str
    start_time_us: int
    stale_ok: bool
    def __init__(self, stream: _Optional[_Union[Stream, _Mapping]] = ..., topic_filter: _Optional[str] = ..., start_time_us: _Optional[int] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class MakeIteratorResponse(_message.Message):
    __slots__ = ("iterator",)
    ITERATOR_FIELD_NUMBER: _ClassVar[int]
    iterator: IteratorToken
    def __init__(self, iterator: _Optional[_Union[IteratorToken, _Mapping]] = ...) -> None: ...

class IteratorStart(_message.Message):
    __slots__ = ("stream", "topic_filter", "start_time_us")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    START_TIME_US_FIELD_NUMBER: _ClassVar[int]
    stream: Stream
    topic_filter: str
    start_time_us: int
    def __init__(self, stream: _Optional[_Union[Stream, _Mapping]] = ..., topic_filter: _Optional[str] = ..., start_time_us: _Optional[int] = ...) -> None: ...

class NextRequest(_message.Message):
    __slots__ = ("iterator", "batch_size", "stale_ok", "fence_us", "start", "then")
    ITERATOR_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    FENCE_US_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    THEN_FIELD_NUMBER: _ClassVar[int]
    iterator: IteratorToken
    batch_size: int
    stale_ok: bool
    fence_us: int
    start: IteratorStart
    then: _containers.RepeatedCompositeFieldContainer[IteratorStart]
    def __init__(self, iterator: _Optional[_Union[IteratorToken, _Mapping]] = ..., batch_size: _Optional[int] = ..., stale_ok: _Optional[bool] = ..., fence_us: _Optional[int] = ..., start: _Optional[_Union[IteratorStart, _Mapping]] = ..., then: _Optional[_Iterable[_Union[IteratorStart, _Mapping]]] = ...) -> None: ...

class NextResponse(_message.Message):
    __slots__ = ("messages", "iterator", "end_of_stream", "timestamps", "streams_done")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ITERATOR_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_DONE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    iterator: IteratorToken
    end_of_stream: bool
    timestamps: bytes
    streams_done: int
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., iterator: _Optional[_Union[IteratorToken, _Mapping]] = ..., end_of_stream: _Optional[bool] = ..., timestamps: _Optional[bytes] = ..., streams_done: _Optional[int] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("shard", "generation", "since_us", "until_us", "created_at_us", "current")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SINCE_US_FIELD_NUMBER: _ClassVar[int]
    UNTIL_US_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_US_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    shard: int
    generation: int
    since_us: int
    until_us: int
    created_at_us: int
    current: bool
    def __init__(self, shard: _Optional[int] = ..., generation: _Optional[int] = ..., since_us: _Optional[int] = ..., until_us: _Optional[int] = ..., created_at_us: _Optional[int] = ..., current: _Optional[bool] = ...) -> None: ...

class AddGenerationRequest(_message.Message):
    __slots__ = ("shard", "all_shards", "shards")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ALL_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    all_shards: bool
    shards: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shard: _Optional[int] = ..., all_shards: _Optional[bool] = ..., shards: _Optional[_Iterable[int]] = ...) -> None: ...

class AddGenerationResponse(_message.Message):
    __slots__ = ("generations",)
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ...) -> None: ...

class ListGenerationsRequest(_message.Message):
    __slots__ = ("shard", "all_shards", "shards", "stale_ok")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ALL_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    shard: int
    all_shards: bool
    shards: _containers.RepeatedScalarFieldContainer[int]
    stale_ok: bool
    def __init__(self, shard: _Optional[int] = ..., all_shards: _Optional[bool] = ..., shards: _Optional[_Iterable[int]] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class ListGenerationsResponse(_message.Message):
    __slots__ = ("generations",)
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ...) -> None: ...

class GetFencesRequest(_message.Message):
    __slots__ = ("shards", "stale_ok")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedScalarFieldContainer[int]
    stale_ok: bool
    def __init__(self, shards: _Optional[_Iterable[int]] = ..., stale_ok: _Optional[bool] = ...) -> None: ...

class Fence(_message.Message):
    __slots__ = ("shard", "timestamp_us", "applied_index", "generations", "estimated_keys")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_US_FIELD_NUMBER: _ClassVar[int]
    APPLIED_INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_KEYS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    timestamp_us: int
    applied_index: int
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    estimated_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shard: _Optional[int] = ..., timestamp_us: _Optional[int] = ..., applied_index: _Optional[int] = ..., generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., estimated_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class GetFencesResponse(_message.Message):
    __slots__ = ("fences",)
    FENCES_FIELD_NUMBER: _ClassVar[int]
    fences: _containers.RepeatedCompositeFieldContainer[Fence]
    def __init__(self, fences: _Optional[_Iterable[_Union[Fence, _Mapping]]] = ...) -> None: ...

class DropGenerationRequest(_message.Message):
    __slots__ = ("shard", "generation")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    shard: int
    generation: int
    def __init__(self, shard: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class DropGenerationResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: Generation
    def __init__(self, dropped: _Optional[_Union[Generation, _Mapping]] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("start", "credit", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: FollowStart
    credit: FollowCredit
    cancel: int
    def __init__(self, start: _Optional[_Union[FollowStart, _Mapping]] = ..., credit: _Optional[_Union[FollowCredit, _Mapping]] = ..., cancel: _Optional[int] = ...) -> None: ...

class FollowStart(_message.Message):
    __slots__ = ("id", "topic_filter", "shard", "after_us", "start_time_us", "credit", "stale_ok", "shared_answers", "also")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    AFTER_US_FIELD_NUMBER: _ClassVar[int]
    START_TIME_US_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    SHARED_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    ALSO_FIELD_NUMBER: _ClassVar[int]
    id: int
    topic_filter: str
    shard: int
    after_us: int
    start_time_us: int
    credit: int
    stale_ok: bool
    shared_answers: bool
    also: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[int] = ..., topic_filter: _Optional[str] = ..., shard: _Optional[int] = ..., after_us: _Optional[int] = ..., start_time_us: _Optional[int] = ..., credit: _Optional[int] = ..., stale_ok: _Optional[bool] = ..., shared_answers: _Optional[bool] = ..., also: _Optional[_Iterable[int]] = ...) -> None: ...

class FollowCredit(_message.Message):
    __slots__ = ("id", "messages", "also")
    ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ALSO_FIELD_NUMBER: _ClassVar[int]
    id: int
    messages: int
    also: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[int] = ..., messages: _Optional[int] = ..., also: _Optional[_Iterable[int]] = ...) -> None: ...

class FollowResponse(_message.Message):
    __slots__ = ("id", "shard", "messages", "position_us", "failure", "also")
    ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    POSITION_US_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    ALSO_FIELD_NUMBER: _ClassVar[int]
    id: int
    shard: int
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    position_us: int
    failure: ShardFailure
    also: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[int] = ..., shard: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., position_us: _Optional[int] = ..., failure: _Optional[_Union[ShardFailure, _Mapping]] = ..., also: _Optional[_Iterable[int]] = ...) -> None: ...

class DeleteMessagesRequest(_message.Message):
    __slots__ = ("shard", "topic_filter", "sender", "since_us", "until_us", "confirm_all", "cursor", "max_steps")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SINCE_US_FIELD_NUMBER: _ClassVar[int]
    UNTIL_US_FIELD_NUMBER: _ClassVar[int]
    CONFIRM_ALL_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    topic_filter: str
    sender: str
    since_us: int
    until_us: int
    confirm_all: bool
    cursor: DeleteCursor
    max_steps: int
    def __init__(self, shard: _Optional[int] = ..., topic_filter: _Optional[str] = ..., sender: _Optional[str] = ..., since_us: _Optional[int] = ..., until_us: _Optional[int] = ..., confirm_all: _Optional[bool] = ..., cursor: _Optional[_Union[DeleteCursor, _Mapping]] = ..., max_steps: _Optional[int] = ...) -> None: ...

class DeleteCursor(_message.Message):
    __slots__ = ("generation", "stream", "next_ts", "until_us")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    NEXT_TS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_US_FIELD_NUMBER: _ClassVar[int]
    generation: int
    stream: int
    next_ts: int
    until_us: int
    def __init__(self, generation: _Optional[int] = ..., stream: _Optional[int] = ..., next_ts: _Optional[int] = ..., until_us: _Optional[int] = ...) -> None: ...

class DeleteMessagesResponse(_message.Message):
    __slots__ = ("shard", "deleted_messages", "deleted_index_keys", "scanned_keys", "steps", "until_us", "cursor")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    DELETED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    DELETED_INDEX_KEYS_FIELD_NUMBER: _ClassVar[int]
    SCANNED_KEYS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_US_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    shard: int
    deleted_messages: int
    deleted_index_keys: int
    scanned_keys: int
    steps: int
    until_us: int
    cursor: DeleteCursor
    def __init__(self, shard: _Optional[int] = ..., deleted_messages: _Optional[int] = ..., deleted_index_keys: _Optional[int] = ..., scanned_keys: _Optional[int] = ..., steps: _Optional[int] = ..., until_us: _Optional[int] = ..., cursor: _Optional[_Union[DeleteCursor, _Mapping]] = ...) -> None: ...

class ExportShardRequest(_message.Message):
    __slots__ = ("shard", "fence_us", "stale_ok", "skip", "max_chunk_bytes")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FENCE_US_FIELD_NUMBER: _ClassVar[int]
    STALE_OK_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    shard: int
    fence_us: int
    stale_ok: bool
    skip: _containers.RepeatedCompositeFieldContainer[ExportedGeneration]
    max_chunk_bytes: int
    def __init__(self, shard: _Optional[int] = ..., fence_us: _Optional[int] = ..., stale_ok: _Optional[bool] = ..., skip: _Optional[_Iterable[_Union[ExportedGeneration, _Mapping]]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class ExportedGeneration(_message.Message):
    __slots__ = ("generation", "since_us", "until_us", "created_at_us", "changes")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SINCE_US_FIELD_NUMBER: _ClassVar[int]
    UNTIL_US_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_US_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    generation: int
    since_us: int
    until_us: int
    created_at_us: int
    changes: int
    def __init__(self, generation: _Optional[int] = ..., since_us: _Optional[int] = ..., until_us: _Optional[int] = ..., created_at_us: _Optional[int] = ..., changes: _Optional[int] = ...) -> None: ...

class ExportShardResponse(_message.Message):
    __slots__ = ("section", "records", "done")
    SECTION_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    section: ExportSection
    records: ExportRecords
    done: ExportDone
    def __init__(self, section: _Optional[_Union[ExportSection, _Mapping]] = ..., records: _Optional[_Union[ExportRecords, _Mapping]] = ..., done: _Optional[_Union[ExportDone, _Mapping]] = ...) -> None: ...

class ExportSection(_message.Message):
    __slots__ = ("column_family", "generation", "skipped")
    COLUMN_FAMILY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    column_family: str
    generation: ExportedGeneration
    skipped: bool
    def __init__(self, column_family: _Optional[str] = ..., generation: _Optional[_Union[ExportedGeneration, _Mapping]] = ..., skipped: _Optional[bool] = ...) -> None: ...

class ExportRecords(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExportDone(_message.Message):
    __slots__ = ("shard", "fence_us", "applied_index", "records", "bytes", "node")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FENCE_US_FIELD_NUMBER: _ClassVar[int]
    APPLIED_INDEX_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    shard: int
    fence_us: int
    applied_index: int
    records: int
    bytes: int
    node: str
    def __init__(self, shard: _Optional[int] = ..., fence_us: _Optional[int] = ..., applied_index: _Optional[int] = ..., records: _Optional[int] = ..., bytes: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class ImportShardRequest(_message.Message):
    __slots__ = ("shard", "begin", "records", "finish", "abandon")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    shard: int
    begin: ImportBegin
    records: ImportRecords
    finish: ImportFinish
    abandon: ImportAbandon
    def __init__(self, shard: _Optional[int] = ..., begin: _Optional[_Union[ImportBegin, _Mapping]] = ..., records: _Optional[_Union[ImportRecords, _Mapping]] = ..., finish: _Optional[_Union[ImportFinish, _Mapping]] = ..., abandon: _Optional[_Union[ImportAbandon, _Mapping]] = ...) -> None: ...

class ImportBegin(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImportRecords(_message.Message):
    __slots__ = ("column_family", "keys", "values")
    COLUMN_FAMILY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    column_family: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, column_family: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ImportFinish(_message.Message):
    __slots__ = ("last_ts",)
    LAST_TS_FIELD_NUMBER: _ClassVar[int]
    last_ts: int
    def __init__(self, last_ts: _Optional[int] = ...) -> None: ...

class ImportAbandon(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImportShardResponse(_message.Message):
    __slots__ = ("shard", "records", "generations")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    records: int
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    def __init__(self, shard: _Optional[int] = ..., records: _Optional[int] = ..., generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ...) -> None: ...
