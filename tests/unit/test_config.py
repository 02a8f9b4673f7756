"""Node settings: defaults < file < environment < flags, validated with clear messages."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from mqds.server.config import ConfigError, NodeConfig, build_parser, load_config


def test_defaults_are_valid() -> None:
    config, _ = load_config([], environ={})
    assert config == NodeConfig()
    assert config.n_shards == 16


def test_defaults_are_valid_however_large_the_cluster() -> None:
    """A sixth node joining a cluster started with defaults refused to start: the check counted one
    worker per peer's Raft stream (which now run on threads of their own)."""
    peers = ",".join(f"n{i}=10.0.0.{i}:7101" for i in range(1, 41))
    config, _ = load_config(["--node-id", "n6", "--peers", peers], environ={"MQDS_CLUSTER_SECRET": "s" * 16})
    assert len(config.peer_map()) == 40
    with pytest.raises(ConfigError, match="must exceed max_public_calls"):
        load_config(["--grpc-workers", "30", "--max-public-calls", "24"], environ={})


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('node_id = "from-file"\nn_shards = 4\nlisten = "127.0.0.1:9000"\nretention_period_s = 60\n')
    env = {"MQDS_N_SHARDS": "8", "MQDS_DATA_DIR": "/srv/mqds", "UNRELATED": "x"}
    config, _ = load_config(["--config", str(path), "--listen", "0.0.0.0:7101"], environ=env)
    assert config.node_id == "from-file"  # file only
    assert config.n_shards == 8  # env beats file
    assert config.data_dir == "/srv/mqds"  # env
    assert config.listen == "0.0.0.0:7101"  # flag beats file
    assert config.retention_period_s == 60.0  # int in TOML becomes float
    # The config file may also come from the environment.
    config, _ = load_config([], environ={"MQDS_CONFIG": str(path)})
    assert config.node_id == "from-file"


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        (["--listen", "nohost"], {}, "host:port"),
        (["--listen", "127.0.0.1:70000"], {}, "port from 1 to 65535"),
        (["--n-shards", "0"], {}, "n_shards must be greater than 0"),
        (["--node-id", "bad id!"], {}, "node_id"),
        (["--retention-period-s", "-1"], {}, "retention_period_s must be 0 or more"),
        ([], {"MQDS_N_SHARDS": "many"}, "environment variable MQDS_N_SHARDS: n_shards must be int"),
        (["--max-payload-bytes", "100000000"], {}, "max_request_bytes"),
        (["--log-level", "LOUD"], {}, "log_level"),
        (["--metrics-listen", "9101"], {}, "metrics_listen '9101': expected host:port"),
        ([], {"MQDS_READY_MAX_LAG_ENTRIES": "-1"}, "ready_max_lag_entries must be 0 or more"),
    ],
)
def test_bad_settings_name_the_problem(argv: list[str], env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(argv, environ=env)
    assert words in str(exc.value)


def test_bad_config_files(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("n_shard = 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'n_shard'"):
        load_config(["--config", str(unknown)], environ={})
    broken = tmp_path / "broken.toml"
    broken.write_text("n_shards = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--config", str(broken)], environ={})
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text('n_shards = "four"\n')
    with pytest.raises(ConfigError, match="n_shards must be int"):
        load_config(["--config", str(wrong_type)], environ={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(["--config", str(tmp_path / "missing.toml")], environ={})


def test_unknown_flag_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_config(["--no-such-option"], environ={})
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_help_explains_every_setting() -> None:
    text = build_parser().format_help()
    for f in dataclasses.fields(NodeConfig):
        assert "--" + f.name.replace("_", "-") in text
    assert "--print-config" in text and "--config" in text


def test_printed_config_round_trips(tmp_path: Path) -> None:
    config = NodeConfig(node_id="n7", n_shards=3, generation_interval_s=2.5)
    text = config.to_toml()
    assert tomllib.loads(text)["node_id"] == "n7"
    path = tmp_path / "printed.toml"
    path.write_text(text)
    again, _ = load_config(["--config", str(path)], environ={})
    assert again == config
