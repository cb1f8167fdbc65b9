"""The warm service: runs forked from one process that keeps a Prefect server and a Dask cluster.

Every check goes through the real `shardsmith` command in subprocesses, as a user's terminal
would: the first run starts the service, later runs go through it, concurrently too; what
they release matches a run without it; signals reach the run; it stops when told or idle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cli import warm

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _recipe(tmp_path: Path, web, name: str, slow: int = 0) -> Path:
    rows = ["url,caption,license"]
    rows += [
        f"{web.url('/img/' + n)},picture number {i},CC0-1.0" for i, n in enumerate(["photo.jpg", "a.jpg", "b.png"])
    ]
    rows += [f"{web.url('/slow/a.jpg')}?u={i},a slow square number {i},CC0-1.0" for i in range(slow)]
    manifest = tmp_path / f"{name}.csv"
    manifest.write_text("\n".join(rows) + "\n")
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(
        f"""dataset: {name}
storage: {tmp_path / "store"}
sources:
  - name: s
    manifest: {manifest}
    rows_per_shard: 3
download:
  timeout_s: 600
  retries: 0
  network:
    allowed_networks: ["127.0.0.1/32"]
    any_port: true
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}}}
  image: {{min_side: 8}}
execution:
  cluster: local
"""
    )
    return recipe


def _env(warm_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return env | {"SHARDSMITH_WARM": "1", "SHARDSMITH_WARM_DIR": str(warm_dir), "SHARDSMITH_WARM_IDLE_S": "300"} | extra


def _shardsmith(env: dict[str, str], *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    proc = _shardsmith(env, *args)
    out, err = proc.communicate(timeout=400)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _services(warm_dir: Path) -> list[dict]:
    return warm.running({"SHARDSMITH_WARM_DIR": str(warm_dir)})


def _released(store: Path) -> list[tuple[int, str]]:
    index = json.loads((store / "releases" / "v0001" / "index.json").read_text())
    return [(s["samples"], s["sha256"]) for s in index["shards"]]


def _gone(pids: list[int], timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _wait_service(warm_dir: Path, timeout: float = 180) -> dict:
    """The one service the first run started, once it takes commands."""
    deadline = time.monotonic() + timeout
    while not (found := _services(warm_dir)) or not Path(found[0]["socket"]).exists():
        assert time.monotonic() < deadline, "no warm service started"
        time.sleep(0.2)
    (info,) = found
    return info


def _tree(info: dict) -> list[int]:
    pids = [info["pid"], info["server_pid"], info["cluster_pid"]]
    return pids + [c.pid for c in psutil.Process(info["cluster_pid"]).children(recursive=True)]


@pytest.fixture(scope="module")
def service(tmp_path_factory, web):
    """One warm service for the module (its first run started it); stopped at the end."""
    warm_dir = tmp_path_factory.mktemp("warm")
    tmp = tmp_path_factory.mktemp("first")
    env = _env(warm_dir)
    try:
        # The first run runs in its own process and starts the service on its way out.
        first = _run(env, "run", str(_recipe(tmp, web, "first")))
        assert first.returncode == 0, first.stderr[-3000:]
        assert "started a warm service" in first.stderr
        info = _wait_service(warm_dir)
        assert info["commands"] == 0
        yield warm_dir, env, info
    finally:
        pids = [s["pid"] for s in _services(warm_dir)]
        _run(env, "warm", "--stop")
        assert not _gone(pids)


def test_later_runs_go_through_the_same_service_and_release_what_a_run_without_it_does(tmp_path, web, service):
    warm_dir, env, info = service
    recipe = _recipe(tmp_path, web, "same")
    through = _run(env, "run", str(recipe))
    assert through.returncode == 0, through.stderr[-3000:]
    assert "warm service" not in through.stderr
    assert "released v0001" in through.stdout
    (now,) = _services(warm_dir)
    assert now["pid"] == info["pid"]
    log = (warm_dir / Path(info["socket"]).with_suffix(".log").name).read_text()
    assert f"run {recipe}" in log  # the service forked the command

    # The same recipe without the service, into another store: the same release, byte for byte.
    cold_recipe = tmp_path / "cold.yaml"
    cold_recipe.write_text(recipe.read_text().replace(str(tmp_path / "store"), str(tmp_path / "cold-store")))
    cold = _run(env | {"SHARDSMITH_WARM": "0"}, "run", str(cold_recipe))
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert _released(tmp_path / "store" / "same") == _released(tmp_path / "cold-store" / "same")

    # A rerun with nothing to do answers through the service too.
    again = _run(env, "run", str(recipe))
    assert again.returncode == 0 and "up to date" in again.stdout + again.stderr


def test_concurrent_runs_share_the_service(tmp_path, web, service):
    warm_dir, env, info = service
    procs = [_shardsmith(env, "run", str(_recipe(tmp_path, web, f"c{i}"))) for i in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-3000:]
        assert "released v0001" in out
    (now,) = _services(warm_dir)
    assert now["pid"] == info["pid"]


def test_a_signal_reaches_the_run_and_the_service_goes_on(tmp_path, web, service):
    warm_dir, env, info = service
    recipe = _recipe(tmp_path, web, "sig", slow=4)
    store = tmp_path / "store" / "sig"
    proc = _shardsmith(env, "run", str(recipe), "--phase", "download", start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list((store / "download").rglob("000000-*.ledger.parquet")):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the quick shard never committed"
            time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's process group: the client
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert "SIGINT: stopping" in err
    assert not (store / "run.lock").exists()
    # Its slow fetches (600 s timeouts) no longer hold the shared workers: the run restarted the
    # workers that ran them before it let go of the dataset, and the web sees them leave. (Only
    # /slow counts: a request an earlier test left on /hang stays in flight until the server stops.)
    deadline = time.monotonic() + 30
    while web.stats()["in_flight_by_path"]["/slow/a.jpg"]:
        assert time.monotonic() < deadline, "the stopped run's fetches go on on the warm workers"
        time.sleep(0.3)
    # A client killed outright: the service stops its run, which releases the lock.
    proc = _shardsmith(env, "run", str(recipe), "--phase", "download")
    deadline = time.monotonic() + 120
    while not (store / "run.lock").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while (store / "run.lock").exists():
        assert time.monotonic() < deadline, "the run of a killed client held its lock"
        time.sleep(0.3)
    # The service is the same and takes the next command.
    (now,) = _services(warm_dir)
    assert now["pid"] == info["pid"]
    ok = _run(env, "run", str(_recipe(tmp_path, web, "after")))
    assert ok.returncode == 0, ok.stderr[-3000:]


def test_a_service_stops_when_idle_and_takes_its_server_and_cluster_with_it(tmp_path, web):
    warm_dir = tmp_path / "warm"
    env = _env(warm_dir, SHARDSMITH_WARM_IDLE_S="8")
    done = _run(env, "run", str(_recipe(tmp_path, web, "idle")))
    assert done.returncode == 0, done.stderr[-3000:]
    info = _wait_service(warm_dir)
    tree = _tree(info)
    assert not _gone(tree, timeout=90)
    assert not list(warm_dir.glob("*.sock"))
    assert not _services(warm_dir)


def test_a_changed_environment_names_another_service():
    base = {"PATH": "/usr/bin", "AWS_PROFILE": "a", "PWD": "/x", "TERM": "xterm"}
    assert warm.identity(base) == warm.identity(base | {"PWD": "/y", "TERM": "dumb", "SHLVL": "3"})
    assert warm.identity(base) != warm.identity(base | {"AWS_PROFILE": "b"})
    assert warm.identity(base) != warm.identity(base | {"SHARDSMITH_FAULT": "x"})


@pytest.mark.parametrize(
    "argv, on",
    [
        (["shardsmith", "run", "r.yaml"], True),
        (["shardsmith", "run", "r.yaml", "--verbose"], False),
        (["shardsmith", "run", "--help"], False),
        (["shardsmith", "demo"], False),
        (["shardsmith", "releases", "x"], False),
    ],
)
def test_which_commands_go_through_the_service(argv, on):
    assert warm.eligible(argv, {"SHARDSMITH_WARM": "1"}) is on
    assert warm.eligible(argv, {"SHARDSMITH_WARM": "0"}) is False
