"""Generate the Python protobuf and gRPC modules from proto/.

The public API (proto/mqds/v1) goes to client/, since clients need it; EMQX's
ExHook v3 (proto/mqds/broker) to broker/, the package that serves it; the
node-to-node protocol and the replicated commands (proto/mqds/server) go to
server/, beside the packages that own them.

Run `python proto/generate.py` (or `make proto`) after changing a .proto file.
`python proto/generate.py --check` exits non-zero when the checked-in modules
are out of date; the test suite runs that check.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile

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
        help="do not write; exit 1 if the checked-in generated modules differ from a fresh generation",
    )
    opts = parser.parse_args()
    if not opts.check:
        for path, _ in generate():
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for fresh, checked_in in generate(pathlib.Path(tmp)):
            if not checked_in.exists() or not filecmp.cmp(fresh, checked_in, shallow=False):
                stale.append(str(checked_in.relative_to(ROOT)))
    if stale:
        print("out of date (run `make proto`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print("generated modules are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
