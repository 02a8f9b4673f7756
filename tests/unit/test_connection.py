"""Client connection settings: validation, and the auth token on every call (an in-process gRPC server)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from tls_certs import TestCA

from mqds.client import Client, ConnectionSettings, Message, aio
from mqds.client.connection import resolve_settings
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"timeout_s": 0}, "timeout_s must be a positive"),
        ({"keepalive_time_s": -1}, "keepalive_time_s must be a positive"),
        ({"keepalive_timeout_s": 0}, "keepalive_timeout_s"),
        ({"max_send_message_bytes": 0}, "max_send_message_bytes"),
        ({"max_receive_message_bytes": 1.5}, "max_receive_message_bytes"),
        ({"tls_client_cert": b"x"}, "go together"),
        ({"tls_client_key": "key.pem"}, "go together"),
        ({"tls_server_name": "node.example"}, "needs TLS"),
        ({"tls": True, "tls_server_name": ""}, "non-empty"),
        ({"auth_token": "Bearer abc"}, "without spaces"),
        ({"auth_token": ""}, "non-empty"),
        ({"auth_token": "caf\u00e9"}, "ASCII"),
    ],
)
def test_bad_settings_are_refused_with_a_clear_message(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as exc:
        ConnectionSettings(**changes)
    assert words in str(exc.value)


def test_tls_files_are_read_when_the_client_is_created(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    with pytest.raises(ValueError, match=r"cannot read tls_ca file .*missing\.pem"):
        Client("127.0.0.1:1", settings=ConnectionSettings(tls_ca=tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match=r"tls_ca file .*junk\.pem is not PEM"):
        aio.Client("127.0.0.1:1", settings=ConnectionSettings(tls_ca=str(tmp_path / "junk.pem")))
    issued = ca.issue("client")
    with pytest.raises(ValueError, match="tls_client_key is not a PEM private key"):
        Client(
            "127.0.0.1:1",
            settings=ConnectionSettings(tls_ca=ca.pem, tls_client_cert=issued.cert_pem, tls_client_key=issued.cert_pem),
        )
    # Paths, PEM bytes and PEM text are all accepted.
    for value in (ca.file, str(ca.file), ca.pem, ca.pem.decode()):
        Client("127.0.0.1:1", settings=ConnectionSettings(tls_ca=value)).close()


def test_secrets_stay_out_of_the_repr() -> None:
    text = repr(ConnectionSettings(auth_token="s3cret-token", tls=True))
    assert "s3cret-token" not in text


def test_the_older_keyword_arguments_override_the_settings() -> None:
    base = ConnectionSettings(timeout_s=5, auth_token="t")
    resolved = resolve_settings(base, 7.0, 1000)
    assert (resolved.timeout_s, resolved.max_send_message_bytes, resolved.max_receive_message_bytes) == (
        7.0,
        1000,
        1000,
    )
    assert resolved.auth_token == "t"
    assert resolve_settings(base, None, None) is base
    client = Client("127.0.0.1:1", timeout_s=3)
    assert client.timeout_s == 3 and client.settings.timeout_s == 3
    client.close()


class _Recorder(clpb_grpc.ClusterServicer, pb_grpc.StorageServicer):
    """A one-node, one-shard stand-in for mqds that records each call's metadata."""

    def __init__(self) -> None:
        self.address = ""
        self.calls: list[tuple[str, dict[str, str]]] = []

    def _record(self, method: str, context: grpc.ServicerContext) -> None:
        self.calls.append((method, dict(context.invocation_metadata())))

    def GetClusterMap(self, request: Any, context: grpc.ServicerContext) -> clpb.ClusterMap:
        self._record("GetClusterMap", context)
        cmap = clpb.ClusterMap(cluster_id="fake", n_shards=1, version=1, meta_leader="f1")
        cmap.nodes.add(id="f1", address=self.address)
        cmap.vnodes.add(shard=0, replicas=["f1"], leader="f1", term=1)
        return cmap

    def ListGenerations(self, request: Any, context: grpc.ServicerContext) -> pb.ListGenerationsResponse:
        self._record("ListGenerations", context)
        return pb.ListGenerationsResponse(generations=[pb.Generation(shard=0, generation=1, current=True)])

    def StoreBatch(self, request: Any, context: grpc.ServicerContext) -> pb.StoreBatchResponse:
        self._record("StoreBatch", context)
        return pb.StoreBatchResponse(
            positions=[pb.MessagePosition(shard=0, timestamp_us=i + 1) for i in range(len(request.messages))]
        )


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    servicer = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    clpb_grpc.add_ClusterServicer_to_server(servicer, server)
    pb_grpc.add_StorageServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    servicer.address = f"127.0.0.1:{port}"
    server.start()
    yield servicer
    server.stop(0)


def test_the_auth_token_travels_with_every_call(recorder: _Recorder) -> None:
    settings = ConnectionSettings(auth_token="tok-123", timeout_s=10)
    with Client(recorder.address, settings=settings) as client:
        client.cluster_map()
        client.list_generations()
        client.store_batch([Message(topic="t", payload=b"x", sender="s")])

    async def use_aio() -> None:
        async with aio.Client(recorder.address, settings=settings) as client:
            await client.cluster_map()
            await client.list_generations()
            await client.store_batch([Message(topic="t", payload=b"x", sender="s")])

    asyncio.run(asyncio.wait_for(use_aio(), 30))
    methods = [method for method, _ in recorder.calls]
    assert methods.count("GetClusterMap") >= 2 and "ListGenerations" in methods and "StoreBatch" in methods
    assert all(md.get("authorization") == "Bearer tok-123" for _, md in recorder.calls), recorder.calls

    recorder.calls.clear()
    with Client(recorder.address, timeout_s=10) as client:
        client.list_generations()
    assert recorder.calls and all("authorization" not in md for _, md in recorder.calls)
