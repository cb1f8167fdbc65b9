"""SIGKILL of a whole run mid-phase, then a rerun: it converges on the uninterrupted release."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
LICENSES = ("CC0-1.0", "CC-BY-4.0", "All rights reserved")

RECIPE = """\
dataset: kills
kind: pretraining
storage: {store}
sources:
  - name: pics
    manifest: {manifest}
    rows_per_shard: 5
download:
  timeout_s: 10
  retries: 0
  network:
    allowed_networks: ["127.0.0.1/32"]
    any_port: true
validate:
  license:
    allow: [CC0-1.0, CC-BY-4.0]
    review: {{reviewed_by: resilience tests, reviewed_on: 2026-11-30}}
  image:
    min_side: 16
    max_aspect_ratio: 8
reshard:
  samples_per_shard: 3
  seed: 11
precache:
  image_latents: {{model: {vae}, resolution: 64}}
  batch_size: 2
gates:
  download: {{min_success_rate: 0.5}}
  validate: {{max_reject_rate: 0.9}}
execution:
  cluster: local
  workers: 1
  task_retries: 0
"""


def write_corpus(root: Path, n: int = 16) -> tuple[object, Path]:
    """A loopback server over ``n`` distinct generated images and a manifest recipe (plus a 404
    row and a license the recipe refuses, so every status occurs); returns (server, recipe)."""
    from tasks.demo.images import render_image
    from tasks.demo.webserver import ImageWeb

    images = root / "images"
    images.mkdir(parents=True)
    names = []
    for i in range(n):
        name, data, _ = render_image(5, i)
        (images / name).write_bytes(data)
        names.append(name)
    server = ImageWeb(images).start()
    manifest = root / "pics.csv"
    with open(manifest, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["url", "caption", "license"])
        for i, name in enumerate(names):
            w.writerow([f"{server.base_url}/img/{name}", f"generated scene number {i} with shapes", LICENSES[i % 3]])
        w.writerow([f"{server.base_url}/status/404", "a missing picture", "CC0-1.0"])
    recipe = root / "recipe.yaml"
    from tasks.demo.models import make_all

    vae = make_all(root / "models", ("vae",))["vae"]
    recipe.write_text(RECIPE.format(store=root / "unused-store", manifest=manifest, vae=vae))
    return server, recipe


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, prefect_harness):
    from prefect.settings import get_current_settings

    root = tmp_path_factory.mktemp("kill")
    server, recipe = write_corpus(root)
    yield root, recipe, str(get_current_settings().api.url)
    server.stop()


def run_cli(recipe: Path, store: Path, api_url: str, fault: str | None) -> subprocess.CompletedProcess:
    """``shardsmith run`` in its own process group; a ``killgroup`` fault SIGKILLs all of it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_") or k == "SHARDSMITH_WARM"}
    env["PREFECT_API_URL"] = api_url  # the session's test server: no server start per run
    if fault:
        env["SHARDSMITH_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "cli", "run", str(recipe), "--storage", str(store)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        start_new_session=True,
    )


def release_of(store: Path) -> tuple[dict, list, list]:
    base = store / "kills" / "releases"
    version = (base / "LATEST").read_text().strip()
    index = json.loads((base / version / "index.json").read_text())
    ledger = pq.read_table(base / version / "ledger.parquet").to_pylist()
    samples = pq.read_table(base / version / "samples.parquet").to_pylist()
    return index, ledger, samples


def committed(store: Path, phase: str) -> dict[str, int]:
    """Ledger file -> inode: a rerun that redoes a committed shard replaces its ledger. A temp
    name (``.tmp-...``) is a write the kill cut short, not a committed ledger."""
    return {
        str(p.relative_to(store)): p.stat().st_ino
        for p in (store / "kills" / phase).rglob("*.ledger.parquet")
        if not p.name.startswith(".tmp-")
    }


@pytest.mark.slow
def test_killed_mid_phase_at_each_commit_point_then_rerun_is_byte_identical(corpus, tmp_path, dask_address):
    from flows.pretraining import pretraining_flow

    root, recipe, api_url = corpus
    baseline = tmp_path / "baseline"
    # The uninterrupted run, in this process on the session's cluster; the killed runs below
    # are CLI processes with clusters of their own, which the kills take down with them.
    pretraining_flow(recipe_path=str(recipe), storage=str(baseline), cluster=dask_address)
    want_index, want_ledger, want_samples = release_of(baseline)
    assert want_index["totals"]["samples"] >= 6 and {r["status"] for r in want_ledger} == {"ok", "rejected", "error"}

    store = tmp_path / "crashed"
    # Each kill lands between a shard's tar (committed) and its ledger, in every phase, or, in
    # the release phase, after every file but index.json; the whole process group dies, workers
    # included.
    kills = [
        ("download", "killgroup:commit:kills/download/pics/000001-*.tar"),
        # Validation runs in the download's pass (tasks/stages/onepass.py): its commit point is the
        # candidate shard, committed before its ledger and before the download ledger.
        ("validate", "killgroup:commit:kills/validate/candidates/pics/000001-*.tar"),
        ("reshard", "killgroup:commit:kills/reshard/*/shard-000001.tar"),
        ("precache", "killgroup:commit:kills/precache/*/shard-000001.tar"),
        ("release", "killgroup:before:kills/releases/*/index.json"),
    ]
    before: dict[str, int] = {}
    for phase, fault in kills:
        done = run_cli(recipe, store, api_url, fault)
        assert done.returncode == -signal.SIGKILL, (
            f"{phase}: expected a SIGKILL, got {done.returncode}\n{done.stderr[-3000:]}"
        )
        if phase != "release":
            # The shard whose tar was committed has no ledger: it is not done.
            tars = {p.name[: -len(".tar")] for p in (store / "kills" / phase).rglob("*.tar") if ".tmp-" not in p.name}
            ledgers = {
                p.name[: -len(".ledger.parquet")]
                for p in (store / "kills" / phase).rglob("*.ledger.parquet")
                if not p.name.startswith(".tmp-")
            }
            assert tars - ledgers, f"{phase}: the kill did not land between a tar and its ledger"
        # What was committed before this kill is never redone by the runs after it.
        now = {
            k: v
            for phase_dir in ("download", "validate", "reshard", "precache")
            for k, v in committed(store, phase_dir).items()
        }
        assert {k: now.get(k) for k in before} == before
        before = now
        lock = json.loads((store / "kills" / "run.lock").read_text())
        assert lock["pid"] != os.getpid()  # the dead run's lock is left behind...

    releases = store / "kills" / "releases"
    assert not (releases / "LATEST").exists() and not (releases / "v0001" / "index.json").exists()
    assert (releases / "v0001" / "ledger.parquet").exists()  # the release was killed half-written

    done = run_cli(recipe, store, api_url, None)  # ...and broken by the rerun: its pid is gone
    assert done.returncode == 0, done.stderr[-3000:]
    assert "broke the stale lock" in done.stderr + done.stdout
    got_index, got_ledger, got_samples = release_of(store)
    # The abandoned v0001 keeps its number; the rerun's release is v0002 and equals the baseline.
    assert got_index["version"] == "v0002" and not (releases / "v0001" / "index.json").exists()
    # Everything but what names the run (the recipe hash covers the storage root; the code
    # version changes with every commit made meanwhile).
    run_specific = {"version", "created", "run", "fingerprint", "recipe_hash", "data_docs", "parent", "code_version"}
    assert {k: v for k, v in got_index.items() if k not in run_specific} == {
        k: v for k, v in want_index.items() if k not in run_specific
    }
    assert got_ledger == want_ledger and got_samples == want_samples
    for s in got_index["shards"]:
        assert (releases / "v0002" / s["name"]).read_bytes() == (
            baseline / "kills" / "releases" / "v0001" / s["name"]
        ).read_bytes()
    assert not (store / "kills" / "run.lock").exists()
    leftovers = [p for p in (store / "kills").rglob("*") if p.name.startswith(".tmp-")]
    assert leftovers == []
