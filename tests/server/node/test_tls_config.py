"""The node's TLS settings: checked at start-up with messages that name the setting and the file."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from tls_certs import TestCA

from mqds.server.config import ConfigError, NodeConfig, load_config
from mqds.server.tls import NodeTls


def config(*flags: str) -> NodeConfig:
    return load_config(["--data-dir", "unused", *flags], environ={})[0]


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "ca")


def test_tls_settings_are_checked(tmp_path: Path, ca: TestCA) -> None:
    node = ca.issue("node")
    other = ca.issue("other")
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM")
    cases = [
        (["--tls-cert-file", str(node.cert_file)], "tls_cert_file and tls_key_file go together"),
        (["--tls-key-file", str(node.key_file)], "go together"),
        (["--tls-client-ca-file", str(ca.file)], "tls_client_ca_file needs TLS"),
        (["--tls-ca-file", str(ca.file)], "tls_ca_file needs TLS"),
        (
            ["--tls-cert-file", str(tmp_path / "nope.pem"), "--tls-key-file", str(node.key_file)],
            "nope.pem: no such file",
        ),
        (["--tls-cert-file", str(node.cert_file), "--tls-key-file", str(other.key_file)], "are not a PEM certificate"),
        (["--tls-cert-file", str(junk), "--tls-key-file", str(node.key_file)], "are not a PEM certificate"),
        (
            [
                "--tls-cert-file",
                str(node.cert_file),
                "--tls-key-file",
                str(node.key_file),
                "--tls-client-ca-file",
                str(junk),
            ],
            "tls_client_ca_file",
        ),
    ]
    for flags, words in cases:
        with pytest.raises(ConfigError) as exc:
            config(*flags)
        assert words in str(exc.value), (flags, str(exc.value))


def test_a_good_tls_config_gives_server_and_peer_credentials(ca: TestCA) -> None:
    node = ca.issue("node")
    cfg = config(
        "--tls-cert-file",
        str(node.cert_file),
        "--tls-key-file",
        str(node.key_file),
        "--tls-client-ca-file",
        str(ca.file),
    )
    assert cfg.tls and 'tls_client_ca_file = "' in cfg.to_toml()
    material = NodeTls.from_config(cfg)
    assert material is not None
    # Peers are checked against the client CA when no tls_ca_file is given.
    assert material.peer_ca == ca.pem and material.client_ca == ca.pem and material.cert_chain == node.cert_pem
    assert isinstance(material.server_credentials(), grpc.ServerCredentials)
    assert isinstance(material.peer_credentials(), grpc.ChannelCredentials)
    assert NodeTls.from_config(config()) is None
