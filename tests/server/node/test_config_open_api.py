"""Secure by default: a node serves a public API that authenticates no caller on loopback only.

The images and manifests listen on 0.0.0.0; without ``auth_tokens_file`` such a node refused nothing and
anyone who reached the port read and wrote every message. Now it refuses to start unless
``insecure_open_api`` (or ``dev_mode``) says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mqds.protocol.addresses import is_loopback
from mqds.server.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:7101", True),
        ("127.8.9.10:7101", True),
        ("localhost:7101", True),
        ("[::1]:7101", True),
        ("0.0.0.0:7101", False),
        ("[::]:7101", False),
        ("10.0.0.5:7101", False),
        ("mqds-0.mqds-headless.ns.svc.cluster.local:7101", False),
        ("n1:7101", False),
    ],
)
def test_which_addresses_are_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


@pytest.mark.parametrize("listen", ["0.0.0.0:7101", "[::]:7101", "10.1.2.3:7101", "mqds-0.svc:7101"])
def test_a_node_reachable_from_other_machines_needs_tokens(listen: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(["--listen", listen], environ={})
    message = str(refused.value)
    assert f"listen {listen!r} can be reached from other machines and auth_tokens_file is not set" in message
    assert "MQDS_INSECURE_OPEN_API=true" in message
    # The same from the environment, as the image sets it.
    with pytest.raises(ConfigError, match="auth_tokens_file is not set"):
        load_config([], environ={"MQDS_LISTEN": listen})

    tokens = tmp_path / "tokens"
    tokens.write_text("reader reader-token-0123456789\nadmin admin-token-0123456789\n")
    config, _ = load_config(["--listen", listen, "--auth-tokens-file", str(tokens)], environ={})
    assert config.auth_tokens_file == str(tokens)
    # Open on purpose: the loudly named setting, or a development cluster.
    assert load_config([], environ={"MQDS_LISTEN": listen, "MQDS_INSECURE_OPEN_API": "true"})[0].insecure_open_api
    assert load_config(["--listen", listen, "--dev-mode"], environ={})[0].dev_mode


def test_loopback_needs_no_tokens() -> None:
    for listen in ("127.0.0.1:7101", "localhost:7101", "[::1]:7101"):
        config, _ = load_config(["--listen", listen], environ={})
        assert config.listen == listen and not config.auth_tokens_file
