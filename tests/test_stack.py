"""The compose stack without Docker: its services as processes, its nightly deployment to a release on S3.

Commands, environments and healthchecks come from docker-compose.yml itself, so this test
breaks when the file drifts. Only what a container gives for free is supplied here: loopback
ports instead of service names, a folder per container, moto's S3 server instead of MinIO and
SQLite instead of PostgreSQL for the Prefect server.
"""

from __future__ import annotations

import collections
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from compose_services import (
    ROOT,
    Localizer,
    Process,
    base_env,
    healthcheck_argv,
    healthcheck_deadline_s,
    interpolate,
    load_compose,
    service_folder,
    stop,
    wait_healthy,
)

from deployments.serve import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

DEPLOYMENT = "stack-demo"  # the deployment with the stack's active nightly schedule
FLOW = "pretraining"
# The values a user would put in .env; every other variable keeps the compose file's default.
VARIABLES = {
    "SHARDSMITH_DEMO_IMAGES": "40",  # a tiny corpus: minutes, not tens of them
    # The corpus service listens on loopback here, not on the demo network's fixed address.
    "SHARDSMITH_DEMO_ADDRESS": "127.0.0.1",
}
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def loopback_parameters(port: int) -> dict:
    """Run parameters for a corpus on a loopback port instead of port 80.

    Where the URL policy refuses ports other than 80 and 443 unless the recipe lists them
    (``download.network.allowed_ports``), the run lists this one, as a custom run from the UI
    would; the deployment and its recipe are used as shipped otherwise.
    """
    from tasks.formats.recipe_download import NetworkConfig

    if "allowed_ports" not in NetworkConfig.model_fields:
        return {}
    return {"overrides": {"extra": {"download.network.allowed_ports": [port]}}}


@dataclass
class Stack:
    api: str
    auth: tuple[str, str]
    scheduler: str
    corpus_port: int
    bucket: str
    s3_options: dict
    corpus: Path
    procs: list[Process]

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_endpoint):
    """Every long-running service of the CPU stack, started and health-checked as Compose would."""
    root = tmp_path_factory.mktemp("stack")
    (root / "logs").mkdir()
    compose = load_compose()
    services = interpolate(compose["services"], VARIABLES)
    api, sched, corpus = free_port(), free_port(), free_port()
    local = Localizer(
        hosts={
            "prefect-server:4200": f"127.0.0.1:{api}",
            "localhost:4200": f"127.0.0.1:{api}",  # the published port, as a browser on the host uses it
            "dask-scheduler:8786": f"127.0.0.1:{sched}",
            "http://minio:9000": s3_endpoint,
            "http://demo-corpus": f"http://127.0.0.1:{corpus}",
        },
        # The image's WORKDIR is this checkout; each named volume is one shared folder.
        mounts={"/opt/shardsmith": str(ROOT)},
    )
    for svc in services.values():
        for volume in svc.get("volumes") or []:
            name, path = volume.split(":")[:2]
            local.mounts[path] = str(root / "volumes" / name)
            (root / "volumes" / name).mkdir(parents=True, exist_ok=True)

    procs: list[Process] = []

    def start(
        name: str,
        service: str,
        ports: dict[int, int],
        extra_args: tuple[str, ...] = (),
        extra_env: dict | None = None,
        cwd: Path | None = None,
    ) -> Process:
        svc = services[service]
        folder = service_folder(root, name)
        env = {**base_env(folder), **local.env(svc.get("environment")), **(extra_env or {})}
        argv = local.argv(svc["command"], ports) + list(extra_args)
        log = root / "logs" / f"{name}.log"
        with open(log, "wb") as out:
            # Its own session, so stopping it stops its children (nannies, flow-run subprocesses).
            # The working folder is the container's own unless the service needs the project's files.
            proc = subprocess.Popen(
                argv, cwd=cwd or folder["HOME"], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        p = Process(name, proc, log)
        if "healthcheck" in svc:
            p.check, p.deadline_s = healthcheck_argv(svc, ports), healthcheck_deadline_s(svc)
        procs.append(p)
        return p

    def healthy(*ps: Process) -> None:
        for p in ps:
            wait_healthy(p)

    try:
        # PostgreSQL stays out: the server keeps SQLite under its own PREFECT_HOME.
        server_env = {
            k: v
            for k, v in services["prefect-server"]["environment"].items()
            if k != "PREFECT_API_DATABASE_CONNECTION_URL"
        }
        services["prefect-server"]["environment"] = server_env
        healthy(
            start("prefect-server", "prefect-server", {4200: api}),
            start("dask-scheduler", "dask-scheduler", {8786: sched, 8787: free_port()}),
            start("demo-corpus", "demo-corpus", {80: corpus}),
        )
        workers = []
        for i in range(int(services["dask-worker"].get("scale", 1))):
            name = f"dask-worker-{i + 1}"
            # Each its own working folder and scratch space, as each container has.
            folder = service_folder(root, name)
            workers.append(
                start(
                    name, "dask-worker", {8789: free_port()}, ("--local-directory", str(Path(folder["HOME"]) / "dask"))
                )
            )
        healthy(*workers)

        worker_env = local.env(services["prefect-worker"]["environment"])
        bucket = worker_env["SHARDSMITH_BUCKET"]
        s3_options = {
            "client_kwargs": {"endpoint_url": s3_endpoint},
            "key": worker_env["AWS_ACCESS_KEY_ID"],
            "secret": worker_env["AWS_SECRET_ACCESS_KEY"],
        }
        # What minio-init does (with mc, which is not here).
        import s3fs

        s3fs.S3FileSystem(**s3_options).mkdir(bucket)

        # prefect-deploy: its own shell command, in the image's working directory, to the end.
        deploy = start("prefect-deploy", "prefect-deploy", {}, cwd=ROOT)
        assert deploy.proc.wait(timeout=900) == 0, deploy.tail()

        health = free_port()
        # Prefect's default webserver port is the one the compose healthcheck asks.
        worker = start(
            "prefect-worker",
            "prefect-worker",
            {8080: health},
            extra_env={"PREFECT_WORKER_WEBSERVER_PORT": str(health), "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1"},
        )
        healthy(worker)

        user, _, password = server_env["PREFECT_SERVER_API_AUTH_STRING"].partition(":")
        yield Stack(
            api=f"http://127.0.0.1:{api}/api",
            auth=(user, password),
            scheduler=f"tcp://127.0.0.1:{sched}",
            corpus_port=corpus,
            bucket=bucket,
            s3_options=s3_options,
            corpus=root / "volumes" / "demo",
            procs=procs,
        )
    finally:
        for p in reversed(procs):
            stop(p)


@pytest.fixture(scope="module")
def run(stack):
    """One run of the nightly deployment, started and followed through the Prefect REST API."""
    import httpx

    with httpx.Client(base_url=stack.api, auth=stack.auth, timeout=30) as http:
        dep = http.get(f"/deployments/name/{FLOW}/{DEPLOYMENT}")
        assert dep.status_code == 200, dep.text
        schedules = dep.json()["schedules"]
        assert [s["active"] for s in schedules] == [True]  # the nightly that releases
        # 503 is Prefect's "retry": the stack's server keeps SQLite here (PostgreSQL in compose),
        # and a write can meet "database is locked" while the server's scheduler fills in the
        # nightly's runs. Prefect's own clients retry a 503; so does this one, a few times.
        for _ in range(10):
            created = http.post(
                f"/deployments/{dep.json()['id']}/create_flow_run",
                json={"parameters": loopback_parameters(stack.corpus_port)},
            )
            if created.status_code != 503:
                break
            time.sleep(3)
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        # A guard against a hang, not a timing assertion.
        deadline = time.monotonic() + 1500
        while True:
            flow_run = http.get(f"/flow_runs/{run_id}").json()
            if flow_run["state"]["type"] in FINAL or time.monotonic() > deadline:
                break
            time.sleep(2)
        logs = http.post(
            "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
        ).json()
    text = "\n".join(f"{rec['level']} {rec['message']}" for rec in logs)
    return flow_run, text


def test_the_nightly_deployment_releases_to_s3_and_reads_back(stack, run):
    import pyarrow.parquet as pq

    from loaders.dataset import ReleaseDataset
    from loaders.release import open_release

    flow_run, logs = run
    assert flow_run["state"]["type"] == "COMPLETED", f"{flow_run['state']}\n{logs[-6000:]}\n{stack.logs()}"
    assert flow_run["parameters"]["recipe_path"] == "recipes/stack-demo.yaml"

    expected = json.loads((stack.corpus / "manifests" / "EXPECTED.json").read_text())
    assert expected["rows"] > 0 and expected["base_url"].startswith("http://127.0.0.1:")
    rel = open_release(f"s3://{stack.bucket}/datasets/stack-demo", storage_options=stack.s3_options, verify=True)
    assert rel.url.startswith(f"s3://{stack.bucket}/") and rel.version == "v0001"

    # Every manifest row once; the download's refusals are the corpus's bad rows, reason by reason.
    ledger = pq.read_table(rel.open("ledger.parquet")).to_pylist()
    assert len(ledger) == expected["rows"] == len({r["key"] for r in ledger})
    download = collections.Counter(r["reason"] for r in ledger if r["phase"] == "download")
    assert dict(download) == expected["by_reason"]
    assert sum(r["phase"] == "release" for r in ledger) == rel.samples > 0

    # Precached on the workers with the models the corpus service wrote to its volume.
    assert set(rel.encodings) == {"image_latents", "text"}
    assert [s.image_shard for s in rel.precache_shards] == [s.name for s in rel.shards]

    # A training job reads it straight from S3.
    seen = [s["key"] for s in ReleaseDataset(rel, image_size=64, shuffle=False, rank=0, world_size=1)]
    assert len(seen) == len(set(seen)) == rel.samples


def test_both_workers_ran_shards_of_the_run(stack, run):
    from distributed import Client

    assert run[0]["state"]["type"] == "COMPLETED"
    # The run used the stack's scheduler, not a cluster of its own: the workers started from
    # the compose file did the work, both of them.
    with Client(stack.scheduler, timeout=30) as client:
        executed = client.run(lambda dask_worker: dask_worker.state.executed_count)
    assert len(executed) == 2 and all(n > 0 for n in executed.values()), executed
