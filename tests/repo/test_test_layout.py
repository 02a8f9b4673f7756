"""The tests mirror the packages: a test of X lives in the folder named after X's package.

A package's unit and integration tests share its folder; the markers (``integration``, ``slow``,
``spark``, ``chaos``), not the folders, say which tier a test is in. Test files are imported by
their base name (pytest's default import mode, no ``__init__.py``), so a name is used once under
tests/. The helpers every folder shares lie in tests/ itself, beside tests/conftest.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import TESTS

# Each folder under tests/ that may hold test files, and what its tests exercise (docs/development.md, "Layout").
FOLDERS = {
    "client": "mqds.client: the sync and asyncio clients, their connection settings, routing, pipeline, backup files",
    "protocol": "mqds.protocol: errors, topic rules, the hand-written wire encoding",
    "cli": "mqds.cli: the mqds command line",
    "broker": "mqds.broker: hook rules, the amqtt plugin, the EMQX ExHook provider",
    "spark": "mqds.spark: the Spark data source and the pipeline job",
    "bench": "mqds.bench: the benchmarks",
    "tools": "mqds.tools: local clusters, ports, bounded waits, the demo",
    "chaos": "mqds.chaos: the chaos runner, its checker, the fault filesystem",
    "deploy": "deploy/ and k8s/: the image, compose, the Kubernetes manifests",
    "server/storage": "mqds.server.storage: one shard in RocksDB",
    "server/raft": "mqds.server.raft: Raft groups, the journal, the transports, group commit",
    "server/cluster": "mqds.server.cluster: metadata, placement, membership, the vnode state machine",
    "server/api": "mqds.server.api: the gRPC services and each public call end to end (Follow, backup, ...)",
    "server/node": "mqds.server.node and the base modules: config, tls, wire, disk usage, metrics, health",
    "repo": "the whole repository: import layers, docs, doctests, wire tags, this layout",
}

# What starts mqds-server processes: a test file importing one of these is marked integration.
NODE_STARTERS = {"LocalCluster", "NodeProcess", "ServerProcess", "run_server", "cluster_up"}


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_every_test_file_lives_in_the_folder_of_its_package() -> None:
    misplaced = [
        str(path.relative_to(TESTS))
        for path in _test_files()
        if path.parent.relative_to(TESTS).as_posix() not in FOLDERS
    ]
    assert not misplaced, f"put these in one of the folders {sorted(FOLDERS)} (or add a folder to FOLDERS): {misplaced}"


def test_every_folder_of_the_table_holds_tests() -> None:
    empty = [folder for folder in FOLDERS if not list((TESTS / folder).glob("test_*.py"))]
    assert not empty, empty


def test_a_test_file_name_is_used_once_and_no_folder_is_a_package() -> None:
    seen: dict[str, Path] = {}
    for path in _test_files():
        assert path.name not in seen, f"{path.relative_to(TESTS)} and {seen[path.name].relative_to(TESTS)}"
        seen[path.name] = path
    assert not list(TESTS.rglob("__init__.py"))


def test_a_test_file_that_starts_nodes_is_marked_integration() -> None:
    """``make test-fast`` leaves out the marker integration, not a folder: a file starting nodes must carry it."""
    unmarked = []
    for path in _test_files():
        text = path.read_text()
        imported = {
            alias.asname or alias.name
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        if imported & NODE_STARTERS and "pytest.mark.integration" not in text:
            unmarked.append(str(path.relative_to(TESTS)))
    assert not unmarked, f"mark these pytest.mark.integration (the module or each test starting nodes): {unmarked}"
