"""deploy/docker-compose.yml and k8s/ run for real here, without a container engine or a Kubernetes cluster
(the image itself: test_dockerfile.py).

* The compose file's three node services start as local processes with their commands and
  environments (the client tokens file the user makes, mounted as the file says), and form a
  cluster that the Prometheus targets point at; calls without a token are refused.
* The dev overlay's StatefulSet gives three pods' commands and environments (downward API,
  ConfigMap, Secret, ``$(VAR)`` expansion as the kubelet does it); they form a cluster and pass
  the StatefulSet's own probes; k8s/scale-up.sh and k8s/scale-down.sh add and remove a fourth pod.
* The broker and exhook containers (compose's broker profile, k8s/components/broker and exhook) run
  next to those clusters with the broker token: an MQTT client gets its CONNACK and its message is
  stored in the cluster, and the ExHook port answers EMQX's calls over mutual TLS (EMQX's client
  certificate; none is refused) and records a client in the cluster.

The substitutions that put containers on loopback are documented in tests/deploy_support.py.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from deploy_checks import READY, accepts, check_broker_serves, container_port, scrape
from deploy_support import (
    DEPLOY,
    K8S,
    PROMETHEUS_FILE,
    VENV_BIN,
    Loopback,
    Processes,
    compose_environment,
    container_env,
    dev_overlay,
    dev_with_components,
    expand_k8s,
    find,
    image_file,
    image_stage,
    kustomize,
    kustomize_with_components,
    load_compose,
    local_path_env,
    map_path,
    out_of_band_secret,
    read_auth_tokens,
    secret_data,
    write_auth_tokens,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_certs import Issued, TestCA

from mqds.broker.exhook.v3 import exhook_pb2 as expb
from mqds.broker.exhook.v3 import exhook_pb2_grpc as expb_grpc
from mqds.client import Client, ConnectionSettings, Message
from mqds.client.core.backup_files import Place, verify
from mqds.tools.waiting import wait_serving, wait_until
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MQDS = str(VENV_BIN / "mqds")


def health(address: str, service: str) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError as err:
            return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def cluster_map(address: str, token: str) -> clpb.ClusterMap:
    with grpc.insecure_channel(address) as channel:
        return clpb_grpc.ClusterStub(channel).GetClusterMap(
            clpb.GetClusterMapRequest(), timeout=5, metadata=[("authorization", f"Bearer {token}")]
        )


def wait_status_ok(endpoints: list[str], token: str, timeout_s: float = 60) -> str:
    """Until `mqds status` (with a reader's token) says every node is up and every vnode has a leader."""

    def ok() -> str | None:
        result = subprocess.run(
            [MQDS, "--endpoints", ",".join(endpoints), "--timeout", "10", "--token", token, "status"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result.stdout if result.returncode == 0 else None

    return wait_until("mqds status reporting OK", ok, timeout_s, interval_s=0.5)


def check_tokens_required(endpoints: list[str]) -> None:
    """Secure by default: no token, no reads and no writes."""
    result = subprocess.run(
        [MQDS, "--endpoints", ",".join(endpoints), "--timeout", "10", "replay", "#"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "UNAUTHENTICATED" in result.stderr, result.stdout + result.stderr


def store_and_replay(endpoints: list[str], topic: str, token: str) -> None:
    with Client(endpoints, settings=ConnectionSettings(timeout_s=30, auth_token=token)) as client:
        client.store_batch([Message(topic=f"{topic}/{i}", payload=f"m{i}".encode(), sender=f"s{i}") for i in range(8)])
        assert sorted(m.payload for m in client.replay(f"{topic}/#")) == [f"m{i}".encode() for i in range(8)]


def settings_value(argv: list[str], env: dict[str, str], name: str) -> str:
    """A node's setting as mqds-server reads it: a --flag wins over MQDS_<NAME>."""
    flag = "--" + name.replace("_", "-")
    for i, word in enumerate(argv):
        if word == flag:
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return env.get("MQDS_" + name.upper(), "")


@dataclass
class ExhookCerts:
    """What the user (or cert-manager) makes for the provider: its certificate and key, and the CA that signs
    EMQX's client certificate; and EMQX's certificate."""

    directory: Path
    ca: TestCA
    emqx: Issued

    @classmethod
    def make(cls, directory: Path, names: tuple[str, ...]) -> ExhookCerts:
        ca = TestCA(directory / "ca")
        served = ca.issue("mqds-exhook", dns=(*names, "localhost"))
        directory.mkdir(parents=True, exist_ok=True)
        for name, source in (("tls.crt", served.cert_file), ("tls.key", served.key_file), ("ca.crt", ca.file)):
            shutil.copy(source, directory / name)
        return cls(directory, ca, ca.issue("emqx"))

    def files(self) -> dict[str, str]:
        return {name: (self.directory / name).read_text() for name in ("tls.crt", "tls.key", "ca.crt")}

    def channel(self, address: str, *, with_certificate: bool = True) -> grpc.Channel:
        """A channel as EMQX's exhook ssl option makes (the provider's name: localhost, which its certificate
        holds as the real one holds its Service's name)."""
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.ca.pem,
            private_key=self.emqx.key_pem if with_certificate else None,
            certificate_chain=self.emqx.cert_pem if with_certificate else None,
        )
        return grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", "localhost")])


def check_exhook_serves(address: str, endpoints: list[str], clientid: str, certs: ExhookCerts, token: str) -> None:
    """EMQX's first call answers with the hooks the rules need; a client.connected is recorded in mqds. A caller
    without EMQX's client certificate gets nothing."""
    with certs.channel(address, with_certificate=False) as stranger, pytest.raises(grpc.RpcError) as refused:
        expb_grpc.HookProviderStub(stranger).OnProviderLoaded(expb.ProviderLoadedRequest(), timeout=15)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    with certs.channel(address) as channel:
        stub = expb_grpc.HookProviderStub(channel)
        loaded = stub.OnProviderLoaded(
            expb.ProviderLoadedRequest(broker=expb.BrokerInfo(version="5.9.0"), meta=expb.RequestMeta(node="emqx@e1")),
            timeout=15,
        )
        assert {"client.connected", "message.publish"} <= {h.name for h in loaded.hooks}
        info = expb.ClientInfo(node="emqx@e1", clientid=clientid, username="u", peerhost="127.0.0.1", protocol="mqtt")
        stub.OnClientConnected(expb.ClientConnectedRequest(clientinfo=info), timeout=15)
    with Client(endpoints, settings=ConnectionSettings(timeout_s=30, auth_token=token)) as mqds:
        state = mqds.client_state(clientid)
    assert state is not None and state.online and state.node == "emqx@e1"


# -- docker-compose -----------------------------------------------------------------------------


def compose_mounts(svc: dict[str, Any], named: Path, files: dict[str, Path]) -> dict[str, Path]:
    """A service's volumes: container path -> local path. Named volumes are directories under ``named``; a bind
    mount's source is the user's file of ``files`` (made by the test as the user would) or the repository's."""
    mounts: dict[str, Path] = {}
    for volume in svc.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            assert volume["type"] == "bind", volume
            source, target = volume["source"], volume["target"]
        if source.startswith((".", "/")):  # a path (compose's rule): a bind mount, relative to the compose file
            mounts[target] = files.get(source, (DEPLOY / source).resolve())
        else:
            mounts[target] = named / source
    return mounts


def test_compose_node_services_form_a_cluster_prometheus_scrapes(tmp_path: Path) -> None:
    # What the user makes once (the compose file's header): the client tokens and the provider's certificates.
    tokens = write_auth_tokens(tmp_path / "auth-tokens.txt")
    certs = ExhookCerts.make(tmp_path / "exhook-tls", ("exhook",))
    files = {"./auth-tokens.txt": tmp_path / "auth-tokens.txt", "./exhook-tls": certs.directory}
    compose = load_compose({"MQDS_CLUSTER_SECRET": secrets.token_hex(16), "MQDS_BROKER_TOKEN": tokens["broker"]})
    services: dict[str, Any] = compose["services"]
    nodes = [name for name, svc in services.items() if "--node-id" in svc.get("command", [])]
    assert len(nodes) == 3
    image = image_stage()
    loop = Loopback(lambda host: host if host in services else None)
    processes = Processes(tmp_path / "logs")
    grpc_address: dict[str, str] = {}
    metrics_address: dict[str, str] = {}
    try:
        for name in nodes:
            svc = services[name]
            mounts = compose_mounts(svc, tmp_path / "volumes", files)
            env = {**image.env(), **compose_environment(svc)}
            argv = [*image.required("ENTRYPOINT").exec_form(), *svc["command"]]
            env = {k: map_path(loop.rewrite(v, name), mounts) for k, v in env.items()}
            env.update(PATH=local_path_env(), HOSTNAME=svc.get("hostname", name))
            env["HOME"] = map_path(image.required("WORKDIR").args, mounts)
            original = (argv, {**image.env(), **compose_environment(svc)})
            argv = [map_path(loop.rewrite(word, name), mounts) for word in argv]
            processes.start(name, argv, env, Path(env["HOME"]))
            grpc_address[name] = loop.address(name, container_port(settings_value(*original, "listen")))
            metrics_address[name] = loop.address(name, container_port(settings_value(*original, "metrics_listen")))
        for name in nodes:
            assert wait_serving(grpc_address[name], 90, READY), processes.outputs()
        endpoints = list(grpc_address.values())
        status = wait_status_ok(endpoints, tokens["reader"])
        assert "3 nodes" in status and "OK:" in status, status
        check_tokens_required(endpoints)
        store_and_replay(endpoints, "compose", tokens["broker"])

        # Prometheus scrapes exactly the nodes' metrics addresses.
        prometheus = yaml.safe_load(PROMETHEUS_FILE.read_text())
        targets = [t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
        assert sorted(loop.rewrite(t, "prometheus") for t in targets) == sorted(metrics_address.values())
        for address in metrics_address.values():
            scrape(address)

        # The broker profile: mqds broker and mqds exhook next to the nodes, with their rules file mounted.
        served: dict[str, str] = {}
        for name in ("broker", "exhook"):
            svc = services[name]
            mounts = compose_mounts(svc, tmp_path / "volumes", files)
            mounts.update({path: tmp_path / name / path.strip("/") for path in svc.get("tmpfs", [])})
            env = {**image.env(), **compose_environment(svc)}
            listen = next(w for w in svc["command"] if w.startswith("0.0.0.0:"))
            env = {k: map_path(loop.rewrite(v, name), mounts) for k, v in env.items()}
            env.update(PATH=local_path_env(), HOSTNAME=name, HOME=str(tmp_path / name))
            argv = [map_path(loop.rewrite(w, name), mounts) for w in [*svc["entrypoint"], *svc["command"]]]
            processes.start(name, argv, env, tmp_path / name)
            served[name] = loop.address(name, container_port(listen))
        for name, address in served.items():
            wait_until(f"{name} accepting on {address}", lambda a=address: processes.assert_running() or accepts(a), 60)
            processes.assert_running()
        check_broker_serves(served["broker"], endpoints, "compose-broker", tokens["reader"])
        check_exhook_serves(served["exhook"], endpoints, "compose-emqx-client", certs, tokens["reader"])
        assert set(processes.terminate_all().values()) == {0}, processes.outputs()
    finally:
        processes.kill_all()


# -- Kubernetes ---------------------------------------------------------------------------------


class Pods:
    """The dev overlay's StatefulSet pods as local processes: exactly their command, args and env."""

    def __init__(self, base: Path, objects: list[dict[str, Any]]) -> None:
        self.base = base
        self.objects = objects
        self.sts = find(self.objects, "StatefulSet")
        self.name = self.sts["metadata"]["name"]
        self.namespace = self.sts["metadata"]["namespace"]
        self.service = self.sts["spec"]["serviceName"]
        self.replicas = int(self.sts["spec"]["replicas"])
        pod_spec = self.sts["spec"]["template"]["spec"]
        (self.container,) = pod_spec["containers"]
        dns = re.compile(rf"^(?P<pod>{re.escape(self.name)}-\d+)\.{re.escape(self.service)}\.{self.namespace}\.svc\.")
        self.loop = Loopback(lambda host: m.group("pod") if (m := dns.match(host)) else None)
        self.processes = Processes(base / "logs")
        self.image = image_stage()
        self.env: dict[str, dict[str, str]] = {}
        self.unmapped_env: dict[str, dict[str, str]] = {}

    def pod(self, ordinal: int) -> str:
        return f"{self.name}-{ordinal}"

    def mounts(self, pod: str) -> dict[str, Path]:
        """Each volume mount of the container: a directory of the test's, per pod."""
        return {m["mountPath"]: self.base / pod / m["name"] for m in self.container["volumeMounts"]}

    @property
    def tokens(self) -> dict[str, str]:
        """role -> client token, from the Secret the pods mount as their tokens file."""
        volume = next(v for v in self.sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth-tokens")
        (item,) = volume["secret"]["items"]
        return read_auth_tokens(secret_data(find(self.objects, "Secret", volume["secret"]["secretName"]))[item["key"]])

    def fill_secret_volumes(self, pod: str) -> None:
        """The kubelet's part: each Secret volume whose Secret exists holds its keys (or items) as files."""
        volumes = {v["name"]: v for v in self.sts["spec"]["template"]["spec"]["volumes"]}
        for mount in self.container["volumeMounts"]:
            secret = volumes.get(mount["name"], {}).get("secret")  # the data volume is a claim template
            present = [
                o
                for o in self.objects
                if o["kind"] == "Secret" and secret and o["metadata"]["name"] == secret["secretName"]
            ]
            if not present:
                assert not secret or secret.get("optional"), f"{pod}: the Secret of volume {mount['name']} is missing"
                continue
            values = secret_data(present[0])
            local = self.mounts(pod)[mount["mountPath"]]
            local.mkdir(parents=True, exist_ok=True)
            for item in secret.get("items") or [{"key": k, "path": k} for k in values]:
                (local / item["path"]).write_text(values[item["key"]])

    def start(self, ordinal: int) -> None:
        pod = self.pod(ordinal)
        self.fill_secret_volumes(pod)
        mounts = self.mounts(pod)
        fields = {"metadata.name": pod, "metadata.namespace": self.namespace}
        env = container_env(self.container, self.objects, fields, self.image.env())
        self.unmapped_env[pod] = env
        argv = [expand_k8s(word, env) for word in [*self.container["command"], *self.container.get("args", [])]]
        env = {k: map_path(self.loop.rewrite(v, pod), mounts) for k, v in env.items()}
        # The runtime's own variables: PATH (the image's /opt/mqds/bin is the test's virtualenv), HOSTNAME, HOME.
        env.update(PATH=local_path_env(), HOSTNAME=pod, HOME=map_path(self.image.required("WORKDIR").args, mounts))
        self.env[pod] = env
        argv = [map_path(self.loop.rewrite(word, pod), mounts) for word in argv]
        self.processes.start(pod, argv, env, Path(env["HOME"]))

    def address(self, pod: str, port: int | None = None) -> str:
        return self.loop.address(pod, port or container_port(self.unmapped_env[pod]["MQDS_LISTEN"]))

    def probe(self, pod: str, kind: str) -> str:
        """The StatefulSet's probe of ``kind`` (startupProbe, ...) run against the pod: the status it sees."""
        spec = self.container[kind]["grpc"]
        return health(self.address(pod, int(spec["port"])), spec.get("service", ""))

    def endpoints(self, count: int | None = None) -> list[str]:
        return [self.address(self.pod(i)) for i in range(self.replicas if count is None else count)]


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    pods = Pods(tmp_path_factory.mktemp("k8s"), kustomize(dev_overlay()))
    try:
        for ordinal in range(pods.replicas):
            pods.start(ordinal)
        for ordinal in range(pods.replicas):
            assert wait_serving(pods.address(pods.pod(ordinal)), 90, READY), pods.processes.outputs()
        yield pods
    finally:
        pods.processes.kill_all()


def test_statefulset_pods_form_a_cluster_and_pass_their_probes(pods: Pods) -> None:
    assert pods.replicas == 3
    dns = {pods.pod(i): f"{pods.pod(i)}.{pods.service}.{pods.namespace}.svc.cluster.local:7101" for i in range(3)}
    for ordinal in range(3):
        pod = pods.pod(ordinal)
        given = pods.unmapped_env[pod]
        # What the pod is told, before the loopback mapping: its name, its DNS name, its peers' DNS names.
        assert given["MQDS_NODE_ID"] == pod
        assert given["MQDS_ADVERTISE"] == dns[pod]
        assert given["MQDS_PEERS"] == ",".join(f"{p}={a}" for p, a in dns.items())
        assert given["MQDS_CLUSTER_SECRET"]
        # The client tokens file, from the Secret mounted where the setting points: the pod listens on 0.0.0.0.
        assert given["MQDS_LISTEN"].startswith("0.0.0.0:") and given["MQDS_AUTH_TOKENS_FILE"]
        tokens_file = Path(map_path(given["MQDS_AUTH_TOKENS_FILE"], pods.mounts(pod)))
        assert read_auth_tokens(tokens_file.read_text()) == pods.tokens
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert pods.probe(pod, kind) == "SERVING", (pod, kind)
    status = wait_status_ok(pods.endpoints(), pods.tokens["reader"])
    assert "3 nodes" in status, status
    check_tokens_required(pods.endpoints())
    cmap = cluster_map(pods.endpoints()[0], pods.tokens["reader"])
    assert {n.id: n.address for n in cmap.nodes} == {pods.pod(i): pods.address(pods.pod(i)) for i in range(3)}
    assert len(cmap.vnodes) == int(pods.unmapped_env[pods.pod(0)]["MQDS_N_SHARDS"])
    store_and_replay(pods.endpoints(), "k8s", pods.tokens["broker"])
    # The metrics port the ServiceMonitor scrapes (the headless Service's "metrics" port -> the container's).
    port = next(p["containerPort"] for p in pods.container["ports"] if p["name"] == "metrics")
    for ordinal in range(3):
        scrape(pods.address(pods.pod(ordinal), port))


def start_deployment(
    pods: Pods, objects: list[dict[str, Any]], name: str, base: Path, kind: str = "Deployment"
) -> dict[str, Any]:
    """The Deployment's (or Job's) one pod as a local process next to the StatefulSet's pods: its command, args
    and env; its ConfigMap and Secret volumes as directories of their files, other volumes as empty ones; the
    client Service ``mqds`` (any ready node) mapped to the first pod's address. Returns the container."""
    deployment = find(objects, kind, name)
    pod_spec = deployment["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    pod = f"{name}-0"
    mounts: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
        local = base / pod / mount["name"]
        local.mkdir(parents=True)
        if "configMap" in volume:
            for key, text in find(objects, "ConfigMap", volume["configMap"]["name"])["data"].items():
                (local / key).write_text(text)
        if "secret" in volume:
            values = secret_data(find(objects, "Secret", volume["secret"]["secretName"]))
            for item in volume["secret"].get("items") or [{"key": k, "path": k} for k in values]:
                (local / item["path"]).write_text(values[item["key"]])
        mounts[mount["mountPath"]] = local
    client_service = find(objects, "Service", "mqds")
    (port,) = client_service["spec"]["ports"]
    assert port["port"] == next(p for p in pods.container["ports"] if p["name"] == port["targetPort"])["containerPort"]
    names = {"mqds", f"mqds.{pods.namespace}", f"mqds.{pods.namespace}.svc", f"mqds.{pods.namespace}.svc.cluster.local"}
    loop = Loopback(lambda host: pods.pod(0) if host in names else pods.loop.node_of_host(host))
    loop.ports = pods.loop.ports  # the same addresses for the same pods
    fields = {"metadata.name": pod, "metadata.namespace": pods.namespace}
    env = container_env(container, objects, fields, pods.image.env())
    argv = [expand_k8s(word, env) for word in [*container["command"], *container.get("args", [])]]
    env = {k: map_path(loop.rewrite(v, pod), mounts) for k, v in env.items()}
    env.update(PATH=local_path_env(), HOSTNAME=pod, HOME=str(base / pod))
    argv = [map_path(loop.rewrite(word, pod), mounts) for word in argv]
    pods.processes.start(pod, argv, env, base / pod)
    if container.get("ports"):
        container["address"] = loop.address(pod, int(container["ports"][0]["containerPort"]))
    container["mounts"] = mounts
    return dict(container)


def test_backup_job_backs_the_pods_up_into_its_volume(pods: Pods, tmp_path: Path) -> None:
    objects = dev_with_components(tmp_path / "overlay", "backup")
    assert find(objects, "StatefulSet") == pods.sts, "the same pods, with the component added"
    secret = pods.unmapped_env[pods.pod(0)]["MQDS_CLUSTER_SECRET"]
    with Client(pods.endpoints(), settings=ConnectionSettings(timeout_s=60, cluster_secret=secret)) as client:
        client.store_batch([Message(topic=f"k8s/backup/{i}", payload=b"b", sender=f"k{i}") for i in range(50)])
    container = start_deployment(pods, objects, "mqds-backup", tmp_path / "pods", kind="Job")
    job = pods.processes.procs["mqds-backup-0"]
    try:
        assert job.wait(timeout=180) == 0, pods.processes.output("mqds-backup-0")
    finally:
        pods.processes.terminate("mqds-backup-0", 5)
        del pods.processes.procs["mqds-backup-0"]  # done: the other tests check that the pods' processes run
    assert "backed up" in pods.processes.output("mqds-backup-0")
    volume = container["mounts"]["/backup"]
    report = verify(Place(str(volume)))
    assert report.ok and report.records >= 50, report.problems


def test_broker_and_exhook_components_serve_next_to_the_pods(pods: Pods, tmp_path: Path) -> None:
    objects = dev_with_components(tmp_path / "overlay", "broker", "exhook")
    assert find(objects, "StatefulSet") == pods.sts, "the same pods, with the components added"
    # The Secrets the components need and do not ship, made out of band (kubectl create secret, cert-manager).
    certs = ExhookCerts.make(tmp_path / "exhook-tls", (f"mqds-exhook.{pods.namespace}.svc",))
    objects += [
        out_of_band_secret("mqds-broker-token", pods.namespace, {"token": pods.tokens["broker"]}),
        out_of_band_secret("mqds-exhook-tls", pods.namespace, certs.files()),
    ]
    started = {
        name: start_deployment(pods, objects, name, tmp_path / "pods") for name in ("mqds-broker", "mqds-exhook")
    }
    try:
        for name, container in started.items():
            # The Deployment's startup probe (tcpSocket on its port), as the kubelet runs it.
            assert container["startupProbe"]["tcpSocket"]["port"] == container["ports"][0]["name"]
            wait_until(
                f"{name} accepting", lambda c=container: pods.processes.assert_running() or accepts(c["address"]), 60
            )
            pods.processes.assert_running()
        check_broker_serves(started["mqds-broker"]["address"], pods.endpoints(), "k8s-broker", pods.tokens["reader"])
        check_exhook_serves(
            started["mqds-exhook"]["address"], pods.endpoints(), "k8s-emqx-client", certs, pods.tokens["reader"]
        )
        for name in started:
            assert pods.processes.terminate(f"{name}-0") == 0, pods.processes.output(f"{name}-0")
        assert "stopped" in pods.processes.output("mqds-broker-0")
    finally:
        for name in started:
            pods.processes.terminate(f"{name}-0", 5)


def run_script(
    name: str, *args: str, mqds_endpoints: list[str], cluster_secret: str
) -> subprocess.CompletedProcess[str]:
    """k8s/NAME with kubectl replaced by echo (the test checks what it would run) and mqds by the local CLI.

    The local CLI presents the cluster secret, as ``mqds`` run inside a pod does (its environment has it).
    """
    env = {
        **os.environ,
        "KUBECTL": "echo",
        "MQDS": f"{MQDS} --endpoints {','.join(mqds_endpoints)}",
        "MQDS_CLUSTER_SECRET": cluster_secret,
    }
    return subprocess.run(
        ["bash", str(K8S / name), *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_scale_up_then_scale_down_scripts(pods: Pods) -> None:
    founders = pods.endpoints()
    new = pods.pod(3)
    secret = pods.unmapped_env[pods.pod(0)]["MQDS_CLUSTER_SECRET"]
    pods.start(3)
    # Not a founder: it runs (startup and liveness probes pass), and is not ready before it joins.
    wait_until(f"{new} serving liveness", lambda: pods.probe(new, "livenessProbe") == "SERVING", 60)
    assert pods.probe(new, "startupProbe") == "SERVING"
    assert pods.probe(new, "readinessProbe") != "SERVING"

    # The script derives the address the pod advertises.
    dry = run_script(
        "scale-up.sh",
        "-n",
        pods.namespace,
        "--replicas",
        "3",
        "--dry-run",
        mqds_endpoints=founders,
        cluster_secret=secret,
    )
    assert dry.returncode == 0, dry.stderr
    assert f"admin join {new} --address {pods.unmapped_env[new]['MQDS_ADVERTISE']}" in dry.stdout
    assert "dry run: nothing was changed" in dry.stdout
    assert new not in [n.id for n in cluster_map(founders[0], pods.tokens["reader"]).nodes]

    up = run_script(
        "scale-up.sh",
        "-n",
        pods.namespace,
        "--replicas",
        "3",
        "--address",
        pods.address(new),
        mqds_endpoints=founders,
        cluster_secret=secret,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"scale statefulset {pods.name} -n {pods.namespace} --replicas=4" in up.stdout
    assert f"node {new} joined" in up.stdout and "rebalanced" in up.stdout
    assert wait_serving(pods.address(new), 60, READY), pods.processes.output(new)
    held = [v.shard for v in cluster_map(founders[0], pods.tokens["reader"]).vnodes if new in v.replicas]
    assert held, "the rebalance moved replicas onto the new node"
    wait_status_ok(pods.endpoints(4), pods.tokens["reader"])

    # A failed leave (no such node) scales nothing.
    bad = run_script(
        "scale-down.sh", "-n", pods.namespace, "--replicas", "9", mqds_endpoints=founders, cluster_secret=secret
    )
    assert bad.returncode == 1 and "nothing was scaled" in bad.stderr
    assert "scale statefulset" not in bad.stdout

    dry = run_script(
        "scale-down.sh",
        "-n",
        pods.namespace,
        "--replicas",
        "4",
        "--dry-run",
        mqds_endpoints=founders,
        cluster_secret=secret,
    )
    assert dry.returncode == 0 and f"admin leave {new}" in dry.stdout, dry.stdout + dry.stderr
    assert new in [n.id for n in cluster_map(founders[0], pods.tokens["reader"]).nodes], "a dry run changes nothing"

    down = run_script(
        "scale-down.sh", "-n", pods.namespace, "--replicas", "4", mqds_endpoints=founders, cluster_secret=secret
    )
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"node {new} left the cluster" in down.stdout
    lines = down.stdout.splitlines()
    # kubectl (echo) ran after the leave: scale to 3, wait for the pod to go, delete its claim.
    scale = lines.index(f"scale statefulset {pods.name} -n {pods.namespace} --replicas=3")
    assert lines.index(f"node {new} left the cluster; it can be stopped now") < scale
    assert f"wait --for=delete pod/{new} -n {pods.namespace} --timeout=1800s" in lines[scale:]
    assert f"delete pvc data-{new} -n {pods.namespace}" in lines[scale:]
    cmap = cluster_map(founders[0], pods.tokens["reader"])
    assert new not in [n.id for n in cmap.nodes]
    assert all(new not in v.replicas and len(v.replicas) == 3 for v in cmap.vnodes)
    # What the scale-down does to the pod: SIGTERM; the cluster stays whole.
    assert pods.processes.terminate(new) == 0, pods.processes.output(new)
    assert "OK:" in wait_status_ok(founders, pods.tokens["reader"])


def test_tls_component_pod_serves_tls_and_its_exec_probes_pass(tmp_path: Path) -> None:
    objects = kustomize_with_components(tmp_path / "overlay", [dev_overlay()], [K8S / "components" / "tls"])
    pods = Pods(tmp_path / "pods", objects)
    pod = pods.pod(0)
    # The component ships no Secret mqds-tls: cert-manager (or the user) makes it. Here: a certificate for the
    # pod's DNS name, and 127.0.0.1, which the loopback mapping puts in its place.
    assert not [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "mqds-tls"]
    ca = TestCA(tmp_path / "ca")
    issued = ca.issue(pod, dns=(f"{pod}.{pods.service}.{pods.namespace}.svc.cluster.local",), ips=("127.0.0.1",))
    files = {"tls.crt": issued.cert_file, "tls.key": issued.key_file, "ca.crt": ca.file}
    pods.objects.append(
        out_of_band_secret("mqds-tls", pods.namespace, {name: path.read_text() for name, path in files.items()})
    )
    try:
        pods.start(0)
        env = pods.env[pod]

        def probe(kind: str, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
            """The StatefulSet's exec probe, run as the kubelet would: in the container's environment."""
            command = [
                str(image_file(w)) if w.startswith("/opt/mqds/") else w for w in pods.container[kind]["exec"]["command"]
            ]
            return subprocess.run(command, env=environ or env, capture_output=True, text=True, timeout=30)

        wait_until(f"{pod}'s startup probe", lambda: probe("startupProbe").returncode == 0, 60)
        assert probe("livenessProbe").returncode == 0
        # Alone (its two fellow founders are not started) it is alive but not ready.
        not_ready = probe("readinessProbe")
        assert not_ready.returncode == 1 and "NOT_SERVING" in not_ready.stderr, not_ready.stderr
        # It really is TLS with client certificates: a plaintext probe, and one without the node's certificate, fail.
        assert health(pods.address(pod), "") != "SERVING"
        other = TestCA(tmp_path / "other").issue("stranger")
        stranger = {**env, "MQDS_TLS_CERT_FILE": str(other.cert_file), "MQDS_TLS_KEY_FILE": str(other.key_file)}
        assert probe("livenessProbe", stranger).returncode == 1
        pods.processes.assert_running()
    finally:
        pods.processes.kill_all()
