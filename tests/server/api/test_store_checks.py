"""What a store checks of each message, without a cluster: a bad message fails alone, unknown fields are refused.

``StorageService.start_store`` runs here over stand-in shards that record
the commands proposed, so what is logged can be read back: the request's
own bytes when every message is good, a command rebuilt without the bad
ones otherwise. The scan for fields a stored message must not hold
(``mqds.server.wire.unknown_fields``, C with a protobuf twin) is checked
against protobuf's own unknown fields.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_support import native, printed_with_and_without_pure_python
from pysyncobj import FAIL_REASON

from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.messages import MAX_USER_PROPERTIES, message_problem
from mqds.protocol.sharding import shard_of
from mqds.protocol.wire import encode_message, length_delimited, varint
from mqds.server import wire
from mqds.server.api.storage_service import StorageService
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.raft.futures import Proposal
from mqds.v1 import storage_pb2 as pb

N_SHARDS = 4
NOW = 1_700_000_000_000_000
TOO_MANY = [(f"k{i}", "v") for i in range(MAX_USER_PROPERTIES + 1)]


class Shards:
    """Every shard led here; each proposal recorded and committed at once, its first timestamp 1000 * shard."""

    n_shards = N_SHARDS
    write_timeout_s = 5.0

    def __init__(self) -> None:
        self.commands: dict[int, bytes] = {}
        self.parsed: dict[int, tuple[bytes, Any]] = {}
        """What the proposer handed each shard's replica with its command (``expect_store``)."""

    def leader_vnode(self, shard: int) -> Any:
        def propose(body: bytes) -> Proposal:
            self.commands[shard] = body
            proposal = Proposal(shard)
            proposal.on_result(1000 * (shard + 1), FAIL_REASON.SUCCESS)
            return proposal

        def expect_store(body: bytes, part: Any) -> None:
            self.parsed[shard] = (body, part)

        def unexpect_store(body: bytes) -> None:
            self.parsed.pop(shard, None)

        replica = SimpleNamespace(expect_store=expect_store, unexpect_store=unexpect_store)
        return SimpleNamespace(group=SimpleNamespace(propose=propose), replica=replica)

    def admit_messages(self, shard: int) -> None:
        pass


def service(shards: Shards) -> StorageService:
    return StorageService(shards, max_payload_bytes=100, max_batch_messages=100, max_next_batch=100, clock=lambda: NOW)  # type: ignore[arg-type]


def request_bytes(*messages: bytes) -> bytes:
    return b"".join(length_delimited(b"\x0a", m) for m in messages)


def store(shards: Shards, raw: bytes) -> pb.StoreBatchResponse:
    answer = service(shards).start_store(pb.StoreBatchRequest.FromString(raw), raw).finish(5.0)
    return answer if isinstance(answer, pb.StoreBatchResponse) else pb.StoreBatchResponse.FromString(answer)


def logged(shards: Shards, shard: int) -> list[bytes]:
    """The messages of the command proposed to ``shard``, as they would be stored (their logged bytes)."""
    return list(cpb.VnodeCommandEncoded.FromString(shards.commands[shard]).store.messages)


SENDER = "s"
SHARD = shard_of(SENDER, N_SHARDS)


def good(payload: bytes) -> bytes:
    return encode_message("a/b", payload, SENDER, 1, False)


def test_a_batch_of_good_messages_is_logged_as_it_came() -> None:
    shards = Shards()
    raw = request_bytes(good(b"1"), good(b"2"))
    answer = store(shards, raw)
    assert shards.commands[SHARD] == wire.store_command(raw, NOW)  # the request's own bytes: nothing rebuilt
    assert [p.timestamp_us for p in answer.positions] == [1000 * (SHARD + 1), 1000 * (SHARD + 1) + 1]
    assert not answer.message_failures


@pytest.mark.parametrize(
    ("bad", "reason", "words"),
    [
        (encode_message("a/b", b"p", SENDER, 1, False, TOO_MANY), Reason.INVALID_MESSAGE, "1,025 user properties"),
        (encode_message("a/+", b"p", SENDER, 1, False), Reason.INVALID_TOPIC, "wildcards"),
        (encode_message("a/b", b"x" * 101, SENDER, 1, False), Reason.PAYLOAD_TOO_LARGE, "max_payload_bytes"),
        (encode_message("a/b", b"p", SENDER, 3, False), Reason.INVALID_MESSAGE, "qos must be 0, 1 or 2"),
        (good(b"p") + b"\x22\x01\x01", Reason.INVALID_MESSAGE, "field 4 (qos) came as wire type 2"),
        (good(b"p") + b"\x50\x01", Reason.INVALID_MESSAGE, "field 10 (wire type 0 (varint)) is not a field"),
    ],
)
def test_a_bad_message_fails_alone_and_the_command_is_rebuilt_without_it(
    bad: bytes, reason: Reason, words: str
) -> None:
    shards = Shards()
    answer = store(shards, request_bytes(good(b"1"), bad, good(b"2")))
    first = 1000 * (SHARD + 1)
    assert [(p.shard, p.timestamp_us) for p in answer.positions] == [(SHARD, first), (SHARD, 0), (SHARD, first + 1)]
    (failure,) = answer.message_failures
    assert (failure.index, failure.reason) == (1, reason.value) and words in failure.message
    assert not answer.failures
    assert logged(shards, SHARD) == [good(b"1"), good(b"2")]


def test_bad_messages_of_several_shards_each_fail_alone() -> None:
    shards = Shards()
    senders = [f"s{i}" for i in range(12)]
    messages = [encode_message("t", b"p", s, 0, False, TOO_MANY if i % 3 == 0 else ()) for i, s in enumerate(senders)]
    answer = store(shards, request_bytes(*messages))
    assert [f.index for f in answer.message_failures] == [0, 3, 6, 9]
    for i, (sender, position) in enumerate(zip(senders, answer.positions, strict=True)):
        assert position.shard == shard_of(sender, N_SHARDS) and (position.timestamp_us == 0) == (i % 3 == 0)
    stored = [m for shard in shards.commands for m in logged(shards, shard)]
    assert sorted(stored) == sorted(m for i, m in enumerate(messages) if i % 3)


def test_a_call_of_only_bad_messages_fails_with_the_first_ones_error() -> None:
    raw = request_bytes(encode_message("a/#", b"", SENDER, 0, False), good(b"") + b"\x22\x00")
    with pytest.raises(MqdsError) as err:
        store(Shards(), raw)
    assert err.value.reason is Reason.INVALID_TOPIC and err.value.message.startswith("message 0: ")


def test_node_and_client_apply_one_set_of_rules() -> None:
    """The client checks a message with the same function before it joins a batch (all but the payload's limit,
    which is the node's)."""
    from mqds.client.core.pipeline_calls import check_messages
    from mqds.client.model import Message

    batch = [Message("a/b", b"x", "s"), Message("a/b", b"x", "s", properties=TOO_MANY), Message("#", b"", "s")]
    refused = check_messages(batch)
    assert sorted(refused) == [1, 2]
    for index, err in refused.items():
        m = batch[index]
        assert (err.reason, err.message) == (
            message_problem(m.topic, m.payload, m.sender, m.qos, m.properties)[0],  # type: ignore[index]
            f"message {index}: {message_problem(m.topic, m.payload, m.sender, m.qos, m.properties)[1]}",  # type: ignore[index]
        )


# -- the scan for unknown fields, against protobuf's ----------------------------------------------------------


def _field(number: int, wire_type: int, value: bytes) -> bytes:
    return varint(number << 3 | wire_type) + value


_VALUES = {
    0: st.integers(0, 2**64 - 1).map(varint),
    1: st.binary(min_size=8, max_size=8),
    2: st.text(max_size=4).map(lambda t: varint(len(t.encode())) + t.encode()),
    5: st.binary(min_size=4, max_size=4),
}
_strays = st.lists(
    st.tuples(st.sampled_from([*range(1, 12), 99, 3000]), st.sampled_from(sorted(_VALUES))).flatmap(
        lambda nw: _VALUES[nw[1]].map(lambda v: _field(nw[0], nw[1], v))
    ),
    max_size=3,
)
_properties = st.lists(st.tuples(st.text(max_size=3), st.text(max_size=3), _strays), max_size=3)


def _message(topic: str, strays: list[bytes], properties: list[tuple[str, str, list[bytes]]]) -> bytes:
    body = encode_message(topic or "t", b"p", "s", 1, False) + b"".join(strays)
    for key, value, extra in properties:
        prop = pb.UserProperty(key=key, value=value).SerializeToString() + b"".join(extra)
        body += _field(6, 2, varint(len(prop)) + prop)
    return body


_NATIVE = native("mqds.server._wire_native")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=4), _strays, _properties), max_size=5), st.booleans())
def test_the_c_scan_finds_what_protobuf_keeps_as_unknown_fields(
    messages: list[tuple[str, list[bytes], list[tuple[str, str, list[bytes]]]]], producer: bool
) -> None:
    raw = request_bytes(*(_message(*m) for m in messages))
    if producer:
        raw += pb.StoreBatchRequest(producer_id="p", sequence=2, sync=True).SerializeToString()
    try:
        pb.StoreBatchRequest.FromString(raw)
    except Exception:  # a stray string that is not UTF-8: the node refuses such a request whole
        return
    expected = wire.unknown_fields_python(raw)
    assert wire.unknown_fields(raw) == expected
    for found in expected:
        assert wire.unknown_field_text(found)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=30), max_size=4))
def test_messages_of_any_bytes_that_parse_are_scanned_as_protobuf_reads_them(bodies: list[bytes]) -> None:
    raw = request_bytes(*bodies)
    try:
        pb.StoreBatchRequest.FromString(raw)
    except Exception:  # the node refuses it whole (MALFORMED_REQUEST) before any scan
        return
    assert wire.unknown_fields(raw) == wire.unknown_fields_python(raw)


def test_the_scan_of_a_request_without_unknown_fields_finds_none() -> None:
    raw = request_bytes(good(b"1"), encode_message("a", b"", "s", 2, True, [("k", "v")])) + b"\x10\x01"
    assert wire.unknown_fields(raw) == [] == wire.unknown_fields_python(raw)


def test_a_group_beside_the_messages_leaves_the_scan_to_protobuf() -> None:
    """The C scan does not skip groups; it says so (None) and the check asks protobuf instead."""
    raw = request_bytes(good(b"1"), good(b"2") + b"\x22\x00") + _field(9, 3, b"") + _field(9, 4, b"")
    if _NATIVE is not None:
        assert _NATIVE.unknown_fields(raw, wire._MESSAGE_TYPES, wire._PROPERTY_FIELD, wire._PROPERTY_TYPES) is None
    assert wire.unknown_fields(raw) == [(1, 0, 4, 2)]


def test_the_c_scan_is_used_unless_pure_python_is_asked_for() -> None:
    code = "from mqds.server import wire; print(wire._UNKNOWN_FIELDS_C is not None)"
    runs = printed_with_and_without_pure_python(code)
    assert runs[True] == ["False"] and runs[False] == ["True"]


def test_bytes_that_do_not_parse_are_a_value_error() -> None:
    if _NATIVE is None:
        pytest.skip("no C scan here")
    for raw in (b"\x0a\x05ab", b"\x0a\x02\x20\xff", b"\xff"):
        with pytest.raises(ValueError, match="parse"):
            _NATIVE.unknown_fields(raw, wire._MESSAGE_TYPES, wire._PROPERTY_FIELD, wire._PROPERTY_TYPES)
