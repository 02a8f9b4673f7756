"""Imports run one way: api -> cluster -> raft -> storage inside the node, and the client never imports the server.

Every import counts, those under ``TYPE_CHECKING`` too: a layer that names a
higher one's types depends on it all the same. The parts of the node above
the API (the composition root and what it wires: hosting, health,
maintenance, snapshots) may import every layer; a few base modules
(settings, TLS, authentication, durable files, the shared wire encoding, the choice of C parts) may be imported
from anywhere and import no layer themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"server": ROOT / "server", "client": ROOT / "client", "chaos": ROOT / "chaos", "tools": ROOT / "tools"}

# Inside mqds.server: a module may import its own layer and the ones below, never one above.
LAYERS = {"mqds.server.storage": 0, "mqds.server.raft": 1, "mqds.server.cluster": 2, "mqds.server.api": 3}
# Imported from anywhere in the server; they import no layer.
BASE = {
    "mqds.server.config",
    "mqds.server.tls",
    "mqds.server.auth",
    "mqds.server.startup",
    "mqds.server.durable",
    "mqds.server.diskusage",
    "mqds.server.wire",
    "mqds.server.native",
}
# Observes the layers below the API and is used by it: the API's level.
LEVEL = {"mqds.server.metrics": 3}
TOP = 4


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in PACKAGES.values():
        for path in (root / "mqds").rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out if name.startswith("mqds.")]


def level(module: str) -> int | None:
    """The layer of a server module (None outside the server, or for the generated protobuf packages)."""
    if not module.startswith("mqds.server.") or ".v1" in module:
        return None
    for prefix, value in {**LEVEL, **LAYERS}.items():
        if module == prefix or module.startswith(prefix + "."):
            return value
    if any(module == base or module.startswith(base + ".") for base in BASE):
        return -1
    return TOP


def owner(module: str, known: dict[str, Path]) -> str | None:
    """The known module an imported name belongs to (``a.b.C`` -> ``a.b``)."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


ALL = modules()


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith("mqds.server.")))
def test_server_layers_import_downwards(name: str) -> None:
    mine = level(name)
    bad = []
    for line, imported in imports(ALL[name]):
        target = owner(imported, ALL)
        theirs = level(target) if target else None
        if mine is None or theirs is None:
            continue
        if (mine == -1 and theirs != -1) or (theirs > mine and theirs != -1):
            bad.append(f"line {line}: {target}")
    assert not bad, f"{name} imports a higher layer: {bad}"


# The development commands of the command line (a local cluster, the benchmarks) start nodes, the
# development tools (the local-cluster harness, the demo, the benchmarks) and the chaos tool drive
# them: they may import the server. Nothing a broker or an application imports may.
DEV_TOOLS = ("mqds.server.", "mqds.chaos", "mqds.tools", "mqds.cli", "mqds.spark.bench", "mqds.bench")


@pytest.mark.parametrize("name", sorted(n for n in ALL if not n.startswith(DEV_TOOLS)))
def test_the_client_side_never_imports_the_server(name: str) -> None:
    bad = [f"line {line}: {imported}" for line, imported in imports(ALL[name]) if imported.startswith("mqds.server")]
    assert not bad, f"{name} imports the server: {bad}"


@pytest.mark.parametrize("name", sorted(n for n in ALL if n.startswith("mqds.protocol")))
def test_the_protocol_imports_only_itself_and_the_api_messages(name: str) -> None:
    bad = [
        f"line {line}: {imported}"
        for line, imported in imports(ALL[name])
        if not imported.startswith(("mqds.protocol", "mqds.v1"))
    ]
    assert not bad, f"{name} imports more than the protocol: {bad}"
