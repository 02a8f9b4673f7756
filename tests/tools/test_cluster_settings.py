"""``mqds cluster up --set NAME=VALUE`` / ``--config FILE``: node settings for a local cluster, checked first."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from harness import MQDS

from mqds.client import Message
from mqds.client import errors as E
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.ports import free_port_block


def up(data_dir: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [MQDS, "cluster", "up", "--data-dir", str(data_dir), *args], capture_output=True, text=True, timeout=timeout_s
    )


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("retention_period_s", "write NAME=VALUE"),
        ("bogus_s=1", "'bogus_s' is not a node setting"),
        ("node_id=x", "mqds cluster up sets node_id itself"),
        ("retention_period_s=soon", "retention_period_s must be a duration"),
        ("max_payload_bytes=-5", "max_payload_bytes"),
    ],
)
def test_a_bad_setting_is_refused_before_any_node_starts(tmp_path: Path, setting: str, says: str) -> None:
    done = up(tmp_path / "c", "--nodes", "1", "--set", setting, timeout_s=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr
    assert not (tmp_path / "c").exists() or not LocalCluster.recorded(tmp_path / "c"), "no cluster was made"


def test_a_settings_file_that_is_not_toml_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "node.toml"
    bad.write_text("retention_period_s = \n")
    done = up(tmp_path / "c", "--nodes", "1", "--config", str(bad), timeout_s=60)
    assert done.returncode == 2 and "not valid TOML" in done.stderr, done.stderr


@pytest.mark.integration
def test_every_node_runs_with_the_settings_and_a_restart_keeps_them(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    settings = tmp_path / "node.toml"
    settings.write_text("max_payload_bytes = 2000\n")
    base = free_port_block(3)
    try:
        started = up(
            data_dir, "--base-port", str(base), "--shards", "4", "--config", str(settings), "--set", "log_level=debug"
        )
        assert started.returncode == 0, started.stdout + started.stderr
        assert "each node with: --config" in started.stdout
        cluster = LocalCluster.load(data_dir)
        with cluster.client(timeout_s=30) as client:
            client.store_batch([Message("set/ok", b"x" * 1_500, sender="s1", qos=1)])
            for sender in ("s1", "s2", "s3", "s4", "s5", "s6"):  # leaders on every node: each has the limit
                with pytest.raises(E.MqdsError, match="over the limit of 2000"):
                    client.store_batch([Message("set/big", b"x" * 3_000, sender=sender, qos=1)])
        # A recorded cluster restarts as it was: other settings are refused rather than ignored.
        other = up(data_dir, "--set", "log_level=info", timeout_s=60)
        assert other.returncode != 0 and "leave --set and --config out" in other.stderr, other.stderr
        assert subprocess.run([MQDS, "cluster", "down", "--data-dir", str(data_dir)], timeout=120).returncode == 0
        again = up(data_dir)
        assert again.returncode == 0, again.stdout + again.stderr
        with LocalCluster.load(data_dir).client(timeout_s=30) as client, pytest.raises(E.MqdsError, match="2000"):
            client.store_batch([Message("set/big/again", b"x" * 3_000, sender="s1", qos=1)])
    finally:
        if LocalCluster.recorded(data_dir):
            subprocess.run([MQDS, "cluster", "down", "--data-dir", str(data_dir)], capture_output=True, timeout=120)
            LocalCluster.load(data_dir).kill_all()
