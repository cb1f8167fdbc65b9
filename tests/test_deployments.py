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
    from tasks.audit.report_web import REPORT_URL_ENV, ReportServer
    from tasks.demo.corpus import prepare_demo
    from tasks.formats.storage import Storage

    root = tmp_path_factory.mktemp("demo")
    web, expected = prepare_demo(root, n=40, port=0)
    # What `shardsmith report --serve --storage ROOT/store` runs: the runs' report links lead here.
    reports = ReportServer(Storage(str(root / "store"))).start()
    env = {**os.environ, "PREFECT_API_URL": server, "SHARDSMITH_DEMO_DIR": str(root), REPORT_URL_ENV: reports.url}
    log = open(root / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "deployments.serve"],
        cwd=PROJECT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield root, expected, proc, reports.url
    finally:
        stop_process(proc)
        log.close()
        reports.stop()
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


# A run with edited parameters, the way the UI's "custom run" starts one.
RUN_PARAMS = {"phases": ["download"], "workers": 1, "overrides": {"min_success_rate": 0.6, "task_retries": 1}}


@pytest.fixture(scope="module")
def demo_run(server, served):
    """The demo deployment's run with RUN_PARAMS, finished: (flow run, serve log)."""
    root, _, proc, _ = served
    found = wait_for_deployments(server, proc, {"demo", "demo-strict", "nightly-rebuild"})
    with client(server) as c:
        run = c.create_flow_run_from_deployment(found["demo"].id, parameters=RUN_PARAMS)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            run = c.read_flow_run(run.id)
            if run.state.is_final():
                break
            time.sleep(1)
    log = (root / "serve.log").read_text(errors="replace")
    assert run.state.is_completed(), f"{run.state}\n{log[-4000:]}"
    return run, log


def test_served_deployments_schedules_forms_and_a_run(server, served, demo_run):
    root, expected, proc, reports_url = served
    found = wait_for_deployments(server, proc, {"demo", "demo-strict", "nightly-rebuild"})
    demo = found["demo"]

    # Schedules with their timezones, as prefect.yaml says. The one active nightly is the
    # stack's (tests/test_stack.py runs it); the laptop demo and the blocked example are paused.
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in demo.schedules] == [
        ("0 2 * * *", "Europe/Amsterdam", False)
    ]
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
    assert overrides["curate_compute_dtype"]["anyOf"][0]["enum"] == ["auto", "fp32", "bf16", "fp16"]
    assert overrides["privacy_faces"]["anyOf"][0]["enum"] == ["off", "record", "blur", "reject"]
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

        run, _ = demo_run
        assert run.parameters["overrides"]["min_success_rate"] == 0.6

        from prefect.client.schemas.filters import (
            ArtifactFilter,
            ArtifactFilterFlowRunId,
            FlowRunFilter,
            FlowRunFilterParentFlowRunId,
        )

        # The run the user started carries the run's artifacts; its phase subflow carries the phase's.
        arts = {
            a.key: a
            for a in c.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
            )
        }
        children = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]))
        )
        subflows = [r.id for r in children]
        assert subflows
        phase_arts = {
            a.key: a
            for a in c.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=subflows))
            )
        }
    assert set(arts) == {"demo-summary", "demo-reasons", "demo-gates", "demo-report", "demo-data-docs"}
    assert {"demo-download-progress", "demo-download-summary", "demo-download-reasons"} <= set(phase_arts)
    assert phase_arts["demo-download-progress"].data == 100.0
    assert f"| {expected['rows']} | {expected['ok']} |" in phase_arts["demo-download-summary"].data
    assert f"| download | {expected['rows']} | {expected['ok']} |" in arts["demo-summary"].data
    # The links lead to the report server, which serves the report the run wrote.
    report = next((root / "store" / "demo" / "reports").glob("*/report.html"))
    url = f"{reports_url}/demo/reports/{report.parent.name}/report.html"
    assert f"]({url})" in arts["demo-report"].data and f"]({url})" in arts["demo-summary"].data
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.read() == report.read_bytes()
    # The run's outputs are where the recipe says, relative to the project folder.
    assert list((root / "store" / "demo" / "download").rglob("*.ledger.parquet"))


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


def require(what: str, why: str):
    """Skip for want of a tool on a developer's machine; in CI (CI=true) a missing tool fails,
    since .ci/run installs it (make system-deps)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{what} is missing in CI: {why}")
    pytest.skip(f"{what} not installed ({why}; `make system-deps` installs it)")


CHROMIUM = os.environ.get("SHARDSMITH_CHROMIUM") or next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome") if shutil.which(n)), None
)
CHROMEDRIVER = os.environ.get("SHARDSMITH_CHROMEDRIVER") or shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium driven by chromedriver (Debian's chromium and chromium-driver), with a
    fresh profile and nothing that phones home; never a downloaded browser."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        require("Chromium and chromedriver", "apt-get install chromium chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        require("selenium", "the test extra: pip install -e '.[test]'")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        opts.add_argument(flag)
    # An explicit driver path: Selenium Manager (which would download one) never runs.
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, what: str, timeout: float = 90):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.5).until(lambda d: condition(d))
    except TimeoutException:
        pytest.fail(
            f"{what} not seen within {timeout} s at {driver.current_url}:\n{driver.find_element('tag name', 'body').text[:3000]}"
        )


def test_browser_finds_our_deployments(server, served, browser):
    _, _, proc, _ = served
    wait_for_deployments(server, proc, {"demo"})
    browser.get(f"{server[: -len('/api')]}/deployments")
    wait_for(
        browser, lambda d: "demo-strict" in d.page_source and "nightly-rebuild" in d.page_source, "our deployments"
    )


def test_browser_opens_the_run_its_artifacts_and_its_report(server, served, demo_run, browser):
    """As a user would: the run's page, its Artifacts tab, the summary with its plot, then the
    report link, which opens the served report, and the gate results (Data Docs)."""
    from selenium.webdriver.common.by import By

    root, expected, _, reports_url = served
    run, _ = demo_run
    browser.get(f"{server[: -len('/api')]}/runs/flow-run/{run.id}")
    tab = wait_for(
        browser,
        lambda d: next(
            (
                e
                for e in d.find_elements(By.XPATH, "//li[contains(@class, 'p-tab')][normalize-space()='Artifacts']")
                if e.is_displayed()
            ),
            None,
        ),
        "the Artifacts tab",
    )
    tab.click()
    card = wait_for(
        browser,
        lambda d: next(
            (
                e
                for e in d.find_elements(
                    By.XPATH, "//*[contains(@class, 'artifact-card__title')][normalize-space()='demo-summary']"
                )
                if e.is_displayed()
            ),
            None,
        ),
        "the demo-summary artifact",
    )
    card.click()
    # The artifact's page renders the markdown: the counts, and the status plot as an image.
    wait_for(
        browser,
        lambda d: (
            "Rows by reason" in d.find_element(By.TAG_NAME, "body").text
            or "Gates" in d.find_element(By.TAG_NAME, "body").text
        ),
        "the rendered summary",
    )
    plot = wait_for(
        browser,
        lambda d: next(
            (
                i
                for i in d.find_elements(By.CSS_SELECTOR, "img[src^='data:image/svg+xml']")
                if i.get_property("naturalWidth")
            ),
            None,
        ),
        "the status plot",
    )
    assert plot.get_property("naturalWidth") == 600 and plot.get_attribute("alt") == "status download"
    link = wait_for(
        browser,
        lambda d: next((a for a in d.find_elements(By.TAG_NAME, "a") if a.text.strip() == "report.html"), None),
        "the report link",
    )
    href = link.get_attribute("href")
    assert href.startswith(f"{reports_url}/demo/reports/") and href.endswith("/report.html")
    before = set(browser.window_handles)
    link.click()  # the UI opens links in a new tab
    new = wait_for(browser, lambda d: next(iter(set(d.window_handles) - before), None), "the report's tab")
    browser.switch_to.window(new)
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "[data-verdict]"), "the served report")
    assert browser.title.startswith("shardsmith report: demo")
    cell = browser.find_element(
        By.CSS_SELECTOR, "table[data-table='overview'] tr[data-key='download'] td[data-col='rows']"
    )
    assert cell.get_attribute("data-value") == str(expected["rows"])
    # The gate results open from the report too, styled and with their tables, without a network.
    browser.find_element(By.XPATH, "//a[normalize-space()='data_docs']").click()
    wait_for(
        browser,
        lambda d: d.find_elements(By.XPATH, "//td//a[contains(@href, 'validations/')]"),
        "the Data Docs index's rows",
    )
    assert "Great Expectations" in browser.title or "Data Docs" in browser.title
    assert browser.execute_script("return document.scripts.length") == 0


def _initdb() -> str | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb")) if Path("/usr/lib/postgresql").is_dir() else []
    return str(found[-1]) if found else shutil.which("initdb")


@pytest.fixture(scope="module")
def postgres_url():
    """SHARDSMITH_TEST_POSTGRES_URL, else a throwaway PostgreSQL server of our own on loopback
    (initdb in a temp dir, trust auth, a free port), run as the postgres user when we are root
    (PostgreSQL refuses to run as root)."""
    url = os.environ.get("SHARDSMITH_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    initdb = _initdb()
    if initdb is None:
        require(
            "PostgreSQL",
            "apt-get install postgresql, or set SHARDSMITH_TEST_POSTGRES_URL=postgresql+asyncpg://user:pass@host:5432/db",
        )
    import pwd
    import tempfile

    from deployments.serve import free_port

    bindir = Path(initdb).parent
    as_user: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="shardsmith-pg-"))
    if os.geteuid() == 0:
        pg = pwd.getpwnam("postgres")
        os.chown(base, pg.pw_uid, pg.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data = base / "data"

    def pg(*args: str) -> None:
        out = subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{args[0]} failed:\n{out.stdout}\n{out.stderr}"

    pg(initdb, "-D", str(data), "-U", "prefect", "--auth=trust", "-E", "UTF8", "--no-sync")
    pg(
        str(bindir / "pg_ctl"),
        "-D",
        str(data),
        "-l",
        str(base / "log"),
        "-w",
        "-t",
        "60",
        "start",
        "-o",
        f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off",
    )
    try:
        pg(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "prefect", "prefect")
        yield f"postgresql+asyncpg://prefect@127.0.0.1:{port}/prefect"
    finally:
        subprocess.run(
            [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
            capture_output=True,
            timeout=120,
        )
        shutil.rmtree(base, ignore_errors=True)


def test_postgres_backend(tmp_path, postgres_url):
    env = {"PREFECT_HOME": str(tmp_path), "PREFECT_API_DATABASE_CONNECTION_URL": postgres_url}
    with local_server(env=env, ui=False) as api, client(api) as c:
        from prefect import flow

        @flow(name="shardsmith-postgres-check")
        def check() -> int:
            return 7

        dep = c.create_deployment(flow_id=c.create_flow(check), name="postgres-check")
        assert c.read_deployment(dep).name == "postgres-check"
