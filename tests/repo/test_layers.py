"""Imports run one way: api -> cluster -> raft -> storage inside the node, and each package imports only the
packages it is installed with (the client library nothing but itself).

Every import counts, those under ``TYPE_CHECKING`` too: a layer that names a
higher one's types depends on it all the same. The node package above the
API (``mqds.server.node``: the composition root and what it wires: hosting,
health, maintenance, snapshots, the ``mqds-server`` command) may import every
layer; a few base modules (settings, TLS, authentication, durable files, the
shared wire encoding, the choice of C parts) may be imported from anywhere and
import no layer themselves. No other module lies loose in ``mqds.server``.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from repo_paths import ROOT

SOURCES = ("client", "cli", "broker", "spark", "server", "tools", "chaos", "bench")
PACKAGES = {name: ROOT / name for name in SOURCES}

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
# The composition root and the parts it wires, above every layer.
NODE = "mqds.server.node"
TOP = 4


def modules_of(root: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in (root / "mqds").rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        found[name] = path
    return found


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in PACKAGES.values():
        found |= modules_of(root)
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
    if module == NODE or module.startswith(NODE + "."):
        return TOP
    raise AssertionError(f"{module} is in no layer: classify it (test_every_server_module_has_its_place)")


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


def test_every_server_module_has_its_place() -> None:
    """Directly under ``mqds.server`` lie the layers, the node package, the base modules and metrics, nothing else:
    a new module goes into one of the packages, or is classified here (``BASE``, ``LEVEL``) with its reason."""
    children = {".".join(name.split(".")[:3]) for name in ALL if name.startswith("mqds.server.")}
    classified = set(LAYERS) | {NODE} | BASE | set(LEVEL)
    assert children <= classified, f"unclassified modules in mqds.server: {sorted(children - classified)}"
    assert classified <= children, f"classified but gone: {sorted(classified - children)}"


LIBRARY = {"mqds.client", "mqds.protocol", "mqds.v1"}
# What each package's modules may import besides themselves: the packages its distribution depends on
# (the pyproject.toml of each directory). The library imports nothing else; the command line, the broker
# integrations, the Spark source and the node build on the library alone; the development tools, the
# chaos runner and the benchmarks drive real nodes.
MAY_IMPORT = {
    "mqds.v1": set(),
    "mqds.protocol": {"mqds.v1"},
    "mqds.client": LIBRARY,
    "mqds.cli": LIBRARY,
    "mqds.broker": LIBRARY,
    "mqds.spark": LIBRARY,
    "mqds.server": {"mqds.protocol", "mqds.v1"},
    "mqds.tools": LIBRARY | {"mqds.server", "mqds.cli"},
    "mqds.chaos": LIBRARY | {"mqds.server", "mqds.tools"},
    "mqds.bench": LIBRARY | {"mqds.server", "mqds.tools", "mqds.cli", "mqds.broker", "mqds.spark"},
}


def commands() -> set[str]:
    """The modules that add a command to the command line (``mqds.commands`` entry points), from each package's
    pyproject.toml: they come with the package's ``cli`` extra and may import the command line."""
    found = set()
    for root in PACKAGES.values():
        meta = tomllib.loads((root / "pyproject.toml").read_text()) if (root / "pyproject.toml").exists() else {}
        points = meta.get("project", {}).get("entry-points", {}).get("mqds.commands", {})
        found |= {value.partition(":")[0] for value in points.values()}
    return found


COMMANDS = commands()


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


@pytest.mark.parametrize("name", sorted(ALL))
def test_each_package_imports_only_what_it_is_installed_with(name: str) -> None:
    mine = package(name)
    allowed = {mine} | MAY_IMPORT[mine] | ({"mqds.cli"} if name in COMMANDS else set())
    bad = [f"line {line}: {imported}" for line, imported in imports(ALL[name]) if package(imported) not in allowed]
    assert not bad, f"{name} ({mine}) imports a package it is not installed with: {bad}"


def test_every_package_has_its_rule_and_its_directory_only_its_package() -> None:
    """A new package gets a rule here, and no directory carries another's modules (the client wheel is the
    library alone)."""
    assert {package(name) for name in ALL} == set(MAY_IMPORT)
    for source, root in PACKAGES.items():
        inside = {package(name) for name in modules_of(root)}
        expected = LIBRARY if source == "client" else {f"mqds.{source}"}
        assert inside == expected, f"{source}/ holds {sorted(inside)}"


def test_the_commands_of_other_packages_are_entry_points_the_command_line_knows() -> None:
    from mqds.cli import plugins

    named = {}
    for root in PACKAGES.values():
        path = root / "pyproject.toml"
        if path.exists():
            named |= tomllib.loads(path.read_text()).get("project", {}).get("entry-points", {}).get("mqds.commands", {})
    assert set(named) == set(plugins.KNOWN), "each plugin command is in mqds.cli.plugins.KNOWN, and only those"


def _edges(name: str) -> set[str]:
    """The modules ``name`` imports (those under TYPE_CHECKING too): ``from package import module`` names the
    module, not the package, and a C extension beside its Python (``_store_frames``) imports nothing back."""
    targets: list[str] = []
    for node in ast.walk(ast.parse(ALL[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            home = ALL.get(node.module)
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in ALL:
                    targets.append(full)
                elif home is None or not (home.parent / f"{alias.name}.c").exists():
                    targets.append(node.module)
    edges = {owner(target, ALL) for target in targets if target.startswith("mqds.")}
    return {edge for edge in edges if edge and edge != name}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of nodes that reach each other, directly or around a loop (Tarjan's strongly connected
    components), those of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(start: str) -> None:  # iterative: the graph is deep enough for Python's recursion limit
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def cycles() -> list[list[str]]:
    return strongly_connected({name: _edges(name) for name in ALL})


def test_no_modules_import_each_other() -> None:
    """No import cycle, those under TYPE_CHECKING included: a module that needs another's type where that one
    needs it back takes a Protocol of what it uses, or the shared part moves to a module of its own."""
    assert cycles() == []


def test_the_cycle_check_finds_loops_and_only_loops() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"g"}, "g": {"f"}, "h": {"a"}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["f", "g"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    # An import under TYPE_CHECKING is an edge: batch imports model, whatever model imports.
    assert "mqds.client.model" in _edges("mqds.client.batch")
