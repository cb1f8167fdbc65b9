"""The docker-compose stack: valid against the compose spec, and every command exists in the image."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
OURS = {"prefect-deploy", "prefect-worker", "dask-scheduler", "dask-worker", "dask-cuda-worker"}


@pytest.fixture(scope="module")
def stack() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_validates_against_the_compose_spec():
    exe = Path(sys.executable).with_name("check-jsonschema")
    out = subprocess.run([str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_spec_check_catches_a_broken_file(tmp_path):
    # The validation above can fail: a service with an unknown key does not pass.
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: busybox\n    comand: [true]\n")
    exe = Path(sys.executable).with_name("check-jsonschema")
    out = subprocess.run([str(exe), "--builtin-schema", "vendor.compose-spec", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0


def console_scripts() -> set[str]:
    """Console scripts of shardsmith and everything it requires, transitively."""
    seen: set[str] = set()
    scripts: set[str] = set()
    todo = ["shardsmith"]
    while todo:
        name = re.split(r"[\s;\[<>=!~]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional extra that this platform does not install
        scripts |= {ep.name for ep in dist.entry_points if ep.group == "console_scripts"}
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
    return scripts


def executables(command: list[str] | str) -> list[str]:
    """The programs a compose command runs; ``sh -c`` scripts are split into their commands."""
    argv = command if isinstance(command, list) else shlex.split(command)
    if argv[:2] != ["sh", "-c"]:
        return [argv[0]]
    out = []
    for part in re.split(r"&&|\|\||;", argv[2]):
        words = [w for w in shlex.split(part) if w not in ("if", "then", "else", "fi")]
        if words and words[0] != "[":
            out.append(words[0])
    return out


def test_every_command_of_our_services_is_installed_by_our_dependencies(stack):
    scripts = console_scripts()
    assert {"shardsmith", "prefect", "dask", "dask-cuda-worker"} <= scripts
    services = stack["services"]
    assert OURS <= set(services)
    for name in OURS:
        svc = services[name]
        assert svc["build"]["dockerfile"] == "Dockerfile", name
        for exe in executables(svc["command"]):
            assert exe in scripts, f"{name}: {exe} is not a console script of shardsmith's dependencies"


def test_stack_wiring(stack):
    s = stack["services"]
    assert s["postgres"]["healthcheck"]["test"]
    server = s["prefect-server"]
    assert server["image"].startswith("prefecthq/prefect:3.9")
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    env = server["environment"]
    assert env["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert env["PREFECT_SERVER_API_AUTH_STRING"].startswith("${PREFECT_AUTH")
    assert "localhost" in env["PREFECT_UI_API_URL"]  # reachable from a browser on the host
    for name in OURS:
        e = s[name]["environment"]
        assert e["PREFECT_API_URL"] == "http://prefect-server:4200/api"
        assert e["PREFECT_API_AUTH_STRING"] == env["PREFECT_SERVER_API_AUTH_STRING"]
        assert e["AWS_ENDPOINT_URL"] == "http://minio:9000"
        assert "shared:/shared" in s[name]["volumes"] and e["PREFECT_RESULTS_LOCAL_STORAGE_PATH"].startswith("/shared/")
    # The worker serves the pool prefect.yaml deploys to.
    deploy = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    pool = {d["work_pool"]["name"] for d in deploy["deployments"]}
    worker = s["prefect-worker"]["command"]
    assert pool == {worker[worker.index("--pool") + 1]} and worker[worker.index("--type") + 1] == "process"
    gpu = s["dask-cuda-worker"]
    assert gpu["profiles"] == ["gpu"]
    assert " ".join(gpu["command"]).count("--resources GPU=1") == 1
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "profiles" not in s["dask-worker"]
    assert "mc mb" in " ".join(s["minio-init"]["entrypoint"])
    assert s["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"


def test_dockerfile_holds_what_the_services_run():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", text, re.M)  # pyproject: requires-python 3.11
    assert "WORKDIR /opt/shardsmith" in text and "SHARDSMITH_HOME=/opt/shardsmith" in text
    # Every package setuptools ships, plus the recipes and deployments the flows read.
    for folder in ("flows", "tasks", "loaders", "deployments", "recipes"):
        assert f"COPY {folder} ./{folder}" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored and "flows" not in ignored


def _has_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_compose(), reason="no docker compose here")
def test_docker_compose_config_resolves():
    out = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
