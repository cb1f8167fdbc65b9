"""The docker-compose stack: valid against the compose spec, its commands and healthchecks real, its demo reachable and fenced."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from compose_services import COMPOSE, ROOT, env_example, interpolate, variable_defaults

OURS = {"prefect-deploy", "prefect-worker", "dask-scheduler", "dask-worker", "dask-cuda-worker"}
# Built from our image too, but holds no Prefect or S3 settings: it only serves the demo corpus.
CORPUS = "demo-corpus"
# The packages the image installs (Dockerfile: COPY ... and pip install).
PACKAGES = ("flows", "tasks", "loaders", "deployments")


@pytest.fixture(scope="module")
def stack() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_validates_against_the_compose_spec():
    exe = Path(sys.executable).with_name("check-jsonschema")
    out = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_spec_check_catches_a_broken_file(tmp_path):
    # The validation above can fail: a service with an unknown key does not pass.
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: busybox\n    comand: [true]\n")
    exe = Path(sys.executable).with_name("check-jsonschema")
    out = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(bad)], capture_output=True, text=True
    )
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
    """The programs a compose command runs; ``sh -c`` scripts are split into their commands,
    ``python -m pkg.module`` is named by its module."""
    argv = command if isinstance(command, list) else shlex.split(command)
    if argv[:2] == ["python", "-m"]:
        return [f"-m {argv[2]}"]
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
    assert OURS | {CORPUS} <= set(services)
    for name in OURS | {CORPUS}:
        svc = services[name]
        assert svc["build"]["dockerfile"] == "Dockerfile", name
        for exe in executables(svc["command"]):
            if exe.startswith("-m "):
                module = exe[3:]
                assert module.split(".")[0] in PACKAGES and importlib.util.find_spec(module), (
                    f"{name}: python -m {module} is not in the image"
                )
            else:
                assert exe in scripts, f"{name}: {exe} is not a console script of shardsmith's dependencies"


def test_every_long_running_service_has_a_healthcheck_that_waits_can_rely_on(stack):
    services = stack["services"]
    one_shot = {name for name, svc in services.items() if svc.get("restart") == "no"}
    assert one_shot == {"prefect-deploy", "minio-init"}
    for name in set(services) - one_shot:
        hc = services[name].get("healthcheck") or {}
        assert hc.get("test") and hc["test"][0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy, which it never is"
    # Runs start only once the cluster they use and the corpus they read answer.
    assert services["prefect-worker"]["depends_on"]["dask-scheduler"]["condition"] == "service_healthy"
    assert services["prefect-worker"]["depends_on"][CORPUS]["condition"] == "service_healthy"


def option_of(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def asked_port(service: dict) -> int:
    """The loopback port a service's python healthcheck asks."""
    text = " ".join(service["healthcheck"]["test"])
    m = re.search(r"http://127\.0\.0\.1:(\d+)/(api/)?health'", text)
    assert m, text
    return int(m.group(1))


def test_each_healthcheck_asks_the_port_its_service_listens_on(stack):
    from prefect.settings import get_current_settings

    s = stack["services"]

    def option(name: str, flag: str) -> str:
        return option_of(s[name]["command"], flag)

    assert asked_port(s["prefect-server"]) == int(option("prefect-server", "--port"))
    assert f":{asked_port(s['dask-scheduler'])}" == option("dask-scheduler", "--dashboard-address")
    for name in ("dask-worker", "dask-cuda-worker"):
        assert f":{asked_port(s[name])}" == option(name, "--dashboard-address")
    assert asked_port(s[CORPUS]) == int(option(CORPUS, "--port")) == 80
    # The Prefect worker's healthcheck server listens on Prefect's default webserver port.
    assert "--with-healthcheck" in s["prefect-worker"]["command"]
    assert asked_port(s["prefect-worker"]) == get_current_settings().worker.webserver.port
    # One worker process per container, so the healthcheck covers the whole container.
    assert option("dask-worker", "--nworkers") == "1" and str(s["dask-worker"]["scale"]).startswith("${DASK_WORKERS")


def test_env_example_lists_every_variable_with_the_compose_default():
    # `cp .env.example .env` must give the stack the file describes, and name every knob.
    assert env_example() == variable_defaults()


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


def test_the_demo_corpus_is_the_one_private_address_the_stack_recipe_reaches(stack):
    import ipaddress

    from tasks.formats.recipe import load_recipe
    from tasks.policies.urlguard import AddressPolicy

    s = stack["services"]
    demo_net = stack["networks"]["demo"]
    assert demo_net["internal"] is True
    defaults = variable_defaults()
    subnet = ipaddress.ip_network(interpolate(demo_net["ipam"]["config"][0]["subnet"], {}))
    corpus = s[CORPUS]
    address = ipaddress.ip_address(interpolate(corpus["networks"]["demo"]["ipv4_address"], {}))
    assert address in subnet and str(address) == defaults["SHARDSMITH_DEMO_ADDRESS"]
    assert set(corpus["networks"]) == {"demo"} and corpus["environment"] == {"HF_HUB_OFFLINE": "1"}  # no credentials
    # Only the corpus and the containers that download from it are on that network.
    on_demo = {name for name, svc in s.items() if "demo" in (svc.get("networks") or [])}
    assert on_demo == {CORPUS, "prefect-worker", "dask-worker", "dask-cuda-worker"}

    # The stack recipe, as the worker's environment resolves it.
    env = interpolate(s["prefect-worker"]["environment"], {})
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        recipe = load_recipe(ROOT / "recipes" / "stack-demo.yaml")
    assert recipe.storage == f"s3://{defaults['SHARDSMITH_BUCKET']}/datasets"
    base_url = option_of(corpus["command"], "--base-url")
    assert env["SHARDSMITH_DEMO_URL"] == base_url == "http://demo-corpus"  # port 80: no port in the URLs
    assert all(src.manifest.startswith(f"{base_url}/manifests/") for src in recipe.sources)
    mounts = {v.split(":")[1] for v in s["dask-worker"]["volumes"]}
    assert option_of(corpus["command"], "--out") in mounts
    assert recipe.precache.image_latents.model.startswith(env["SHARDSMITH_DEMO_MODELS"] + "/")
    net = recipe.download.network
    assert not net.allow_private_networks and net.allowed_networks == (f"{address}/32",)
    policy = AddressPolicy.from_config(net)
    assert policy.allows(address)
    # Another container on the demo network (a worker's own address), one on the default
    # network (MinIO, PostgreSQL, the Prefect API) and the host's loopback stay refused.
    for other in (address + 1, ipaddress.ip_address("172.18.0.5"), ipaddress.ip_address("127.0.0.1")):
        assert not policy.allows(other), other


def test_the_active_nightly_schedule_is_the_stacks_demo():
    deploy = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    active = {
        d["name"]: d for d in deploy["deployments"] if any(s.get("active", True) for s in d.get("schedules") or [])
    }
    assert list(active) == ["stack-demo"]
    assert active["stack-demo"]["parameters"]["recipe_path"] == "recipes/stack-demo.yaml"
    # The laptop demo's schedule stays, paused: it needs a server only `shardsmith demo` runs.
    demo = next(d for d in deploy["deployments"] if d["name"] == "demo")
    assert [s["active"] for s in demo["schedules"]] == [False]


def test_dockerfile_holds_what_the_services_run():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", text, re.M)  # pyproject: requires-python 3.11
    assert "WORKDIR /opt/shardsmith" in text and "SHARDSMITH_HOME=/opt/shardsmith" in text
    # Every package setuptools ships, plus the recipes and deployments the flows read.
    for folder in ("flows", "tasks", "loaders", "deployments", "recipes"):
        assert f"COPY {folder} ./{folder}" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored and "flows" not in ignored
    # Mount points of the named volumes, owned by the user the services run as.
    assert "mkdir -p /shared /demo && chown shardsmith /shared /demo" in text


def _has_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_compose(), reason="no docker compose here")
def test_docker_compose_config_resolves():
    out = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
