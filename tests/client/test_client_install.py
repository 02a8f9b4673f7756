"""The client library installs and works alone: no server, command line, broker, Spark or benchmark code."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from harness import ServerProcess
from repo_paths import ROOT

from mqds.cli import plugins

SERVER_ONLY = ("rocksdict", "pysyncobj", "prometheus", "grpcio-health-checking", "grpcio-reflection")

pytestmark = pytest.mark.integration


LIBRARY = ("mqds.client", "mqds.protocol", "mqds.v1")
LOADED = "import sys, mqds.client; print(' '.join(sorted(m for m in sys.modules if m.startswith('mqds.'))))"


def test_importing_the_client_loads_the_library_alone() -> None:
    run = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True, timeout=60, check=True)
    loaded = run.stdout.split()
    assert "mqds.client" in loaded
    assert [m for m in loaded if not m.startswith(LIBRARY)] == []


def test_client_metadata_has_no_server_dependencies() -> None:
    meta = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())
    deps = list(meta["project"]["dependencies"])
    for extra in meta["project"].get("optional-dependencies", {}).values():
        deps += extra
    for name in SERVER_ONLY:
        assert not any(name in dep for dep in deps)


def _copy(name: str, tmp_path: Path) -> Path:
    """A package's directory, copied: building in place would leave build/ in the tree."""
    source = tmp_path / f"{name}-src"
    shutil.copytree(ROOT / name, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return source


def _generated_names() -> tuple[str, ...]:
    """The modules client/generate_sync.py writes into mqds/client/sync/ (its GENERATED)."""
    text = (ROOT / "client" / "generate_sync.py").read_text()
    names = ast.literal_eval(text.split("GENERATED = ", 1)[1].split("\n", 1)[0])
    assert names, "generate_sync.py names the modules it generates"
    return tuple(names)


def _pip(python: Path, *args: str) -> None:
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True, timeout=600
    )
    assert install.returncode == 0, install.stderr[-3000:]


@pytest.mark.slow
def test_client_in_a_fresh_venv_talks_to_a_node(tmp_path: Path, server: ServerProcess) -> None:
    env_dir = tmp_path / "client-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    source = _copy("client", tmp_path)
    # As in a fresh clone: the synchronous client's generated modules are not there; the build writes them.
    generated = [source / "mqds" / "client" / "sync" / name for name in _generated_names()]
    for path in generated:
        path.unlink(missing_ok=True)
    _pip(python, str(source))
    pip_list = [str(python), "-m", "pip", "list", "--format", "freeze"]
    listed = {
        line.split("==")[0].lower() for line in subprocess.run(pip_list, capture_output=True, text=True).stdout.split()
    }
    assert "mqds-client" in listed
    for name in (*SERVER_ONLY, "rich", "amqtt", "pyspark", "pyarrow", "mqds-cli", "mqds-broker", "mqds-spark"):
        assert not any(package == name or package.startswith(f"{name}-") for package in listed), name
    script = (
        "from mqds.client import Client, Message\n"
        f"c = Client('{server.address}')\n"
        "c.store_batch([Message(topic='from/venv', payload=b'hi', sender='v')])\n"
        "print([m.payload for m in c.replay('from/#')])\n"
    )
    run = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[b'hi']"
    loaded = subprocess.run([str(python), "-c", LOADED], capture_output=True, text=True, timeout=60).stdout.split()
    assert loaded and [m for m in loaded if not m.startswith(LIBRARY)] == []
    for other in ("mqds.cli", "mqds.broker", "mqds.spark", "mqds.bench", "mqds.tools", "mqds.server"):
        found = subprocess.run([str(python), "-c", f"import {other}"], capture_output=True, text=True, timeout=60)
        assert found.returncode == 1 and "ModuleNotFoundError" in found.stderr, other
    mqds = env_dir / "bin" / "mqds"
    assert not mqds.exists(), "the command line is a package of its own"
    # The command line beside it: its commands, and those of packages not installed say which package brings them.
    _pip(python, str(_copy("cli", tmp_path)))
    replay = subprocess.run(
        [str(mqds), "--endpoints", server.address, "replay", "from/#"], capture_output=True, text=True, timeout=120
    )
    assert replay.returncode == 0 and "  hi  " in replay.stdout, replay.stderr
    for command, (package, _) in plugins.KNOWN.items():
        other = subprocess.run([str(mqds), command, "--help"], capture_output=True, text=True, timeout=120)
        assert other.returncode == 2 and f"comes with the {package} package" in other.stderr, other.stderr
        assert "Traceback" not in other.stderr
