"""The hand-encoded protobuf tags: one wire module per side names them all, each checked against its descriptor.

``mqds.protocol.wire`` holds the client's tags (what clients encode and read
by hand), ``mqds.server.wire`` the node's (its answers, the store command,
Raft frames). Each ``*_TAG`` constant of either must be in ``TAGS`` below with
the field it encodes, and is checked against the generated descriptor: the
field's number and wire type. No other module writes tag bytes of its own,
and the C parts take theirs from the ``wire_tags.h`` that ``proto/generate.py``
writes from the descriptors, checked here too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor
from repo_paths import ROOT

from mqds.protocol import wire as client_wire
from mqds.server import wire as server_wire
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

TAGS: dict[ModuleType, dict[str, tuple[Any, str]]] = {
    client_wire: {
        "MESSAGE_TOPIC_TAG": (pb.Message, "topic"),
        "MESSAGE_PAYLOAD_TAG": (pb.Message, "payload"),
        "MESSAGE_SENDER_TAG": (pb.Message, "sender"),
        "MESSAGE_QOS_TAG": (pb.Message, "qos"),
        "MESSAGE_RETAIN_TAG": (pb.Message, "retain"),
        "MESSAGE_PROPERTIES_TAG": (pb.Message, "properties"),
        "MESSAGE_MESSAGE_EXPIRY_S_TAG": (pb.Message, "message_expiry_s"),
        "USER_PROPERTY_KEY_TAG": (pb.UserProperty, "key"),
        "USER_PROPERTY_VALUE_TAG": (pb.UserProperty, "value"),
        "STORE_BATCH_REQUEST_MESSAGES_TAG": (pb.StoreBatchRequest, "messages"),
        "STORE_BATCH_REQUEST_SYNC_TAG": (pb.StoreBatchRequest, "sync"),
        "STORE_BATCH_REQUEST_PRODUCER_ID_TAG": (pb.StoreBatchRequest, "producer_id"),
        "STORE_BATCH_REQUEST_SEQUENCE_TAG": (pb.StoreBatchRequest, "sequence"),
        "STORE_STREAM_REQUEST_BATCH_TAG": (pb.StoreStreamRequest, "batch"),
        "NEXT_RESPONSE_MESSAGES_TAG": (pb.NextResponse, "messages"),
    },
    server_wire: {
        "MESSAGE_TIMESTAMP_US_TAG": (pb.Message, "timestamp_us"),
        "MESSAGE_SHARD_TAG": (pb.Message, "shard"),
        "MESSAGE_MESSAGE_EXPIRY_S_TAG": (pb.Message, "message_expiry_s"),
        "NEXT_RESPONSE_MESSAGES_TAG": (pb.NextResponse, "messages"),
        "NEXT_RESPONSE_ITERATOR_TAG": (pb.NextResponse, "iterator"),
        "NEXT_RESPONSE_END_OF_STREAM_TAG": (pb.NextResponse, "end_of_stream"),
        "NEXT_RESPONSE_TIMESTAMPS_TAG": (pb.NextResponse, "timestamps"),
        "NEXT_RESPONSE_STREAMS_DONE_TAG": (pb.NextResponse, "streams_done"),
        "FETCH_MESSAGES_RESPONSE_MESSAGES_TAG": (spb.FetchMessagesResponse, "messages"),
        "FETCH_MESSAGES_SHARED_RESPONSE_MESSAGES_TAG": (spb.FetchMessagesSharedResponse, "messages"),
        "FOLLOW_RESPONSE_MESSAGES_TAG": (pb.FollowResponse, "messages"),
        "STORE_STREAM_RESPONSE_SEQUENCE_TAG": (pb.StoreStreamResponse, "sequence"),
        "STORE_STREAM_RESPONSE_RESULT_TAG": (pb.StoreStreamResponse, "result"),
        "STORE_BATCH_RESPONSE_POSITIONS_TAG": (pb.StoreBatchResponse, "positions"),
        "MESSAGE_POSITION_SHARD_TAG": (pb.MessagePosition, "shard"),
        "MESSAGE_POSITION_TIMESTAMP_US_TAG": (pb.MessagePosition, "timestamp_us"),
        "STORE_STREAM_REQUEST_BATCH_TAG": (pb.StoreStreamRequest, "batch"),
        "VNODE_COMMAND_STORE_TAG": (cpb.VnodeCommand, "store"),
        "STORE_MESSAGES_NOW_US_TAG": (cpb.StoreMessages, "now_us"),
        "FRAME_MESSAGES_TAG": (rpb.Frame, "messages"),
        "ENVELOPE_GROUP_TAG": (rpb.Envelope, "group"),
        "ENVELOPE_MESSAGE_TAG": (rpb.Envelope, "message"),
        "RAFT_MESSAGE_APPEND_ENTRIES_TAG": (rpb.RaftMessage, "append_entries"),
        "APPEND_ENTRIES_ENTRIES_TAG": (rpb.AppendEntries, "entries"),
        "ENTRY_COMMAND_TAG": (rpb.Entry, "command"),
        "COMMAND_BATCH_COMMANDS_TAG": (rpb.CommandBatch, "commands"),
    },
}
WIRE_MODULES = {ROOT / "client" / "mqds" / "protocol" / "wire.py", ROOT / "server" / "mqds" / "server" / "wire.py"}
C_HEADERS = [
    ROOT / "client" / "mqds" / "client" / "core" / "wire_tags.h",
    ROOT / "server" / "mqds" / "server" / "wire_tags.h",
]

_F = FieldDescriptor
_WIRE_OF_TYPE = {
    **dict.fromkeys((_F.TYPE_STRING, _F.TYPE_BYTES, _F.TYPE_MESSAGE), 2),
    **dict.fromkeys((_F.TYPE_FIXED64, _F.TYPE_SFIXED64, _F.TYPE_DOUBLE), 1),
    **dict.fromkeys((_F.TYPE_FIXED32, _F.TYPE_SFIXED32, _F.TYPE_FLOAT), 5),
}


def wire_type(field: FieldDescriptor) -> int:
    """How the field comes on the wire: varint 0, fixed64 1, length-delimited 2 (packed repeated too), fixed32 5."""
    return 2 if field.is_packed else _WIRE_OF_TYPE.get(field.type, 0)


def encoded_tag(field: FieldDescriptor) -> bytes:
    """The field's tag as protobuf writes it: the varint of number << 3 | wire type."""
    return client_wire.varint(field.number << 3 | wire_type(field))


def tag_constants(module: ModuleType) -> dict[str, bytes]:
    return {name: value for name, value in vars(module).items() if name.endswith("_TAG") and isinstance(value, bytes)}


@pytest.mark.parametrize("module", list(TAGS), ids=lambda m: m.__name__)
def test_every_tag_of_a_wire_module_is_in_the_table(module: ModuleType) -> None:
    assert set(tag_constants(module)) == set(TAGS[module]), "a new tag gets its field in TAGS, a gone one leaves"


@pytest.mark.parametrize(
    ("module", "name"),
    [(m, name) for m, names in TAGS.items() for name in names],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_each_tag_is_its_fields_number_and_wire_type(module: ModuleType, name: str) -> None:
    message, field_name = TAGS[module][name]
    field = message.DESCRIPTOR.fields_by_name[field_name]
    value = getattr(module, name)
    assert value == encoded_tag(field), (
        f"{module.__name__}.{name} = {value!r}, but {field.full_name} is field {field.number}, "
        f"wire type {wire_type(field)}: {encoded_tag(field)!r}"
    )


def test_the_tags_encode_what_protobuf_writes() -> None:
    """The check itself, against protobuf: a message with one field set serialises to the field's tag first."""
    for module, table in TAGS.items():
        for name, (message, field_name) in table.items():
            field = message.DESCRIPTOR.fields_by_name[field_name]
            one = message()
            if field.type == _F.TYPE_MESSAGE:
                target = getattr(one, field_name).add() if field.is_repeated else getattr(one, field_name)
                target.SetInParent()
            elif field.is_repeated:
                getattr(one, field_name).append(b"x" if field.type == _F.TYPE_BYTES else 1)
            else:
                setattr(
                    one, field_name, {_F.TYPE_STRING: "x", _F.TYPE_BYTES: b"x", _F.TYPE_BOOL: True}.get(field.type, 1)
                )
            written = one.SerializeToString()
            assert written.startswith(getattr(module, name)), f"{module.__name__}.{name}: protobuf writes {written!r}"


# -- no tag bytes elsewhere ------------------------------------------------------------

_VARINT_CALLS = {"varint", "_varint"}
_TAG_TAKERS = {"length_delimited", "encode_messages", "encode_rows", "repeated_field", "times_field"}
_ESCAPES = re.compile(r"[rR]?[bB][rR]?(['\"])(\\x[0-9a-fA-F]{2})+\1")


def _escaped_bytes(node: ast.AST, source: str) -> bool:
    """A bytes literal written as ``\\x`` escapes only, as tags are (not b"D", b"", b"\\xff" in a call alone)."""
    if not (isinstance(node, ast.Constant) and isinstance(node.value, bytes)):
        return False
    return bool(_ESCAPES.fullmatch(ast.get_source_segment(source, node) or ""))


def _hex_int(node: ast.AST, source: str) -> bool:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool)):
        return False
    return (ast.get_source_segment(source, node) or "").lower().startswith("0x")


def _calls(node: ast.AST, names: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in names:
                return True
    return False


def _operands(node: ast.AST) -> list[ast.AST]:
    """The terms of a chain of ``+``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _operands(node.left) + _operands(node.right)
    return [node]


def _names_a_tag(node: ast.AST) -> bool:
    return any(isinstance(sub, ast.Name) and sub.id.endswith("_TAG") for sub in ast.walk(node))


def own_tags(source: str) -> list[str]:
    """Where ``source`` writes protobuf tag bytes itself: ``*_TAG`` names bound to a ``\\x`` bytes literal, a hex
    int or ``bytes((...))``; ``\\x`` literals framed with a varint or a named tag (``b"\\x0a" + varint(n)``, a
    tuple or list of parts); ``\\x`` literals handed to a function that takes a tag."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            named = [t.id for t in targets if isinstance(t, ast.Name) and t.id.upper().endswith("_TAG")]
            literal = value is not None and (
                _escaped_bytes(value, source)
                or _hex_int(value, source)
                or (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "bytes")
            )
            if named and literal:
                found.append(f"line {line}: {named[0]} is a tag of its own")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            terms = _operands(node)
            if any(_escaped_bytes(t, source) for t in terms) and any(
                _calls(t, _VARINT_CALLS) or _names_a_tag(t) for t in terms
            ):
                found.append(f"line {line}: a tag byte written inline beside a varint or a tag")
        elif isinstance(node, ast.Tuple | ast.List):
            if any(_escaped_bytes(e, source) for e in node.elts) and any(_calls(e, _VARINT_CALLS) for e in node.elts):
                found.append(f"line {line}: a tag byte written inline among a field's parts")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in _TAG_TAKERS and _escaped_bytes(node.args[0], source):
                found.append(f"line {line}: a tag byte written inline for {name}")
    return sorted(set(found))


def test_the_scan_finds_tags_written_by_hand_and_nothing_else() -> None:
    """The scan below, on what it must find and what it must leave alone."""
    written_by_hand = [
        '_MESSAGES_TAG = b"\\x0a"',
        "_BATCH_TAG = 0x0A",
        "STORE_TAG = bytes((10,))",
        'head = b"\\x08" + varint(group) + b"\\x12" + varint(len(raw))',
        'parts += (b"\\x0a", varint(len(body)), body)',
        'frame = b"".join((b"\\x0a", varint(size), head))',
        'entry = length_delimited(b"\\x12", value)',
        'end = b"\\x18\\x01" + NEXT_TAG',
    ]
    for source in written_by_hand:
        assert own_tags(source), source
    left_alone = [
        'DATA_TAG = b"D"',
        'INDEX_TAG = b"I"',
        'ACCEPTED = b"\\x01"',
        'trimmed = prefix.rstrip(b"\\xff")',
        "_NO_FIELD = 0xFF",
        "TRUE = varint(1)",
        "key = DATA_TAG + u32(stream)",
        'head = ENVELOPE_GROUP_TAG + varint(group) + b"" + raw',
        "_MESSAGES_TAG = NEXT_RESPONSE_MESSAGES_TAG[0]",
    ]
    for source in left_alone:
        assert not own_tags(source), source


def python_modules() -> list[Path]:
    found = []
    for top in ("client", "server"):
        for path in sorted((ROOT / top / "mqds").rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or path in WIRE_MODULES:
                continue
            found.append(path)
    return found


def test_no_other_module_writes_tag_bytes_of_its_own() -> None:
    bad = {
        str(path.relative_to(ROOT)): hits
        for path in python_modules()
        if (hits := own_tags(path.read_text(encoding="utf-8")))
    }
    assert not bad, f"import the tags from mqds.protocol.wire (client) or mqds.server.wire (node): {bad}"


# -- the C parts ------------------------------------------------------------------------

_DEFINE = re.compile(
    r"^/\* (?P<field>[\w.]+): field \d+, [\w-]+ \*/\n"
    r"#define (?P<p1>\w+)_FIELD (?P<number>\d+)\n"
    r"#define (?P<p2>\w+)_WIRE (?P<wire>\d)\n"
    r"#define (?P<p3>\w+)_TAG 0x(?P<tag>[0-9a-f]{2})$",
    re.M,
)


@pytest.mark.parametrize("header", C_HEADERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_c_headers_match_the_descriptors(header: Path) -> None:
    """What proto/generate.py wrote (its --check says whether it is current): each field's number, wire type and
    tag, under the name the Python constant has."""
    from google.protobuf import descriptor_pool

    text = header.read_text()
    defines = list(_DEFINE.finditer(text))
    assert defines and len(defines) == text.count("#define") // 3
    for m in defines:
        field = descriptor_pool.Default().FindFieldByName(m["field"])
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", field.containing_type.name).upper() + "_" + field.name.upper()
        assert m["p1"] == m["p2"] == m["p3"] == prefix
        assert (int(m["number"]), int(m["wire"])) == (field.number, wire_type(field)), m["field"]
        assert bytes([int(m["tag"], 16)]) == encoded_tag(field), m["field"]


_C_TAG_LITERALS = [
    re.compile(r"\b(?:tag|field)\b[^;{\n]*?[!=]=\s*(?:0x[0-9a-fA-F]+|[1-9][0-9]*)\b"),  # a tag or number compared
    re.compile(r"\bput_bytes\(\s*\w+\s*,\s*(?:0x[0-9a-fA-F]+|[0-9]+)"),  # a length-delimited field written
    re.compile(r"\*\w+\+\+\s*=\s*(?:\(\w+(?:\s+\w+)?\))?\s*0x(?!01\b)[0-9a-fA-F]{2}\s*;"),  # a tag byte written
    re.compile(r"#define\s+\w*TAG\w*\s+0x"),  # a tag of its own
]
_SWITCH = re.compile(r"switch\s*\(\s*\(?\s*(?:tag|field)\b[^)]*\)\s*\{")
_CASE_NUMBER = re.compile(r"\bcase\s+(?:0x[0-9a-fA-F]+|[1-9][0-9]*)\s*:")


def _numbered_cases(text: str) -> list[str]:
    """``case 1:`` in a switch on a tag or a field number: fields told apart by a number written here."""
    found = []
    for m in _SWITCH.finditer(text):
        depth, end = 1, m.end()
        while depth and end < len(text):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        found += [c.group(0) for c in _CASE_NUMBER.finditer(text, m.end(), end)]
    return found


@pytest.mark.parametrize(
    "source",
    sorted(p for top in ("client", "server") for p in (ROOT / top / "mqds").rglob("*.c")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_c_parts_take_their_tags_from_the_generated_header(source: Path) -> None:
    text = source.read_text()
    uses_protobuf = "varint" in text
    if uses_protobuf:
        assert '#include "wire_tags.h"' in text
        assert (source.parent / "wire_tags.h") in C_HEADERS
    bad = [
        f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for r in _C_TAG_LITERALS
        for m in r.finditer(text)
    ]
    bad += _numbered_cases(text)
    assert not bad, f"{source.name} writes tags of its own; name them from wire_tags.h (proto/generate.py): {bad}"
