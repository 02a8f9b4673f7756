"""TLS on the node's port: who gets in, with clear errors for who does not; a mutual-TLS cluster replicates."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tls_certs import Issued, TestCA

from mqds.client import Client, ConnectionSettings, Message, aio
from mqds.client import errors as E
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.processes import NodeProcess

pytestmark = pytest.mark.integration

# The name the single node's certificate carries (and nothing else: no IP).
NODE_NAME = "node.mqds.test"


@dataclass(frozen=True)
class Certs:
    ca: TestCA
    other_ca: TestCA
    node: Issued  # localhost and 127.0.0.1, for the cluster's nodes
    named: Issued  # only NODE_NAME
    client: Issued
    stranger: Issued  # a client certificate from the other CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    base = tmp_path_factory.mktemp("certs")
    ca, other = TestCA(base / "ca"), TestCA(base / "other", "another CA")
    return Certs(
        ca=ca,
        other_ca=other,
        node=ca.issue("node"),
        named=ca.issue("named", dns=(NODE_NAME,), ips=()),
        client=ca.issue("client"),
        stranger=other.issue("stranger"),
    )


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[NodeProcess]:
    """One node serving TLS, no client certificate required."""
    args = [
        "--n-shards",
        "2",
        "--tls-cert-file",
        str(certs.named.cert_file),
        "--tls-key-file",
        str(certs.named.key_file),
    ]
    connection = ConnectionSettings(tls_ca=certs.ca.file, tls_server_name=NODE_NAME)
    proc = NodeProcess(tmp_path_factory.mktemp("tls") / "n1", args=args, connection=connection).start()
    yield proc
    proc.kill()


def mtls_settings(certs: Certs, **changes: object) -> ConnectionSettings:
    settings = ConnectionSettings(
        tls_ca=certs.ca.file, tls_client_cert=certs.client.cert_file, tls_client_key=certs.client.key_file, timeout_s=20
    )
    return settings.replace(**changes)


@pytest.fixture(scope="module")
def mtls_cluster(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[LocalCluster]:
    """Three nodes requiring client certificates: peers present their node certificate to each other."""
    args = [
        "--tls-cert-file",
        str(certs.node.cert_file),
        "--tls-key-file",
        str(certs.node.key_file),
        "--tls-client-ca-file",
        str(certs.ca.file),
    ]
    base = tmp_path_factory.mktemp("mtls") / "c"
    with LocalCluster(base, 3, n_shards=4, args=args, connection=mtls_settings(certs)) as cluster:
        cluster.start()
        yield cluster


def refused(address: str, settings: ConnectionSettings) -> E.MqdsError:
    with Client(address, settings=settings.replace(timeout_s=5)) as client, pytest.raises(E.UnavailableError) as exc:
        client.store_batch([Message(topic="t", payload=b"x", sender="s")])
    return exc.value


def test_a_tls_node_serves_tls_clients_and_refuses_others_clearly(tls_node: NodeProcess, certs: Certs) -> None:
    good = ConnectionSettings(tls_ca=certs.ca.file, tls_server_name=NODE_NAME, timeout_s=20)
    with Client(tls_node.address, settings=good) as client:
        stored = client.store_batch([Message(topic="tls/1", payload=b"secret", sender="s")])
        assert [m.payload for m in client.replay("tls/#")] == [b"secret"]

    async def use_aio() -> list[bytes]:
        async with aio.Client(tls_node.address, settings=good.replace(tls_ca=certs.ca.pem)) as client:
            return [m.payload async for m in client.replay("tls/#")]

    assert asyncio.run(asyncio.wait_for(use_aio(), 30)) == [b"secret"]
    assert stored[0].timestamp_us

    plaintext = refused(tls_node.address, ConnectionSettings())
    assert "if it serves TLS, set tls_ca" in plaintext.message
    wrong_ca = refused(tls_node.address, good.replace(tls_ca=certs.other_ca.file))
    assert "not signed by a CA in tls_ca" in wrong_ca.message and "CERTIFICATE_VERIFY_FAILED" in wrong_ca.message
    # The certificate names node.mqds.test only: dialling 127.0.0.1 without the override fails.
    no_name = refused(tls_node.address, ConnectionSettings(tls_ca=certs.ca.file))
    assert "set tls_server_name" in no_name.message


def test_a_plaintext_node_refuses_a_tls_client_clearly(tmp_path: Path, certs: Certs) -> None:
    proc = NodeProcess(tmp_path / "n1", args=["--n-shards", "1"]).start()
    try:
        err = refused(proc.address, ConnectionSettings(tls_ca=certs.ca.file))
        assert "does not serve TLS" in err.message
    finally:
        proc.kill()


def test_a_mutual_tls_cluster_forms_and_replicates(mtls_cluster: LocalCluster, certs: Certs) -> None:
    # start() returned: every vnode elected a leader over the nodes' TLS links.
    batch = [Message(topic=f"m/{i}", payload=str(i).encode(), sender=f"p{i % 7}") for i in range(200)]
    with mtls_cluster.client() as client:
        client.store_batch(batch)

    async def use_aio() -> int:
        async with aio.Client(mtls_cluster.addresses, settings=mtls_settings(certs)) as client:
            await client.store_batch([Message(topic="m/aio", payload=b"a", sender="p-aio")])
            return len([m async for m in client.replay("m/#")])

    assert asyncio.run(asyncio.wait_for(use_aio(), 60)) == 201
    mtls_cluster.assert_replicas_identical(timeout_s=30)
    for proc in mtls_cluster.nodes.values():
        with Client(proc.address, settings=mtls_settings(certs)) as alone:
            assert len(list(alone.replay("m/#", stale_ok=True))) == 201


def test_mutual_tls_requires_a_client_certificate(mtls_cluster: LocalCluster, certs: Certs) -> None:
    address = mtls_cluster.nodes["n1"].address
    no_cert = refused(address, ConnectionSettings(tls_ca=certs.ca.file))
    assert "set tls_client_cert and tls_client_key" in no_cert.message
    stranger = refused(
        address, mtls_settings(certs, tls_client_cert=certs.stranger.cert_pem, tls_client_key=certs.stranger.key_pem)
    )
    assert "is tls_client_cert signed by the CA the node trusts" in stranger.message
    assert "if it serves TLS" in refused(address, ConnectionSettings()).message


def test_the_cli_speaks_mutual_tls(mtls_cluster: LocalCluster, certs: Certs) -> None:
    mqds = str(Path(sys.executable).with_name("mqds"))
    endpoints = ",".join(mtls_cluster.addresses)
    tls = ["--tls-ca", str(certs.ca.file), "--tls-cert", str(certs.client.cert_file)]
    tls += ["--tls-key", str(certs.client.key_file)]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([mqds, "--endpoints", endpoints, *args], capture_output=True, text=True, timeout=120)

    pub = run(*tls, "pub", "cli/tls", "-m", "hello", "--sender", "cli")
    assert pub.returncode == 0, pub.stderr
    replay = run(*tls, "replay", "cli/#", "--format", "json")
    assert replay.returncode == 0 and '"payload": "hello"' in replay.stdout, replay.stdout + replay.stderr
    status = run(*tls, "status")
    assert status.returncode == 0 and "OK" in status.stdout, status.stdout + status.stderr
    plain = run("--timeout", "5", "status")
    assert plain.returncode == 1 and "Traceback" not in plain.stderr and "TLS" in plain.stderr, plain.stderr
