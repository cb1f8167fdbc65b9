"""The run's runtime: a Dask cluster leaves the process's Dask configuration whole; one-run Prefect servers start together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# In a fresh process, where nothing has imported distributed yet (as a script or a notebook
# that calls start_cluster first): the client and the scheduler read distributed's settings
# afterwards, and a lost key fails their next connection.
SCRIPT = """
import dask
from flows.runtime import close_cluster, start_cluster
cluster = start_cluster("local", 1, 1, {})
try:
    print(dask.config.get("distributed.comm.timeouts.tcp"), dask.config.get("distributed.worker.profile.enabled"))
finally:
    close_cluster(cluster)
"""


def test_start_cluster_keeps_the_distributed_config_and_sets_ours_only_for_the_start():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # distributed's default timeout is there; the profiler setting was ours for the start only.
    assert out.stdout.split() == ["30s", "True"]


# Servers of runs started at once on a machine whose PREFECT_HOME is new each create its
# database; all but one failed their startup ("table already exists", uvicorn's exit code 3).
SERVERS_SCRIPT = """
from flows.runtime import LocalServer
servers = [LocalServer().start() for _ in range(4)]
try:
    for server in servers:
        server.wait(120)
        print("answered")
finally:
    for server in servers:
        server.stop()
"""


def test_one_run_servers_started_together_on_a_new_prefect_home_all_answer(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    out = subprocess.run(
        [sys.executable, "-c", SERVERS_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["answered"] * 4
    assert (tmp_path / "home" / "prefect.db").exists()


def test_a_phase_flow_sends_no_heartbeats_while_the_run_flow_does(prefect_harness, monkeypatch):
    """Prefect's heartbeats tell a crashed run (an automation watches them); the run's flow
    keeps them, the phases under it send none (each would hold its flow run's end up to 1 s)."""
    from prefect import flow
    from prefect.events.clients import AssertingEventsClient
    from prefect.events.worker import EventsWorker
    from prefect.runtime import flow_run
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.phase import run_phase

    AssertingEventsClient.reset()
    worker = EventsWorker.instance(AssertingEventsClient)
    monkeypatch.setattr(EventsWorker, "instance", lambda *_: worker)

    @flow
    def phase() -> str:
        return flow_run.get_id()

    @flow
    def run() -> tuple[str, str]:
        return flow_run.get_id(), run_phase(phase, ThreadPoolTaskRunner())

    try:
        parent, child = run()
    finally:
        worker.drain()
    events = [e for client in AssertingEventsClient.all for e in client.events]
    # A flow's first heartbeat goes out as it starts (then one every 180 s).
    beats = {e.resource.id for e in events if e.event == "prefect.flow-run.heartbeat"}
    assert child != parent
    assert beats == {f"prefect.flow-run.{parent}"}


def test_phase_flows_are_built_without_a_parameter_schema_and_deployed_flows_keep_theirs():
    """Prefect builds a JSON schema of a flow's parameters when the flow is defined, for an
    attribute nothing reads; for the phase flows (a Recipe and typed summaries) that cost every
    run 0.5-1 s of CPU at its start (flows.phase.phase_flow). The deployed flows keep theirs,
    and a deployment's form, which Prefect builds from the function, is whole for any flow."""
    from prefect.utilities.callables import parameter_schema

    from flows.download import download_flow
    from flows.pretraining import pretraining_flow
    from flows.reshard import reshard_flow

    assert download_flow.parameters.properties == {}
    assert reshard_flow.parameters.properties == {}
    assert {"recipe_path", "phases", "overrides"} <= set(pretraining_flow.parameters.properties)
    # Prefect's own function is back in place once the phase flows are built.
    import prefect.flows

    assert prefect.flows.parameter_schema is parameter_schema
    assert {"recipe", "run", "fuse_validation"} <= set(parameter_schema(download_flow.fn).properties)


def test_a_one_run_server_reads_settings_that_skip_blocks_and_the_collections_import(monkeypatch):
    """The local server's environment, read by Prefect itself in a fresh process: no UI, no
    block registration, and no memo check around it (which would import every installed
    Prefect collection, and Dask with prefect-dask, to hash their blocks); no API URL of its own.
    A renamed Prefect setting would be silently ignored without this."""
    import json

    from flows.runtime import LocalServer

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    read = (
        "import json, prefect.settings as ps; s = ps.get_current_settings(); print(json.dumps(["
        "s.server.ui.enabled, s.server.register_blocks_on_start, s.server.memoize_block_auto_registration,"
        "ps.PREFECT_API_BLOCKS_REGISTER_ON_START.value(), ps.PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION.value(),"
        "s.api.url]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", read], env=LocalServer().env(), capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False, False, False, False, None]
