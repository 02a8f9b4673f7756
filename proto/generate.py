"""Generate the Python protobuf and gRPC modules from proto/ into client/.

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
OUT_DIR = ROOT / "client"


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write the generated modules under out_dir; return their paths."""
    from grpc_tools import protoc  # a development dependency only

    files = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    generated = []
    for rel in files:
        stem = pathlib.Path(rel).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            generated.append(out_dir / f"{stem}{suffix}")
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
        for path in generate(OUT_DIR):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for fresh in generate(pathlib.Path(tmp)):
            checked_in = OUT_DIR / fresh.relative_to(tmp)
            if not checked_in.exists() or not filecmp.cmp(fresh, checked_in, shallow=False):
                stale.append(str(checked_in.relative_to(ROOT)))
    if stale:
        print("out of date (run `make proto`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print("generated modules are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
