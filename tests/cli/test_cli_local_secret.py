"""After `mqds cluster up`, the README's admin commands work as written: no secret flag, no environment.

`mqds cluster up` records its random secret in DIR/cluster.json; the admin commands used to read it only
from --cluster-secret-file or $MQDS_CLUSTER_SECRET, so `mqds retention set` answered UNAUTHENTICATED.
They now find the local cluster in --data-dir (default $MQDS_CLUSTER_DIR, else data/cluster, where
`mqds cluster up` puts it) and present its secret to its own nodes only.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import MQDS
from repo_paths import ROOT

from mqds.tools.local_cluster import LocalCluster
from mqds.tools.ports import free_port, free_port_block

pytestmark = [pytest.mark.integration, pytest.mark.slow]

README = ROOT / "README.md"
N_SHARDS = 4


@dataclass
class Run:
    code: int
    out: str
    err: str


def mqds(*args: str, cwd: Path, timeout_s: float = 120) -> Run:
    """`mqds ARGS` in ``cwd``, in an environment without any secret, token or cluster directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MQDS_") or k == "MQDS_PORT_SHARE"}
    with subprocess.Popen(
        [MQDS, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"mqds {' '.join(args)} still running after {timeout_s} s:\n{out}\n{err}") from None
    assert "Traceback" not in err, err
    return Run(proc.returncode, out, err)


def readme_admin_commands() -> list[list[str]]:
    """The README's admin command lines (after its "Admin calls" comment), as argument lists."""
    block = README.read_text().split("# Admin calls", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.splitlines()[1:]:
        words = shlex.split(line, comments=True)
        if words:
            assert words[0] == ".venv/bin/mqds", line
            commands.append(words[1:])
    assert {c[0] for c in commands} >= {"retention", "delete"}, commands
    return commands


@dataclass
class Started:
    home: Path  # where `mqds cluster up` ran
    endpoints: str


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    home = tmp_path_factory.mktemp("secret-home")
    base = free_port_block(3)
    try:
        up = mqds("cluster", "up", "--base-port", str(base), "--shards", str(N_SHARDS), cwd=home)
        assert up.code == 0, up.out + up.err
        assert (home / "data" / "cluster" / "cluster.json").is_file(), "the default directory"
        assert "present its secret from cluster.json as they are, from this directory" in up.out, up.out
        yield Started(home, ",".join(f"127.0.0.1:{base + i}" for i in range(3)))
    finally:
        if LocalCluster.recorded(home / "data" / "cluster"):
            mqds("cluster", "down", cwd=home)
            LocalCluster.load(home / "data" / "cluster").kill_all()


def test_readme_admin_commands_work_after_cluster_up(started: Started) -> None:
    endpoints = ("--endpoints", started.endpoints)
    stored = mqds(*endpoints, "pub", "sensor/1/temp", "-m", "21.5", "-m", "22.0", "--sender", "dev-1", cwd=started.home)
    assert stored.code == 0, stored.err
    for command in readme_admin_commands():
        done = mqds(*endpoints, *command, cwd=started.home)
        assert done.code == 0, (command, done.out, done.err)
    assert "sensor/#" in mqds(*endpoints, "retention", "show", cwd=started.home).out
    added = mqds(*endpoints, "generations", "add", "--shard", "1", cwd=started.home)
    assert added.code == 0 and "started 1 new generation" in added.out, added.err
    rebalanced = mqds(*endpoints, "admin", "rebalance", cwd=started.home)
    assert rebalanced.code == 0, rebalanced.err
    # And `mqds cluster down` (then up) needs no --data-dir either: exercised by the fixture's teardown.


def test_elsewhere_the_directory_is_named_and_the_secret_stays_with_its_nodes(started: Started, tmp_path: Path) -> None:
    endpoints = ("--endpoints", started.endpoints)
    # From another directory there is no data/cluster: UNAUTHENTICATED, with what was sent and what to do.
    refused = mqds(*endpoints, "retention", "set", "x/#=1d", cwd=tmp_path)
    assert refused.code == 1 and "UNAUTHENTICATED" in refused.err, refused.err
    assert "this command sent no token and no cluster secret" in refused.err
    assert "present the cluster secret" in refused.err  # the node's words for a missing secret
    assert "--data-dir DIR of a cluster made by 'mqds cluster up'" in refused.err
    cluster_dir = str(started.home / "data" / "cluster")
    named = mqds(*endpoints, "retention", "set", "x/#=1d", "--data-dir", cluster_dir, cwd=tmp_path)
    assert named.code == 0, named.err
    # Never sent to a node that is not the local cluster's (here: nobody listens there).
    stranger = f"127.0.0.1:{free_port()}"
    wrong = mqds("--endpoints", stranger, "retention", "set", "x/#=1d", "--data-dir", cluster_dir, cwd=tmp_path)
    assert wrong.code == 2 and f"--endpoints {stranger} names other nodes" in wrong.err, wrong.err
    # In the default directory, a stranger's endpoint simply gets no secret (and, here, no answer).
    skipped = mqds("--endpoints", stranger, "--timeout", "2", "retention", "set", "x/#=1d", cwd=started.home)
    assert skipped.code == 1 and "UNAVAILABLE" in skipped.err, skipped.err
    missing = mqds(*endpoints, "retention", "set", "x/#=1d", "--data-dir", str(tmp_path / "none"), cwd=tmp_path)
    assert missing.code == 2 and "no cluster made by 'mqds cluster up' there" in missing.err
    # A wrong secret on purpose: refused, and the message says which secret was sent.
    secret_file = tmp_path / "wrong-secret"
    secret_file.write_text("not-the-secret-0123456789")
    wrong_secret = mqds(*endpoints, "generations", "add", "--cluster-secret-file", str(secret_file), cwd=started.home)
    assert wrong_secret.code == 1, wrong_secret.err
    assert "UNAUTHENTICATED" in wrong_secret.err, wrong_secret.err
    # The node tells a wrong secret apart from a missing one (it once gave both the same words).
    assert "the cluster secret presented is not this cluster's" in wrong_secret.err, wrong_secret.err
    assert "present the cluster secret" not in wrong_secret.err
    assert f"this command sent the cluster secret of --cluster-secret-file {secret_file}" in wrong_secret.err
    state = json.loads((started.home / "data" / "cluster" / "cluster.json").read_text())
    assert state["secret"] not in refused.err + named.err + wrong.err + wrong_secret.err, "never printed"
