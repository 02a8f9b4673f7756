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
    config, _ = load_config(["--config", str(path), "--listen", "127.0.0.1:7101"], environ=env)
    assert config.node_id == "from-file"  # file only
    assert config.n_shards == 8  # env beats file
    assert config.data_dir == "/srv/mqds"  # env
    assert config.listen == "127.0.0.1:7101"  # flag beats file
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


@pytest.mark.parametrize(
    ("name", "raw", "value"),
    [
        ("raft_log_max_bytes", "16MiB", 16 * 1024 * 1024),
        ("raft_log_max_bytes", "16 MiB", 16 * 1024 * 1024),
        ("block_cache_bytes", "512KiB", 512 * 1024),
        ("block_cache_bytes", "1GB", 1_000_000_000),
        ("block_cache_bytes", "2gib", 2 * 1024**3),
        ("block_cache_bytes", "123456", 123456),  # a plain number of bytes, as before
        ("block_cache_bytes", "64_000", 64000),
        ("write_timeout_s", "250ms", 0.25),
        ("write_timeout_s", "30s", 30.0),
        ("retention_period_s", "5m", 300.0),
        ("generation_interval_s", "1h", 3600.0),
        ("retention_period_s", "7d", 7 * 86400.0),
        ("raft_heartbeat_s", "0.2", 0.2),  # a plain number of seconds, as before
        ("write_timeout_s", "12", 12.0),
    ],
)
def test_sizes_and_durations_take_units(name: str, raw: str, value: float, tmp_path: Path) -> None:
    flag = "--" + name.replace("_", "-")
    assert getattr(load_config([flag, raw], environ={})[0], name) == value
    assert getattr(load_config([], environ={f"MQDS_{name.upper()}": raw})[0], name) == value
    path = tmp_path / "units.toml"
    path.write_text(f'{name} = "{raw}"\n')
    assert getattr(load_config(["--config", str(path)], environ={})[0], name) == value


def test_plain_numbers_in_toml_still_work(tmp_path: Path) -> None:
    path = tmp_path / "plain.toml"
    path.write_text("max_payload_bytes = 2048\nwrite_timeout_s = 3\nraft_heartbeat_s = 0.3\n")
    config, _ = load_config(["--config", str(path)], environ={})
    assert (config.max_payload_bytes, config.write_timeout_s, config.raft_heartbeat_s) == (2048, 3.0, 0.3)


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        (["--raft-log-max-bytes", "16Mx"], {}, "flag --raft-log-max-bytes: raft_log_max_bytes must be a size"),
        (["--raft-log-max-bytes", "1.5"], {}, "raft_log_max_bytes must be a size"),
        ([], {"MQDS_BLOCK_CACHE_BYTES": "lots"}, "environment variable MQDS_BLOCK_CACHE_BYTES: block_cache_bytes"),
        (["--write-timeout-s", "5 parsecs"], {}, "flag --write-timeout-s: write_timeout_s must be a duration"),
        ([], {"MQDS_READ_TIMEOUT_S": "10x"}, "environment variable MQDS_READ_TIMEOUT_S: read_timeout_s"),
        (["--dev-mode", "maybe"], {}, "flag --dev-mode: dev_mode must be bool"),
        (["--log-format", "xml"], {}, "log_format 'xml': use text or json"),
    ],
)
def test_bad_units_are_refused_with_what_is_accepted(argv: list[str], env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(argv, environ=env)
    message = str(exc.value)
    assert words in message
    if "must be a size" in message:
        assert "MiB" in message and "got" in message
    if "must be a duration" in message:
        assert "ms" in message and "got" in message
    assert "pydantic" not in message and "validation error" not in message


def test_bad_unit_in_a_file_names_the_file_and_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('raft_segment_bytes = "256 MB!"\n')
    with pytest.raises(ConfigError, match=r"config file .*node\.toml: raft_segment_bytes must be a size"):
        load_config(["--config", str(path)], environ={})


def test_precedence_holds_with_units(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('raft_log_max_bytes = "1MiB"\nblock_cache_bytes = "2MiB"\nwrite_buffer_bytes = "3MiB"\n')
    env = {"MQDS_BLOCK_CACHE_BYTES": "4MiB", "MQDS_WRITE_BUFFER_BYTES": "5MiB"}
    config, _ = load_config(["--config", str(path), "--write-buffer-bytes", "6MiB"], environ=env)
    mib = 1024 * 1024
    assert config.raft_log_max_bytes == 1 * mib  # file
    assert config.block_cache_bytes == 4 * mib  # env beats file
    assert config.write_buffer_bytes == 6 * mib  # flag beats env and file


def test_cli_refuses_a_bad_unit_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    from mqds.server.node.main import main

    assert main(["--raft-log-max-bytes", "16 furlongs"]) == 2
    err = capsys.readouterr().err
    assert "bad configuration" in err and "raft_log_max_bytes must be a size" in err
    assert "Traceback" not in err


def test_help_is_grouped_with_metavars_and_defaults() -> None:
    text = build_parser().format_help()
    for group in ("node and network:", "security:", "Raft replication:", "storage:", "limits:", "health and metrics:"):
        assert group in text
    for shown in ("--listen HOST:PORT", "--raft-log-max-bytes SIZE", "--write-timeout-s DURATION"):
        assert shown in text
    assert "--tls-cert-file FILE" in text and "--log-format {text,json}" in text
    assert "(default: 16MiB)" in text and "(default: 10s)" in text and "(default: 16)" in text


def test_json_log_lines_parse_as_json() -> None:
    import io
    import json
    import logging

    from mqds.server.node.main import JsonFormatter, configure_logging

    config, _ = load_config(["--log-format", "json", "--node-id", "n3"], environ={})
    assert config.log_format == "json"
    assert load_config([], environ={"MQDS_LOG_FORMAT": "json"})[0].log_format == "json"
    assert load_config([], environ={})[0].log_format == "text"
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(config.node_id))
    logger = logging.getLogger("mqds.test.jsonlog")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("stored %d messages in %s", 3, "shard 'x'\n")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "stored 3 messages in shard 'x'\n"
    assert (first["level"], first["logger"], first["node"]) == ("INFO", "mqds.test.jsonlog", "n3")
    assert first["time"].endswith("+00:00")
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exception"]
    assert callable(configure_logging)
