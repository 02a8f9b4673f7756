"""Generate the Python protobuf and gRPC modules from proto/.

The public API (proto/mqds/v1) goes to client/, since clients need it; EMQX's
ExHook v3 (proto/mqds/broker) to broker/, the package that serves it; the
node-to-node protocol and the replicated commands (proto/mqds/server) go to
server/, beside the packages that own them.

It also writes the C parts' tags: a header beside each C extension that
encodes or parses protobuf by hand (``wire_tags.h``, see ``C_HEADERS``), with
the number, wire type and tag of exactly the fields that C code uses, taken
from the descriptors, so no C file writes a tag byte of its own.

Run `python proto/generate.py` (or `make proto`) after changing a .proto file.
`python proto/generate.py --check` exits non-zero when the checked-in modules
or headers are out of date; the test suite runs that check.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
CLIENT_DIR = ROOT / "client"
BROKER_DIR = ROOT / "broker"
SERVER_DIR = ROOT / "server"


def out_dir_of(rel: pathlib.Path) -> pathlib.Path:
    """Where the modules generated from the .proto file at ``rel`` (relative to proto/) belong."""
    owners = {"server": SERVER_DIR, "broker": BROKER_DIR}
    return owners.get(rel.parts[1], CLIENT_DIR) if rel.parts[0] == "mqds" and len(rel.parts) > 2 else CLIENT_DIR


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


# The fields each side's C parts encode or parse by hand, by message: the header beside them names each one's
# number, wire type and tag. A field the C code starts to use is added here (and the header written again).
C_HEADERS: dict[pathlib.Path, tuple[str, dict[str, tuple[str, ...]]]] = {
    CLIENT_DIR / "mqds" / "client" / "core" / "wire_tags.h": (
        "_store_frames.c (pipelined writes, their answers) and _wire_columns.c (Next answers as columns)",
        {
            "mqds.v1.Message": (
                "topic",
                "payload",
                "sender",
                "qos",
                "retain",
                "properties",
                "timestamp_us",
                "message_expiry_s",
            ),
            "mqds.v1.UserProperty": ("key", "value"),
            "mqds.v1.StoreBatchRequest": ("messages", "sync", "producer_id", "sequence"),
            "mqds.v1.StoreStreamRequest": ("batch",),
            "mqds.v1.StoreStreamResponse": ("sequence", "result"),
            "mqds.v1.StoreBatchResponse": ("positions",),
            "mqds.v1.MessagePosition": ("shard", "timestamp_us"),
            "mqds.v1.NextResponse": ("messages", "iterator", "end_of_stream", "timestamps", "streams_done"),
        },
    ),
    SERVER_DIR / "mqds" / "server" / "wire_tags.h": (
        "_wire_native.c (read answers, the store path's field check, a stored message's expiry interval)",
        {
            "mqds.v1.Message": ("timestamp_us", "message_expiry_s"),
            "mqds.v1.StoreBatchRequest": ("messages",),
        },
    ),
}

_WIRE_NAMES = {0: "varint", 1: "fixed64", 2: "length-delimited", 5: "fixed32"}


def wire_type(field: Any) -> int:
    """The wire type a field is encoded as (a ``FieldDescriptor``): packed repeated scalars are length-delimited."""
    from google.protobuf.descriptor import FieldDescriptor as F

    if field.is_packed:
        return 2
    if field.type in (F.TYPE_STRING, F.TYPE_BYTES, F.TYPE_MESSAGE):
        return 2
    if field.type in (F.TYPE_FIXED64, F.TYPE_SFIXED64, F.TYPE_DOUBLE):
        return 1
    if field.type in (F.TYPE_FIXED32, F.TYPE_SFIXED32, F.TYPE_FLOAT):
        return 5
    if field.type == F.TYPE_GROUP:
        raise ValueError(f"{field.full_name} is a group, which no C part reads")
    return 0


def macro_prefix(message: str, field: str) -> str:
    """``mqds.v1.StoreBatchRequest`` and ``producer_id`` -> ``STORE_BATCH_REQUEST_PRODUCER_ID``."""
    name = message.rpartition(".")[2]
    snake = "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name))
    return f"{snake}_{field}".upper()


def descriptor_pool(work: pathlib.Path) -> Any:
    """The descriptors of every .proto file, compiled afresh (not the checked-in modules')."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_tools import protoc

    out = work / "descriptors.pb"
    args = ["protoc", f"-I{PROTO_DIR}", "--include_imports", f"--descriptor_set_out={out}"]
    if protoc.main(args + [str(p.relative_to(PROTO_DIR)) for p in proto_files()]) != 0:
        raise SystemExit("protoc failed; see the messages above")
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    return pool


def header_text(pool: Any, path: pathlib.Path, users: str, fields: dict[str, tuple[str, ...]]) -> str:
    """The header at ``path``: a number, wire type and tag #define for each field listed."""
    guard = "MQDS_" + path.parent.name.upper() + "_WIRE_TAGS_H"
    lines = [
        "/* Generated by proto/generate.py from the .proto files: do not edit (make proto writes it again).",
        " *",
        " * The protobuf fields the C parts beside this header encode or parse by hand:",
        f" * {users}.",
        " * For each: its number (_FIELD), its wire type (_WIRE: 0 varint, 1 fixed64, 2 length-delimited,",
        " * 5 fixed32) and its tag (_TAG: number << 3 | wire type; one byte for each of these, as the C code",
        " * writes it). tests/repo/test_wire_tags.py checks them against the descriptors.",
        " */",
        f"#ifndef {guard}",
        f"#define {guard}",
    ]
    for message, names in fields.items():
        descriptor = pool.FindMessageTypeByName(message)
        for name in names:
            field = descriptor.fields_by_name[name]
            wire = wire_type(field)
            tag = field.number << 3 | wire
            if tag >= 0x80:
                raise ValueError(f"{field.full_name}'s tag is more than one byte, which the C parts do not write")
            prefix = macro_prefix(message, name)
            lines += [
                "",
                f"/* {field.full_name}: field {field.number}, {_WIRE_NAMES[wire]} */",
                f"#define {prefix}_FIELD {field.number}",
                f"#define {prefix}_WIRE {wire}",
                f"#define {prefix}_TAG 0x{tag:02x}",
            ]
    lines += ["", f"#endif /* {guard} */", ""]
    return "\n".join(lines)


def generate_headers(out_root: pathlib.Path | None = None) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """Write every C header of ``C_HEADERS``; return (written path, checked-in path) pairs.

    With ``out_root`` they are written under it instead of the source tree (for --check).
    """
    written = []
    with tempfile.TemporaryDirectory() as work:
        pool = descriptor_pool(pathlib.Path(work))
        for path, (users, fields) in C_HEADERS.items():
            rel = path.relative_to(ROOT)
            out = path if out_root is None else out_root / "headers" / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(header_text(pool, path, users, fields))
            written.append((out, path))
    return written


def generate(out_root: pathlib.Path | None = None) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """Generate every module; return (written path, checked-in path) pairs.

    With ``out_root`` the modules are written under out_root/client and
    out_root/server instead of the source tree (for --check).
    """
    from grpc_tools import protoc  # a development dependency only

    generated = []
    for proto in proto_files():
        rel = proto.relative_to(PROTO_DIR)
        target = out_dir_of(rel)
        out_dir = target if out_root is None else out_root / target.name
        out_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(rel),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {rel}; see the messages above")
        stem = rel.with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            generated.append((out_dir / f"{stem}{suffix}", target / f"{stem}{suffix}"))
    return generated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if the checked-in generated modules or headers differ from a fresh generation",
    )
    opts = parser.parse_args()
    if not opts.check:
        for path, _ in generate() + generate_headers():
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for fresh, checked_in in generate(pathlib.Path(tmp)) + generate_headers(pathlib.Path(tmp)):
            if not checked_in.exists() or not filecmp.cmp(fresh, checked_in, shallow=False):
                stale.append(str(checked_in.relative_to(ROOT)))
    if stale:
        print("out of date (run `make proto`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print("generated modules and headers are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
