"""The client installs and works without the server's dependencies."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
import venv
from pathlib import Path

import pytest
from harness import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("rocksdict", "pysyncobj", "prometheus", "grpcio-health-checking", "grpcio-reflection")

pytestmark = pytest.mark.integration


def test_client_metadata_has_no_server_dependencies() -> None:
    meta = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())
    deps = list(meta["project"]["dependencies"])
    for extra in meta["project"].get("optional-dependencies", {}).values():
        deps += extra
    for name in SERVER_ONLY:
        assert not any(name in dep for dep in deps)


@pytest.mark.slow
def test_client_in_a_fresh_venv_talks_to_a_node(tmp_path: Path, server: ServerProcess) -> None:
    # Install from a copy: building in place would leave build/ in the tree.
    source = tmp_path / "client-src"
    shutil.copytree(ROOT / "client", source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    env_dir = tmp_path / "client-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([str(python), "-m", "pip", "list"], capture_output=True, text=True, timeout=120).stdout
    for name in SERVER_ONLY:
        assert name not in listed.lower()
    script = (
        "from mqds.client import Client, Message\n"
        f"c = Client('{server.address}')\n"
        "c.store_batch([Message(topic='from/venv', payload=b'hi', sender='v')])\n"
        "print([m.payload for m in c.replay('from/#')])\n"
    )
    run = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[b'hi']"
    # The command line comes with the client; the commands that run nodes say what they need.
    mqds = str(env_dir / "bin" / "mqds")
    replay = subprocess.run(
        [mqds, "--endpoints", server.address, "replay", "from/#"], capture_output=True, text=True, timeout=120
    )
    assert replay.returncode == 0 and "  hi  " in replay.stdout, replay.stderr
    up = subprocess.run(
        [mqds, "cluster", "up", "--data-dir", str(tmp_path / "c")], capture_output=True, text=True, timeout=120
    )
    assert up.returncode == 1 and "needs the server package" in up.stderr and "Traceback" not in up.stderr
