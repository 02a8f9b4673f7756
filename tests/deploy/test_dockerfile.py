"""deploy/Dockerfile runs for real here, without a container engine.

The build stage's commands run as a script, with container paths under a temporary root (the
base image's system packages are checked, not installed), and the image's entrypoint,
environment and HEALTHCHECK start and probe a node; the image's `mqds broker` stores in it. The
substitutions that put containers on loopback are documented in tests/deploy_support.py.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from deploy_checks import READY, accepts, check_broker_serves, container_port, scrape
from deploy_support import (
    DEPLOY,
    Loopback,
    Processes,
    Stage,
    copy_context,
    dockerfile,
    healthcheck_command,
    image_distributions,
    image_stage,
    write_auth_tokens,
)

from mqds.tools.ports import free_port
from mqds.tools.waiting import wait_serving, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def rooted(text: str, root: Path) -> str:
    """Absolute container paths in ``text`` under ``root`` (/opt/mqds -> ROOT/opt/mqds)."""
    return re.sub(r"(?<![\w./$-])/(?=\w)", str(root) + "/", text)


def copy_instruction(args: str, context: Path, workdir: Path, root: Path) -> None:
    """COPY SRC... DEST from the build context, as Docker does: a directory's contents go into DEST."""
    *sources, dest = args.split()
    target = Path(rooted(dest, root)) if dest.startswith("/") else workdir / dest
    for source in sources:
        src = context / source
        if src.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cp", "-a", f"{src}/.", str(target)], check=True, timeout=60)
        elif dest.endswith("/") or len(sources) > 1:
            target.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cp", "-a", str(src), str(target / src.name)], check=True, timeout=60)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cp", "-a", str(src), str(target)], check=True, timeout=60)


def dependency_farm(directory: Path) -> Path:
    """A directory of links to the test virtualenv's copies of the third-party distributions the image's
    pip command installs (image_distributions: its projects, the extras it names, their requirements),
    and nothing else: what the image lacks, the test's image lacks too."""
    site = Path(sysconfig.get_paths()["purelib"])
    directory.mkdir(parents=True)
    for name in sorted(image_distributions()):
        if name.startswith("mqds-"):
            continue  # built from the sources by the Dockerfile's pip command
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            if (site / top).exists() and not (directory / top).exists():
                (directory / top).symlink_to(site / top)
    return directory


def run_build_stage(stage: Stage, context: Path, root: Path, shim: Path, deps: Path) -> None:
    """The build stage's WORKDIR, COPY and RUN instructions, in order, with paths under ``root``.

    Dependencies come from the test's virtualenv instead of PyPI (PIP_NO_DEPS and a .pth into each new
    virtualenv); the packages themselves are built from the copied sources by the Dockerfile's pip
    command, in pip's usual isolated build environment."""
    env = {k: rooted(v, root) for k, v in stage.env().items()}
    env.update(PATH=f"{shim}:/usr/bin:/bin", HOME=str(root / "root"), PIP_NO_DEPS="1")
    workdir = root
    for inst in stage.instructions:
        if inst.keyword == "WORKDIR":
            workdir = Path(rooted(inst.args, root))
            workdir.mkdir(parents=True, exist_ok=True)
        elif inst.keyword == "COPY":
            assert "from" not in inst.flags
            copy_instruction(inst.args, context, workdir, root)
        elif inst.keyword == "RUN" and inst.args.startswith("apt-get "):
            # The base image's system packages: checked, not run (it would change this machine). The
            # compiler it installs is one this machine has (make install builds the same C part).
            assert re.fullmatch(
                r"apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev "
                r"&& rm -rf /var/lib/apt/lists/\*",
                inst.args,
            ), inst.args
            assert shutil.which("gcc"), "the build stage installs gcc: this machine needs one to build as it does"
        elif inst.keyword == "RUN":
            result = subprocess.run(
                ["/bin/sh", "-ec", rooted(inst.args, root)],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 0, f"RUN {inst.args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            for cfg in root.glob("opt/*/pyvenv.cfg"):
                purelib = next(cfg.parent.glob("lib/python3*/site-packages"))
                (purelib / "zz_test_dependencies.pth").write_text(f"{deps}\n")
        else:
            assert inst.keyword == "ENV", f"the test does not run {inst.keyword} in the build stage"


def test_dockerfile_builds_here_and_its_entrypoint_serves(tmp_path: Path) -> None:
    build, image = dockerfile()[0], image_stage()
    root = tmp_path / "fs"
    context = copy_context(tmp_path / "context")
    shim = tmp_path / "shim"
    shim.mkdir()
    # The base image's python (with pip): this test's interpreter, the same version as python:3.11-slim's.
    (shim / "python").symlink_to(sys.executable)
    run_build_stage(build, context, root, shim, dependency_farm(tmp_path / "deps"))

    # The final stage: COPY --from=build of the same path (one root here: nothing to copy), and
    # system setup that the test checks and does not run (it would add a user to this machine).
    for inst in image.instructions:
        if inst.keyword == "COPY":
            assert inst.flags.get("from") == build.name
            source, dest = inst.args.split()
            assert source == dest, "a virtualenv only works at the path it was built at"
            assert Path(rooted(source, root)).is_dir()
        if inst.keyword == "RUN":
            for command in re.split(r"\s*&&\s*", inst.args):
                program = command.split()[0]
                assert program in ("groupadd", "useradd", "mkdir", "chown"), command
                if program == "mkdir":
                    subprocess.run(rooted(command, root), shell=True, check=True, timeout=30)

    venv_python = Path(rooted("/opt/mqds/bin/python", root))
    # Where the packages are, and whether the node encodes answers in C (the build stage compiles it).
    probe = "import mqds.client; from mqds.server import wire; print(wire.__file__, mqds.client.__file__, wire.NATIVE)"
    *where, native = subprocess.run(
        [str(venv_python), "-c", probe], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert all(path.startswith(str(root / "opt" / "mqds" / "lib")) for path in where), where
    assert native == "True", "the image's node encodes answers in C"
    check = subprocess.run(
        [str(shim / "python"), "-m", "pip", "--python", str(venv_python), "check"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert not [line for line in check.splitlines() if line.startswith("mqds-")], check

    # The container: the image's ENV, WORKDIR, ENTRYPOINT and HEALTHCHECK; its ports on loopback.
    loop = Loopback(lambda host: None)
    env = {k: loop.rewrite(rooted(v, root), "node") for k, v in image.env().items()}
    env["PATH"] = env["PATH"].replace("$PATH", "/usr/local/bin:/usr/bin:/bin")
    workdir = Path(rooted(image.required("WORKDIR").args, root))
    env.update(HOME=str(workdir), HOSTNAME="mqds-image-test")
    volume = yaml.safe_load(image.required("VOLUME").args)
    assert env["MQDS_DATA_DIR"] in [rooted(v, root) for v in volume]
    entrypoint = image.required("ENTRYPOINT").exec_form()
    assert image.last("CMD") is None

    # Secure by default: the image listens on 0.0.0.0, so without client tokens its node refuses to start
    # (here on free ports, every interface, as the image's environment says).
    every_interface = {k: f"0.0.0.0:{free_port()}" for k, v in image.env().items() if v.startswith("0.0.0.0:")}
    exposed = {**env, **every_interface}
    assert exposed["MQDS_LISTEN"].startswith("0.0.0.0:") and "MQDS_AUTH_TOKENS_FILE" not in exposed
    refused = subprocess.run(entrypoint, env=exposed, cwd=workdir, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "can be reached from other machines and auth_tokens_file is not set" in refused.stderr, refused.stderr
    # As the image's header says to run it: with a tokens file.
    tokens = write_auth_tokens(tmp_path / "auth-tokens.txt")
    env["MQDS_AUTH_TOKENS_FILE"] = str(tmp_path / "auth-tokens.txt")

    processes = Processes(tmp_path / "logs")
    try:
        proc = processes.start("image", entrypoint, env, workdir)
        address = loop.address("node", container_port(image.env()["MQDS_LISTEN"]))
        assert wait_serving(address, 60, READY), processes.output("image")
        exe = Path(os.readlink(f"/proc/{proc.pid}/exe")) if Path("/proc").is_dir() else None
        assert exe is None or exe.name.startswith("python")
        assert str(root) in Path(f"/proc/{proc.pid}/cmdline").read_text(), "the image's mqds-server runs"
        assert list((workdir / "shards").iterdir()), "data goes to the volume"
        probe = [rooted(word, root) for word in healthcheck_command(image)]
        for extra in ([], ["--service", READY]):
            result = subprocess.run([*probe, *extra], env=env, capture_output=True, text=True, timeout=30)
            assert result.returncode == 0, result.stderr
        cli = subprocess.run(
            [rooted("/opt/mqds/bin/mqds", root), "--endpoints", address, "--token", tokens["reader"], "status"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0 and "OK:" in cli.stdout, cli.stdout + cli.stderr
        scrape(loop.address("node", container_port(image.env()["MQDS_METRICS_LISTEN"])))
        # The image's `mqds broker` (amqtt, the broker extra) stores in that node; it reads YAML rules.
        broker_port = loop.address("broker", 1883)
        processes.start(
            "broker",
            [
                rooted("/opt/mqds/bin/mqds", root),
                "broker",
                "--listen",
                broker_port,
                "--endpoints",
                address,
                "--hooks",
                str(DEPLOY / "hooks" / "cassandra-style.yaml"),
            ],
            {**env, "MQDS_TOKEN": tokens["broker"]},
            workdir,
        )
        wait_until("the image's mqds broker accepting", lambda: processes.assert_running() or accepts(broker_port), 60)
        processes.assert_running()
        check_broker_serves(broker_port, [address], "image-broker", tokens["reader"])
        assert processes.terminate("broker") == 0, processes.output("broker")
        assert processes.terminate("image") == 0, processes.output("image")
        down = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
        assert down.returncode == 1 and "healthcheck:" in down.stderr
    finally:
        processes.kill_all()
