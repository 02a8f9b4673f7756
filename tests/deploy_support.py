"""What the deployment tests share: deploy/Dockerfile, deploy/docker-compose.yml and the rendered
Kubernetes manifests read as data, and the mechanical mappings that run their commands here.

No container engine or Kubernetes cluster runs on the test machine, so the tests start the very
commands, arguments and environments those files give their containers as local processes, with
three documented substitutions and nothing else:

* addresses: every ``HOST:PORT`` that names a node (a compose service name, a pod's DNS name
  ``<pod>.<service>.<namespace>.svc.<domain>``, or ``0.0.0.0`` in that node's own settings)
  becomes ``127.0.0.1:P`` with P a free port, one per (node, port) pair: what a container
  network does with names, loopback does with ports (:class:`Loopback`);
* paths: a container path under a volume mount (``/var/lib/mqds``) or the image's install
  prefix becomes a directory of the test's (:func:`map_path`);
* programs: the image's ``/opt/mqds/bin`` is the test's virtualenv (``PATH``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.metadata
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from repo_paths import ROOT

from mqds.tools.ports import free_port

DEPLOY = ROOT / "deploy"
K8S = ROOT / "k8s"
COMPONENTS = K8S / "components"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
PROMETHEUS_FILE = DEPLOY / "prometheus.yml"
VENV_BIN = Path(sys.executable).parent

# -- Dockerfile ---------------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str
    flags: dict[str, str] = field(default_factory=dict)

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form CMD/ENTRYPOINT/RUN (or the words of a shell form)."""
        text = self.args.strip()
        if text.startswith("["):
            value = json.loads(text)
            assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
            return value
        return shlex.split(text)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None

    def required(self, keyword: str) -> Instruction:
        """The last ``keyword`` instruction, which the stage must have."""
        found = self.last(keyword)
        assert found is not None, f"the stage has no {keyword}"
        return found

    def env(self) -> dict[str, str]:
        """The stage's ENV, in order; ``$NAME`` of an earlier ENV is expanded, others (``$PATH``) kept."""
        env: dict[str, str] = {}
        for inst in self.all("ENV"):
            for word in shlex.split(inst.args):
                key, sep, value = word.partition("=")
                assert sep, f"ENV {inst.args!r}: use the KEY=VALUE form"
                env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), value)
        return env


def parse_dockerfile(text: str) -> list[Stage]:
    """Stages of a Dockerfile: continuation lines joined, comment lines dropped, leading --flags split off."""
    logical: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        flags: dict[str, str] = {}
        rest = rest.strip()
        while rest.startswith("--"):
            word, _, rest = rest.partition(" ")
            name, _, value = word[2:].partition("=")
            flags[name] = value
            rest = rest.strip()
        if keyword == "FROM":
            words = rest.split()
            stages.append(Stage(base=words[0], name=words[2] if len(words) == 3 and words[1].upper() == "AS" else None))
            continue
        assert stages, f"{keyword} before FROM"
        stages[-1].instructions.append(Instruction(keyword, rest, flags))
    return stages


def dockerfile() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())


def image_stage() -> Stage:
    """The final stage: what the image is."""
    return dockerfile()[-1]


def healthcheck_command(stage: Stage) -> list[str]:
    inst = stage.last("HEALTHCHECK")
    assert inst is not None, "the image has no HEALTHCHECK"
    kind, _, rest = inst.args.partition(" ")
    assert kind.upper() == "CMD", inst.args
    return Instruction("CMD", rest).exec_form()


def image_file(container_path: str) -> Path:
    """The repository file a COPY instruction puts at ``container_path`` in the image."""
    for stage in dockerfile():
        for inst in stage.all("COPY"):
            *sources, dest = inst.args.split()
            if "from" not in inst.flags and dest == container_path and len(sources) == 1:
                return ROOT / sources[0]
    raise AssertionError(f"no COPY puts a file at {container_path}")


def dockerignore_filter(patterns_text: str) -> Callable[[str], bool]:
    """``included(relative_path)`` by .dockerignore rules: the last matching pattern wins, ``!`` re-includes,
    and a pattern that matches a directory matches everything below it."""
    rules: list[tuple[re.Pattern[str], bool]] = []
    for raw in patterns_text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line[1:] if include else line
        pattern = pattern.strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((re.compile(regex + "(?:/.*)?"), include))

    def included(path: str) -> bool:
        verdict = True
        for regex, include in rules:
            if regex.fullmatch(path):
                verdict = include
        return verdict

    return included


def copy_context(destination: Path) -> Path:
    """The build context the image sees: the repository's files (tracked or not ignored by git; the
    ignore file excludes everything git ignores too) filtered by deploy/Dockerfile.dockerignore."""
    included = dockerignore_filter((DEPLOY / "Dockerfile.dockerignore").read_text())
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split("\n")
    for relative in filter(None, tracked):
        source = ROOT / relative
        if source.is_file() and included(relative):
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def pip_installs(stage: Stage) -> list[tuple[Path, frozenset[str]]]:
    """The local projects the stage's ``pip ... install`` commands install, with the extras they ask for."""
    installs: list[tuple[Path, frozenset[str]]] = []
    for inst in stage.all("RUN"):
        words = shlex.split(inst.args)
        if "pip" not in words or "install" not in words:
            continue
        for word in words[words.index("install") + 1 :]:
            if word.startswith("-"):
                continue
            match = re.fullmatch(r"(?P<path>[^\[]+)(?:\[(?P<extras>[^\]]*)\])?", word)
            assert match and match.group("path").startswith("."), f"not a local project: {word}"
            extras = frozenset(e.strip() for e in (match.group("extras") or "").split(",") if e.strip())
            installs.append(((ROOT / match.group("path")).resolve(), extras))
    return installs


def image_distributions() -> set[str]:
    """Every distribution (canonical name) the image's build stage installs: the local projects its pip
    command names, their dependencies and those of the extras it asks for (from their pyproject.toml),
    and transitively what those require (their metadata in the test virtualenv: the same versions)."""
    local: dict[str, tuple[dict[str, Any], frozenset[str]]] = {}
    for path, extras in pip_installs(dockerfile()[0]):
        project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
        local[canonicalize_name(project["name"])] = (project, extras)
    found: set[str] = set(local)
    pending: list[tuple[str, list[str], frozenset[str]]] = []
    for name, (project, extras) in local.items():
        optional = project.get("optional-dependencies", {})
        assert extras <= set(optional), f"{name} has no extra {sorted(extras - set(optional))}"
        pending.append((name, [*project.get("dependencies", []), *(r for e in extras for r in optional[e])], extras))
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        _, requirements, extras = pending.pop()
        for text in requirements:
            req = Requirement(text)
            env = default_environment()
            if req.marker is not None and not any(
                req.marker.evaluate({**env, "extra": e})
                for e in {"", *extras}  # type: ignore[dict-item]
            ):
                continue
            name = canonicalize_name(req.name)
            found.add(name)
            key = (name, frozenset(req.extras))
            if name in local or key in seen:
                continue
            seen.add(key)
            try:
                pending.append((name, importlib.metadata.requires(name) or [], frozenset(req.extras)))
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def distributions_of_imports(modules: Iterable[str]) -> dict[str, set[str]]:
    """Importing ``modules`` in a fresh interpreter of the test virtualenv: every third-party or mqds
    top-level module that ends up loaded, with the distributions (canonical names) that provide it."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.partition('.')[0] for m in sys.modules})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    providers = importlib.metadata.packages_distributions()
    loaded = {m for m in json.loads(result.stdout) if m not in sys.stdlib_module_names and not m.startswith("_")}
    return {m: {canonicalize_name(d) for d in providers.get(m, [])} for m in loaded if m in providers}


# -- the mqds command line ----------------------------------------------------------------------


def mqds_cli(argv: list[str], environ: Mapping[str, str]) -> argparse.Namespace:
    """``mqds ARGS...`` as the real command line parses it in a process whose environment is ``environ``
    (the parser takes $MQDS_ENDPOINTS and $MQDS_TOKEN for its defaults). A wrong command line fails."""
    from mqds.cli import build_parser

    assert Path(argv[0]).name == "mqds", argv
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        parser = build_parser()
        try:
            return parser.parse_args(argv[1:])
        except SystemExit as exit_:
            raise AssertionError(f"mqds rejects {argv[1:]} (exit {exit_.code})") from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def unused_settings(argv: list[str], environ: Mapping[str, str]) -> list[str]:
    """The names in ``environ`` that do not change what ``mqds ARGS...`` parses to: no setting of it."""
    without = vars(mqds_cli(argv, {}))
    return [name for name in environ if vars(mqds_cli(argv, {name: environ[name]})) == without]


# -- compose ------------------------------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")


def compose_interpolate(value: str, environ: Mapping[str, str]) -> str:
    """Compose's variable substitution: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
    ``${VAR:?error}`` and ``${VAR?error}``."""

    def substitute(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        if match.group("named"):
            return environ.get(match.group("named"), "")
        body = match.group("braced")
        name_match = re.match(r"[A-Za-z_][A-Za-z0-9_]*", body)
        assert name_match, f"bad interpolation ${{{body}}}"
        name, rest = name_match.group(0), body[name_match.end() :]
        value = environ.get(name)
        if rest.startswith((":-", ":?")):
            operator, argument = rest[:2], rest[2:]
            unset = not value
        elif rest.startswith(("-", "?")):
            operator, argument = rest[:1], rest[1:]
            unset = value is None
        else:
            assert not rest, f"bad interpolation ${{{body}}}"
            return value or ""
        if not unset:
            return value or ""
        if operator.endswith("?"):
            raise ValueError(f"required variable {name} is missing a value: {argument}")
        return compose_interpolate(argument, environ)

    return _INTERPOLATION.sub(substitute, value)


def load_compose(environ: Mapping[str, str]) -> dict[str, Any]:
    """deploy/docker-compose.yml parsed (YAML merge keys resolved) and interpolated with ``environ``."""
    doc = yaml.safe_load(COMPOSE_FILE.read_text())

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return compose_interpolate(node, environ)
        if isinstance(node, list):
            return [walk(n) for n in node]
        if isinstance(node, dict):
            return {key: walk(value) for key, value in node.items()}
        return node

    result = walk(doc)
    assert isinstance(result, dict)
    return result


def compose_environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's ``environment`` as a dict (it may be a mapping or a list of KEY=VALUE)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


# -- Kubernetes ---------------------------------------------------------------------------------


def kustomize_command() -> list[str]:
    """How to run kustomize here: a kustomize binary, else ``kubectl kustomize`` (kustomize built in)."""
    if path := shutil.which("kustomize"):
        return [path, "build"]
    if path := shutil.which("kubectl"):
        return [path, "kustomize"]
    pytest.skip("neither kustomize nor kubectl is installed: cannot render the manifests")


ROLES = ("reader", "broker", "admin")


def write_auth_tokens(path: Path) -> dict[str, str]:
    """A client tokens file as the docs tell the user to make one: a '<role> <token>' line per role."""
    tokens = {role: secrets.token_hex(24) for role in ROLES}
    path.write_text("".join(f"{role} {token}\n" for role, token in tokens.items()))
    return tokens


def read_auth_tokens(text: str) -> dict[str, str]:
    """role -> token of a tokens file's text."""
    return {role: token for role, token in (line.split() for line in text.splitlines() if line.strip())}


def dev_overlay() -> Path:
    """The dev overlay, with the files it needs (made once per checkout, kept out of git): the cluster
    secret and the client tokens."""
    overlay = ROOT / "k8s" / "overlays" / "dev"
    secret = overlay / "cluster-secret.txt"
    if not secret.exists():
        secret.write_text(secrets.token_hex(24))
    tokens = overlay / "auth-tokens.txt"
    if not tokens.exists():
        write_auth_tokens(tokens)
    return overlay


def out_of_band_secret(name: str, namespace: str, data: Mapping[str, str]) -> dict[str, Any]:
    """A Secret made out of band (``kubectl create secret generic NAME --from-literal=...``), to add to rendered
    objects: the manifests never ship one."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "stringData": dict(data),
    }


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """``kustomize build DIRECTORY`` as a list of objects."""
    result = subprocess.run(
        [*kustomize_command(), str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kustomize build {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def kustomize_with_components(
    directory: Path, resources: Iterable[Path], components: Iterable[Path], namespace: str | None = None
) -> list[dict[str, Any]]:
    """Render a kustomization of one's own in ``directory``: ``resources`` (overlays) plus ``components``,
    in ``namespace`` if given (as an overlay that adds the components sets its namespace)."""
    directory.mkdir(parents=True, exist_ok=True)
    relative = [os.path.relpath(path, directory) for path in resources]
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": relative,
        "components": [os.path.relpath(path, directory) for path in components],
    }
    if namespace is not None:
        kustomization["namespace"] = namespace
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return kustomize(directory)


def dev_with_components(directory: Path, *names: str) -> list[dict[str, Any]]:
    """The dev overlay plus k8s/components/NAME for each name, in the overlay's namespace."""
    namespace = find(kustomize(dev_overlay()), "Namespace")["metadata"]["name"]
    return kustomize_with_components(directory, [dev_overlay()], [COMPONENTS / n for n in names], namespace)


def find(objects: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def secret_data(secret: Mapping[str, Any]) -> dict[str, str]:
    values = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    values.update(secret.get("stringData") or {})
    return values


def expand_k8s(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in env values, commands and args: ``$(NAME)`` of a defined
    variable becomes its value, an undefined one stays as written, ``$$`` is a ``$``."""
    out: list[str] = []
    i = 0
    while i < len(value):
        if value[i] == "$" and i + 1 < len(value):
            following = value[i + 1]
            if following == "$":
                out.append("$")
                i += 2
                continue
            if following == "(":
                end = value.find(")", i + 2)
                if end != -1:
                    name = value[i + 2 : end]
                    out.append(env[name] if name in env else value[i : end + 1])
                    i = end + 1
                    continue
        out.append(value[i])
        i += 1
    return "".join(out)


def container_env(
    container: Mapping[str, Any],
    objects: list[dict[str, Any]],
    pod: Mapping[str, str],
    image_env: Mapping[str, str],
) -> dict[str, str]:
    """The environment Kubernetes gives ``container`` of a pod: the image's ENV, then envFrom, then env in
    order, each env value expanded with the variables before it (an ``optional`` secretKeyRef to a Secret or
    key that is not there sets nothing). ``pod`` holds the downward-API fields (``metadata.name``, ...)."""

    def config_map(name: str) -> dict[str, str]:
        return dict(find(objects, "ConfigMap", name).get("data") or {})

    def secret(name: str) -> dict[str, str]:
        return secret_data(find(objects, "Secret", name))

    resolved: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            values = config_map(source["configMapRef"]["name"])
        else:
            values = secret(source["secretRef"]["name"])
        resolved.update({prefix + k: v for k, v in values.items()})
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            resolved[name] = expand_k8s(str(item["value"]), resolved)
            continue
        ref = item["valueFrom"]
        if "fieldRef" in ref:
            resolved[name] = pod[ref["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in ref:
            key_ref = ref["secretKeyRef"]
            present = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == key_ref["name"]]
            if key_ref.get("optional") and (not present or key_ref["key"] not in secret_data(present[0])):
                continue  # an optional Secret (or key) that does not exist: the variable is not set
            resolved[name] = secret(key_ref["name"])[key_ref["key"]]
        elif "configMapKeyRef" in ref:
            resolved[name] = config_map(ref["configMapKeyRef"]["name"])[ref["configMapKeyRef"]["key"]]
        else:
            raise AssertionError(f"env {name}: valueFrom {sorted(ref)} is not resolved by this test")
    return {**image_env, **resolved}


# -- running it here ----------------------------------------------------------------------------

_ADDRESS = re.compile(r"(?<![\w.-])(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):(?P<port>\d{1,5})(?!\d)")


class Loopback:
    """Node addresses mapped to 127.0.0.1, one free port per (node, container port)."""

    def __init__(self, node_of_host: Callable[[str], str | None]) -> None:
        # node_of_host: which node a host name denotes (None: not a node; left alone).
        self.node_of_host = node_of_host
        self.ports: dict[tuple[str, int], int] = {}

    def port(self, node: str, port: int) -> int:
        if (node, port) not in self.ports:
            taken = set(self.ports.values())
            new = free_port()
            while new in taken:
                new = free_port()
            self.ports[(node, port)] = new
        return self.ports[(node, port)]

    def address(self, node: str, port: int) -> str:
        return f"127.0.0.1:{self.port(node, port)}"

    def rewrite(self, text: str, own_node: str) -> str:
        """Every node's HOST:PORT in ``text`` (and ``0.0.0.0:PORT``, meaning ``own_node``) as 127.0.0.1:P."""

        def replace(match: re.Match[str]) -> str:
            host, port = match.group("host"), int(match.group("port"))
            node = own_node if host == "0.0.0.0" else self.node_of_host(host)
            return self.address(node, port) if node else match.group(0)

        return _ADDRESS.sub(replace, text)


def map_path(value: str, mounts: Mapping[str, Path]) -> str:
    """A container path under one of ``mounts`` (container path -> local directory) as the local path."""
    for container_path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if value == container_path or value.startswith(container_path.rstrip("/") + "/"):
            return str(local) + value[len(container_path.rstrip("/")) :]
    return value


def local_path_env(extra_first: Iterable[Path] = ()) -> str:
    """PATH for a container's process here: ``extra_first``, the test's virtualenv (the image's /opt/mqds/bin)."""
    return ":".join([*(str(p) for p in extra_first), str(VENV_BIN), "/usr/local/bin", "/usr/bin", "/bin"])


class Processes:
    """Processes a test starts; every one is killed when the test ends, also when it fails."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: Mapping[str, str], cwd: Path) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cwd.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                argv, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self.procs[name] = proc
        return proc

    def output(self, name: str) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def outputs(self) -> str:
        return "\n".join(f"--- {name} ---\n{self.output(name)}" for name in self.procs)

    def assert_running(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{self.output(name)}"

    def terminate(self, name: str, timeout_s: float = 20, *, signalled: bool = False) -> int:
        """SIGTERM (once: a second one would interrupt the node's shutdown) and the exit code."""
        proc = self.procs[name]
        if proc.poll() is None:
            if not signalled:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        return int(proc.returncode)

    def terminate_all(self, timeout_s: float = 30) -> dict[str, int]:
        """SIGTERM to every process at once, then their exit codes (killed if still running after the timeout)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        return {name: self.terminate(name, timeout_s, signalled=True) for name in self.procs}

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
