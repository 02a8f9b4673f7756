from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LinkAddressRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkAddressResponse(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class LinkHello(_message.Message):
    __slots__ = ("node_id", "address", "proof")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    proof: bytes
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Envelope]
    def __init__(self, messages: _Optional[_Iterable[_Union[Envelope, _Mapping]]] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("group", "message")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    group: int
    message: RaftMessage
    def __init__(self, group: _Optional[int] = ..., message: _Optional[_Union[RaftMessage, _Mapping]] = ...) -> None: ...

class StreamClosed(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Entry(_message.Message):
    __slots__ = ("command", "index", "term")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    command: bytes
    index: int
    term: int
    def __init__(self, command: _Optional[bytes] = ..., index: _Optional[int] = ..., term: _Optional[int] = ...) -> None: ...

class CommandBatch(_message.Message):
    __slots__ = ("commands",)
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    commands: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, commands: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RequestVote(_message.Message):
    __slots__ = ("term", "last_log_index", "last_log_term", "transfer")
    TERM_FIELD_NUMBER: _ClassVar[int]
    LAST_LOG_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_LOG_TERM_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    term: int
    last_log_index: int
    last_log_term: int
    transfer: bool
    def __init__(self, term: _Optional[int] = ..., last_log_index: _Optional[int] = ..., last_log_term: _Optional[int] = ..., transfer: _Optional[bool] = ...) -> None: ...

class ResponseVote(_message.Message):
    __slots__ = ("term",)
    TERM_FIELD_NUMBER: _ClassVar[int]
    term: int
    def __init__(self, term: _Optional[int] = ...) -> None: ...

class AppendEntries(_message.Message):
    __slots__ = ("term", "commit_index", "prev_log_index", "prev_log_term", "entries")
    TERM_FIELD_NUMBER: _ClassVar[int]
    COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    PREV_LOG_INDEX_FIELD_NUMBER: _ClassVar[int]
    PREV_LOG_TERM_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    term: int
    commit_index: int
    prev_log_index: int
    prev_log_term: int
    entries: _containers.RepeatedCompositeFieldContainer[Entry]
    def __init__(self, term: _Optional[int] = ..., commit_index: _Optional[int] = ..., prev_log_index: _Optional[int] = ..., prev_log_term: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[Entry, _Mapping]]] = ...) -> None: ...

class InstallSnapshot(_message.Message):
    __slots__ = ("term", "commit_index", "has_data", "data", "is_first", "is_last")
    TERM_FIELD_NUMBER: _ClassVar[int]
    COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    HAS_DATA_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    IS_FIRST_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    term: int
    commit_index: int
    has_data: bool
    data: bytes
    is_first: bool
    is_last: bool
    def __init__(self, term: _Optional[int] = ..., commit_index: _Optional[int] = ..., has_data: _Optional[bool] = ..., data: _Optional[bytes] = ..., is_first: _Optional[bool] = ..., is_last: _Optional[bool] = ...) -> None: ...

class NextIndex(_message.Message):
    __slots__ = ("next_index", "reset", "success", "declines_leadership")
    NEXT_INDEX_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    DECLINES_LEADERSHIP_FIELD_NUMBER: _ClassVar[int]
    next_index: int
    reset: bool
    success: bool
    declines_leadership: bool
    def __init__(self, next_index: _Optional[int] = ..., reset: _Optional[bool] = ..., success: _Optional[bool] = ..., declines_leadership: _Optional[bool] = ...) -> None: ...

class ApplyCommand(_message.Message):
    __slots__ = ("command", "request_id", "has_request_id")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    command: bytes
    request_id: int
    has_request_id: bool
    def __init__(self, command: _Optional[bytes] = ..., request_id: _Optional[int] = ..., has_request_id: _Optional[bool] = ...) -> None: ...

class ApplyCommandResponse(_message.Message):
    __slots__ = ("request_id", "log_index", "log_term", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOG_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOG_TERM_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    log_index: int
    log_term: int
    error: int
    def __init__(self, request_id: _Optional[int] = ..., log_index: _Optional[int] = ..., log_term: _Optional[int] = ..., error: _Optional[int] = ...) -> None: ...

class TimeoutNow(_message.Message):
    __slots__ = ("term",)
    TERM_FIELD_NUMBER: _ClassVar[int]
    term: int
    def __init__(self, term: _Optional[int] = ...) -> None: ...

class RaftMessage(_message.Message):
    __slots__ = ("request_vote", "response_vote", "append_entries", "install_snapshot", "next_index", "apply_command", "apply_command_response", "timeout_now", "sequence", "echo")
    REQUEST_VOTE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_VOTE_FIELD_NUMBER: _ClassVar[int]
    APPEND_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    INSTALL_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    NEXT_INDEX_FIELD_NUMBER: _ClassVar[int]
    APPLY_COMMAND_FIELD_NUMBER: _ClassVar[int]
    APPLY_COMMAND_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_NOW_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    request_vote: RequestVote
    response_vote: ResponseVote
    append_entries: AppendEntries
    install_snapshot: InstallSnapshot
    next_index: NextIndex
    apply_command: ApplyCommand
    apply_command_response: ApplyCommandResponse
    timeout_now: TimeoutNow
    sequence: int
    echo: int
    def __init__(self, request_vote: _Optional[_Union[RequestVote, _Mapping]] = ..., response_vote: _Optional[_Union[ResponseVote, _Mapping]] = ..., append_entries: _Optional[_Union[AppendEntries, _Mapping]] = ..., install_snapshot: _Optional[_Union[InstallSnapshot, _Mapping]] = ..., next_index: _Optional[_Union[NextIndex, _Mapping]] = ..., apply_command: _Optional[_Union[ApplyCommand, _Mapping]] = ..., apply_command_response: _Optional[_Union[ApplyCommandResponse, _Mapping]] = ..., timeout_now: _Optional[_Union[TimeoutNow, _Mapping]] = ..., sequence: _Optional[int] = ..., echo: _Optional[int] = ...) -> None: ...

class FetchSnapshotRequest(_message.Message):
    __slots__ = ("group", "min_index")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MIN_INDEX_FIELD_NUMBER: _ClassVar[int]
    group: int
    min_index: int
    def __init__(self, group: _Optional[int] = ..., min_index: _Optional[int] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SnapshotHeader
    chunk: FileChunk
    def __init__(self, header: _Optional[_Union[SnapshotHeader, _Mapping]] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ...) -> None: ...

class SnapshotHeader(_message.Message):
    __slots__ = ("applied_index", "files")
    APPLIED_INDEX_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    applied_index: int
    files: _containers.RepeatedCompositeFieldContainer[SnapshotFile]
    def __init__(self, applied_index: _Optional[int] = ..., files: _Optional[_Iterable[_Union[SnapshotFile, _Mapping]]] = ...) -> None: ...

class SnapshotFile(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("file", "data")
    FILE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    file: int
    data: bytes
    def __init__(self, file: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class MembershipChange(_message.Message):
    __slots__ = ("kind", "node_id")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[MembershipChange.Kind]
        KIND_ADD: _ClassVar[MembershipChange.Kind]
        KIND_REMOVE: _ClassVar[MembershipChange.Kind]
    KIND_UNSPECIFIED: MembershipChange.Kind
    KIND_ADD: MembershipChange.Kind
    KIND_REMOVE: MembershipChange.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    kind: MembershipChange.Kind
    node_id: str
    def __init__(self, kind: _Optional[_Union[MembershipChange.Kind, str]] = ..., node_id: _Optional[str] = ...) -> None: ...

class ChangeMembershipRequest(_message.Message):
    __slots__ = ("group", "kind", "node_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    group: int
    kind: MembershipChange.Kind
    node_id: str
    def __init__(self, group: _Optional[int] = ..., kind: _Optional[_Union[MembershipChange.Kind, str]] = ..., node_id: _Optional[str] = ...) -> None: ...

class ChangeMembershipResponse(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, members: _Optional[_Iterable[str]] = ...) -> None: ...

class TransferLeadershipRequest(_message.Message):
    __slots__ = ("group", "node_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    group: int
    node_id: str
    def __init__(self, group: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class TransferLeadershipResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProposeMetaRequest(_message.Message):
    __slots__ = ("command",)
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    command: bytes
    def __init__(self, command: _Optional[bytes] = ...) -> None: ...

class ProposeMetaResponse(_message.Message):
    __slots__ = ("index",)
    INDEX_FIELD_NUMBER: _ClassVar[int]
    index: int
    def __init__(self, index: _Optional[int] = ...) -> None: ...

class InjectFaultRequest(_message.Message):
    __slots__ = ("blocked_peers",)
    BLOCKED_PEERS_FIELD_NUMBER: _ClassVar[int]
    blocked_peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, blocked_peers: _Optional[_Iterable[str]] = ...) -> None: ...

class InjectFaultResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
