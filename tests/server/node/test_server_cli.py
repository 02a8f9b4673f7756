"""mqds-server as an operator runs it: help, printed config, bad settings, shutdown."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from harness import ServerProcess, run_server

from mqds.client import Client, Message

pytestmark = pytest.mark.integration


def test_help_and_print_config(tmp_path: Path) -> None:
    result = run_server(["--help"])
    assert result.returncode == 0
    for option in ("--node-id", "--listen", "--data-dir", "--config", "--print-config", "--generation-interval-s"):
        assert option in result.stdout
    result = run_server(["--print-config", "--node-id", "n9", "--n-shards", "4"], timeout_s=30)
    assert result.returncode == 0
    assert 'node_id = "n9"' in result.stdout and "n_shards = 4" in result.stdout
    env_result = run_server(["--print-config"])
    assert "retention_period_s = 0.0" in env_result.stdout


def test_unknown_option_and_bad_value(tmp_path: Path) -> None:
    result = run_server(["--bogus"])
    assert result.returncode == 2 and "unrecognized arguments: --bogus" in result.stderr
    result = run_server(["--listen", "localhost", "--data-dir", str(tmp_path)])
    assert result.returncode == 2
    assert "bad configuration" in result.stderr and "host:port" in result.stderr


def test_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_server(["--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "d")])
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_unusable_data_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_server(["--listen", "127.0.0.1:1", "--data-dir", str(blocker / "data")])
    assert result.returncode == 1
    assert "cannot create data directory" in result.stderr


def test_shard_count_and_node_id_are_fixed_at_creation(server: ServerProcess) -> None:
    server.stop()
    result = run_server(["--listen", server.address, "--data-dir", str(server.data_dir), "--n-shards", "8"])
    assert result.returncode == 1
    assert "created with n_shards=16" in result.stderr
    result = run_server(["--node-id", "other", "--listen", server.address, "--data-dir", str(server.data_dir)])
    assert result.returncode == 1 and "belongs to node 'n1'" in result.stderr


def test_data_dir_in_use_by_another_process(server: ServerProcess, tmp_path: Path) -> None:
    second = ServerProcess(server.data_dir, node_id="n1")
    result = run_server(second.command()[1:])
    assert result.returncode == 1
    assert "in use by another mqds-server" in result.stderr


def test_sigterm_stops_cleanly_and_data_survives(server: ServerProcess) -> None:
    with Client(server.address) as c:
        c.store_batch([Message(topic="t/1", payload=b"kept", sender="s")], sync=False)
    assert server.stop() == 0
    assert "stopped" in server.output()
    server.start()
    with Client(server.address) as c:
        assert [m.payload for m in c.replay("t/#")] == [b"kept"]


def test_settings_from_environment(tmp_path: Path) -> None:
    os.environ["MQDS_N_SHARDS"] = "3"
    try:
        proc = ServerProcess(tmp_path / "n1").start()
    finally:
        del os.environ["MQDS_N_SHARDS"]
    try:
        with Client(proc.address) as c:
            assert len(c.list_generations()) == 3
    finally:
        proc.kill()
