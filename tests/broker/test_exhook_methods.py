"""The ExHook provider serves only what it classifies, and only to callers it can authenticate.

* Every rpc of ``emqx.exhook.v3.HookProvider`` (enumerated from the service's descriptor) has an entry
  in :data:`~mqds.broker.exhook.methods.HOOK_METHODS`: a new method fails here until it is classified.
* A real provider server refuses a method marked refused, one the table does not know and another
  service's, before the servicer sees the call.
* A listener other machines can reach without mutual TLS is refused unless asked for by name.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from repo_paths import ROOT
from tls_certs import TestCA

from mqds.broker.actions import BrokerHooks
from mqds.broker.exhook.listener import INSECURE_FLAG, ProviderTLS, check_listener
from mqds.broker.exhook.methods import HOOK_METHODS, SERVICE, Handling, classify
from mqds.broker.exhook.provider import ExhookServer, HookProvider
from mqds.broker.exhook.v3 import exhook_pb2 as pb
from mqds.broker.exhook.v3 import exhook_pb2_grpc as pb_grpc
from mqds.broker.hooks import load_config
from mqds.client import aio

RULES = ROOT / "deploy" / "hooks" / "redis-style.toml"


def test_every_method_of_the_service_is_classified() -> None:
    service = pb.DESCRIPTOR.services_by_name["HookProvider"]
    assert service.full_name == SERVICE
    declared = {method.name for method in service.methods}
    unclassified = declared - set(HOOK_METHODS)
    assert not unclassified, f"HookProvider methods without an entry in HOOK_METHODS: {sorted(unclassified)}"
    assert set(HOOK_METHODS) == declared, f"entries for methods the service lacks: {set(HOOK_METHODS) - declared}"
    for name, handling in HOOK_METHODS.items():
        served_here = getattr(HookProvider, name) is not getattr(pb_grpc.HookProviderServicer, name)
        # What is answered is implemented by the provider; what is refused is left to the generated base.
        assert served_here == (handling is not Handling.REFUSED), name
        assert classify(f"/{SERVICE}/{name}") is handling


def test_unknown_methods_and_services_are_refused() -> None:
    for method in (
        f"/{SERVICE}/OnSomethingNew",
        "/grpc.health.v1.Health/Check",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/emqx.exhook.v2.HookProvider/OnMessagePublish",
        "OnMessagePublish",
    ):
        assert classify(method) is Handling.REFUSED, method


def test_a_served_provider_refuses_what_it_does_not_classify() -> None:
    async def scenario() -> dict[str, tuple[grpc.StatusCode, str]]:
        async with aio.Client(["127.0.0.1:9"]) as client:  # never called: these calls reach no mqds cluster
            provider = HookProvider(BrokerHooks(client, load_config(RULES)))
            server = ExhookServer(provider, "127.0.0.1:0")
            address = await server.start()
            answers: dict[str, tuple[grpc.StatusCode, str]] = {}
            try:
                async with grpc.aio.insecure_channel(address) as channel:
                    calls = {
                        "OnClientAuthenticate": pb.ClientAuthenticateRequest(),
                        "OnClientAuthorize": pb.ClientAuthorizeRequest(),
                        "OnSomethingNew": pb.EmptySuccess(),
                        "OnClientConnack": pb.ClientConnackRequest(),
                        "OnProviderLoaded": pb.ProviderLoadedRequest(),
                    }
                    for name, request in calls.items():
                        call = channel.unary_unary(
                            f"/{SERVICE}/{name}", request_serializer=lambda message: message.SerializeToString()
                        )
                        try:
                            await call(request, timeout=10)
                            answers[name] = (grpc.StatusCode.OK, "")
                        except grpc.aio.AioRpcError as err:
                            answers[name] = (err.code(), err.details() or "")
                    health = channel.unary_unary("/grpc.health.v1.Health/Check")
                    try:
                        await health(b"", timeout=10)
                    except grpc.aio.AioRpcError as err:
                        answers["health"] = (err.code(), err.details() or "")
            finally:
                await server.stop(1)
            answers["counted"] = (grpc.StatusCode.OK, repr(sorted(provider.calls.items())))
            answers["refused"] = (grpc.StatusCode.OK, str(server.guard.refused))
            return answers

    answers = asyncio.run(asyncio.wait_for(scenario(), 60))
    for name in ("OnClientAuthenticate", "OnClientAuthorize", "OnSomethingNew", "health"):
        code, details = answers[name]
        assert code is grpc.StatusCode.UNIMPLEMENTED, (name, code, details)
        assert "is not served by mqds exhook" in details, details
    assert answers["OnClientConnack"][0] is grpc.StatusCode.OK
    assert answers["OnProviderLoaded"][0] is grpc.StatusCode.OK
    # The refused calls never reached the servicer: it counted only the two it serves.
    assert answers["counted"][1] == repr([("OnClientConnack", 1), ("OnProviderLoaded", 1)])
    assert answers["refused"][1] == "4"


def test_a_listener_other_machines_reach_needs_mutual_tls(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    issued = ca.issue("exhook")
    server_only = ProviderTLS.from_files(str(issued.cert_file), str(issued.key_file))
    mutual = ProviderTLS.from_files(str(issued.cert_file), str(issued.key_file), str(ca.file))
    for listen in ("0.0.0.0:9000", "[::]:9000", "10.0.0.7:9000", "mqds-exhook:9000"):
        for tls in (None, server_only):
            with pytest.raises(ValueError, match="authenticates no caller") as refused:
                check_listener(listen, tls)
            assert INSECURE_FLAG in str(refused.value) and "--client-ca" in str(refused.value)
            # Asked for by name: allowed, and reported as insecure so the caller warns.
            assert check_listener(listen, tls, insecure_no_client_auth=True) is True
        assert check_listener(listen, mutual) is False
    for listen in ("127.0.0.1:9000", "localhost:9000", "[::1]:0"):
        assert check_listener(listen, None) is False
    with pytest.raises(ValueError, match=r"--client-ca .* holds no PEM CA certificate"):
        ProviderTLS.from_files(str(issued.cert_file), str(issued.key_file), str(issued.key_file))
    with pytest.raises(ValueError, match=r"--server-key .*: cannot read it"):
        ProviderTLS.from_files(str(issued.cert_file), str(tmp_path / "missing.key"))
