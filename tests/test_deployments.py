"""Deployments served against a real Prefect server: schedules, parameter forms, a run from the API."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from deployments.serve import PREFECT_FILE, PROJECT, build_deployments, deployment_specs, local_server, stop_process

pytestmark = pytest.mark.slow


def test_prefect_yaml_is_what_serve_builds():
    specs = {s["name"]: s for s in deployment_specs()}
    built = {d.name: d for d in build_deployments()}
    assert set(built) == set(specs) == {"stack-demo", "demo", "demo-strict", "nightly-rebuild"}
    for name, spec in specs.items():
        d = built[name]
        assert d.entrypoint == spec["entrypoint"].replace("/", os.sep)
        assert d.parameters == spec["parameters"]
        assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in d.schedules] == [
            (s["cron"], s["timezone"], s["active"]) for s in spec["schedules"]
        ]
        assert (d.concurrency_limit, d.concurrency_options.collision_strategy.value) == (1, "ENQUEUE")
        assert spec["work_pool"]["name"] == "shardsmith-process"
    # The pull step is what makes relative recipe paths work under a worker.
    raw = yaml.safe_load(PREFECT_FILE.read_text())
    assert raw["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $SHARDSMITH_HOME }}"
    # Every recipe a deployment names exists, relative to the project folder.
    for spec in specs.values():
        for key in ("recipe_path", "recipes_dir"):
            if key in spec["parameters"]:
                assert (PROJECT / spec["parameters"][key]).exists()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`prefect server start` (API, UI, services) on loopback with a SQLite database of its own."""
    home = tmp_path_factory.mktemp("prefect-home")
    with local_server(env={"PREFECT_HOME": str(home)}) as url:
        yield url


@pytest.fixture(scope="module")
def served(server, tmp_path_factory):
    """`python -m deployments.serve` pointed at the server, with a small demo corpus online."""
    from tasks.demo import prepare_demo

    root = tmp_path_factory.mktemp("demo")
    web, expected = prepare_demo(root, n=40, port=0)
    env = {**os.environ, "PREFECT_API_URL": server, "SHARDSMITH_DEMO_DIR": str(root)}
    log = open(root / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "deployments.serve"], cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield root, expected, proc
    finally:
        stop_process(proc)
        log.close()
        web.stop()


def client(url):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(url)


def wait_for_deployments(url, proc, names, timeout=180):
    deadline = time.monotonic() + timeout
    with client(url) as c:
        while time.monotonic() < deadline:
            found = {d.name: d for d in c.read_deployments()}
            if names <= set(found):
                return found
            if proc.poll() is not None:
                pytest.fail(f"serve exited with {proc.returncode}")
            time.sleep(1)
    pytest.fail(f"deployments {names} not registered within {timeout} s")


def test_served_deployments_schedules_forms_and_a_run(server, served):
    root, expected, proc = served
    found = wait_for_deployments(server, proc, {"demo", "demo-strict", "nightly-rebuild"})
    demo = found["demo"]

    # Schedules with their timezones, as prefect.yaml says. The one active nightly is the
    # stack's (tests/test_stack.py runs it); the laptop demo and the blocked example are paused.
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in demo.schedules] == [("0 2 * * *", "Europe/Amsterdam", False)]
    strict = found["demo-strict"].schedules
    assert [(s.schedule.timezone, s.active) for s in strict] == [("America/New_York", False)]
    assert found["nightly-rebuild"].schedules == []
    for d in found.values():
        assert d.concurrency_options.collision_strategy.value == "ENQUEUE"
        assert d.global_concurrency_limit is not None and d.global_concurrency_limit.limit == 1
        assert d.enforce_parameter_schema

    # The form the UI renders: typed, described, bounded, with the recipe models' bounds.
    schema = demo.parameter_openapi_schema
    props = schema["properties"]
    assert schema["required"] == ["recipe_path"]
    assert props["phases"]["anyOf"][0]["items"]["enum"][:2] == ["download", "validate"]
    assert "pattern" in props["cluster"]["anyOf"][0]
    overrides = schema["definitions"]["RecipeOverrides"]["properties"]
    assert overrides["samples_per_shard"]["anyOf"][0]["minimum"] == 1
    assert overrides["max_reject_rate"]["anyOf"][0]["maximum"] == 1
    assert all(p.get("description") for p in overrides.values())
    assert found["nightly-rebuild"].parameter_openapi_schema["properties"]["recipes_dir"]["default"] == "recipes"

    with client(server) as c:
        # Bad values are refused before any run exists, as the UI's form would refuse them.
        from prefect.exceptions import PrefectHTTPStatusError

        with pytest.raises(PrefectHTTPStatusError) as bad:
            c.create_flow_run_from_deployment(demo.id, parameters={"overrides": {"samples_per_shard": 0}})
        assert bad.value.response.status_code in (409, 422)
        with pytest.raises(PrefectHTTPStatusError):
            c.create_flow_run_from_deployment(demo.id, parameters={"cluster": "somewhere else"})

        # A run with edited parameters, the way the UI's "custom run" starts one.
        params = {"phases": ["download"], "workers": 1, "overrides": {"min_success_rate": 0.6, "task_retries": 1}}
        run = c.create_flow_run_from_deployment(demo.id, parameters=params)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            run = c.read_flow_run(run.id)
            if run.state.is_final():
                break
            time.sleep(1)
        log = (root / "serve.log").read_text(errors="replace")
        assert run.state.is_completed(), f"{run.state}\n{log[-4000:]}"
        assert run.parameters["overrides"]["min_success_rate"] == 0.6

        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        keys = ["demo-download-progress", "demo-download-summary", "demo-download-reasons", "demo-report", "demo-data-docs"]
        arts = {a.key: a for a in c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))}
    assert set(arts) == set(keys)
    assert arts["demo-download-progress"].data == 100.0
    assert str(root) in arts["demo-report"].data and "report.html" in arts["demo-report"].data
    assert f"| {expected['rows']} | {expected['ok']} |" in arts["demo-download-summary"].data
    # The run's outputs are where the recipe says, relative to the project folder.
    assert list((root / "store" / "demo" / "download").rglob("*.ledger.parquet"))
    report = next((root / "store" / "demo" / "reports").glob("*/report.html"))
    assert report.stat().st_size > 0


def test_ui_serves_deployments_page(server):
    import json

    base = server[: -len("/api")]
    # The UI is a single-page app: a browser navigating to any of its routes gets its shell.
    req = urllib.request.Request(f"{base}/deployments", headers={"Accept": "text/html"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and "<html" in r.read().decode().lower()
    # ... and the shell asks the server where the API is: the URL a browser must reach.
    with urllib.request.urlopen(f"{base}/ui-settings", timeout=10) as r:
        assert json.loads(r.read())["api_url"] == server


CHROMIUM = os.environ.get("SHARDSMITH_CHROMIUM") or next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome") if shutil.which(n)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (see README: Operations, browser check)")
def test_browser_finds_our_deployments(server, served):
    root, _, proc = served
    wait_for_deployments(server, proc, {"demo"})
    base = server[: -len("/api")]
    out = subprocess.run(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000", "--dump-dom", f"{base}/deployments"],
        capture_output=True, text=True, timeout=120,
    )
    assert "demo-strict" in out.stdout and "nightly-rebuild" in out.stdout


def _postgres_url() -> str | None:
    """SHARDSMITH_TEST_POSTGRES_URL, or the compose stack's defaults when a server answers on 5432."""
    import socket

    url = os.environ.get("SHARDSMITH_TEST_POSTGRES_URL")
    if url:
        return url
    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=1).close()
    except OSError:
        return None
    return "postgresql+asyncpg://prefect:prefect@127.0.0.1:5432/prefect"


def test_postgres_backend(tmp_path):
    url = _postgres_url()
    if url is None:
        pytest.skip("no PostgreSQL reachable (set SHARDSMITH_TEST_POSTGRES_URL=postgresql+asyncpg://user:pass@host:5432/db)")
    env = {"PREFECT_HOME": str(tmp_path), "PREFECT_API_DATABASE_CONNECTION_URL": url}
    with local_server(env=env, ui=False) as api, client(api) as c:
        from prefect import flow

        @flow(name="shardsmith-postgres-check")
        def check() -> int:
            return 7

        dep = c.create_deployment(flow_id=c.create_flow(check), name="postgres-check")
        assert c.read_deployment(dep).name == "postgres-check"
