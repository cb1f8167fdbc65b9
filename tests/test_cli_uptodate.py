"""A rerun over unchanged inputs says so and starts nothing; a changed input or --force runs the flows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, api_url: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_") or k == "SHARDSMITH_WARM"}
    env["PREFECT_API_URL"] = api_url  # the session's server: no server start per command
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow
def test_nothing_to_do_then_a_new_row_then_force(tmp_path, web, prefect_api_url):
    manifest = tmp_path / "m.csv"
    rows = ["url,caption,license"] + [
        f"{web.url('/img/' + name)},picture number {i},CC0-1.0"
        for i, name in enumerate(["photo.jpg", "a.jpg", "b.png"])
    ]
    manifest.write_text("\n".join(rows) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"""dataset: again
storage: {tmp_path / "store"}
sources:
  - name: s
    manifest: {manifest}
download:
  network: {{allowed_networks: ["127.0.0.1/32"], any_port: true}}
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}}}
  image: {{min_side: 8}}
execution: {{cluster: local, workers: 1}}
"""
    )
    first = cli("run", str(recipe), "--phase", "validate", "--json", api_url=prefect_api_url)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout)["validate"]["counts"]["ok"] == 3

    again = cli("run", str(recipe), "--phase", "validate", api_url=prefect_api_url)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "up to date, nothing to do" in again.stdout and "--force" in again.stdout
    # Nothing was started: no run folder, no Prefect server log, no new report.
    assert len(list((tmp_path / "store" / "again" / "reports").iterdir())) == 1

    # download only is covered by the last run too; reshard is not.
    assert "up to date" in cli("run", str(recipe), "--phase", "download", api_url=prefect_api_url).stdout

    # A new manifest row is work.
    manifest.write_text("\n".join(rows + [f"{web.url('/img/c.webp')},a blue square,CC0-1.0"]) + "\n")
    grown = cli("run", str(recipe), "--phase", "validate", "--json", api_url=prefect_api_url)
    assert grown.returncode == 0, grown.stderr[-3000:]
    assert json.loads(grown.stdout)["download"]["counts"]["rows"] == 4

    # --force runs the flows, which still redo nothing committed; --json prints every phase
    # (reshard's summary holds Arrow tables).
    forced = cli("run", str(recipe), "--phase", "reshard", "--json", "--force", api_url=prefect_api_url)
    assert forced.returncode == 0, forced.stderr[-3000:]
    out = json.loads(forced.stdout)
    assert out["download"]["shards_skipped"] == out["download"]["shards"]
    assert out["reshard"]["samples"] == 4 and out["reshard"]["outputs"][0]["layout"]["rows"] == 4
    assert len(list((tmp_path / "store" / "again" / "reports").iterdir())) == 3
    # Its download and validate did nothing now: their rows say "skipped", not 0 samples/s.
    latest = max((tmp_path / "store" / "again" / "reports").glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    phases = {p["phase"]: p for p in json.loads(latest.read_text())["phases"]}
    assert phases["download"].get("skipped") is True and phases["validate"].get("skipped") is True, phases
    assert "skipped" not in phases["reshard"] and phases["reshard"]["samples_per_s"] > 0


def test_the_tasks_ahead_cap_the_workers_a_run_starts(tmp_path):
    """What the CLI starts its cluster with (cli/running.py): no more workers than tasks ahead,
    chunks to fetch first, then reshard outputs once every chunk is downloaded and validated."""
    from flows.preflight import work_ahead
    from tasks.formats.recipe import load_recipe
    from tasks.formats.storage import Storage
    from tasks.stages.download import download_config_hash, shard_paths
    from tasks.stages.validate import candidate_config_hash, candidate_paths

    manifest = tmp_path / "m.csv"
    manifest.write_text(
        "url,caption,license\n" + "".join(f"http://127.0.0.1:9/{i}.jpg,picture {i},CC0-1.0\n" for i in range(5))
    )
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(
        f"""dataset: ahead
storage: {tmp_path / "store"}
sources:
  - name: s
    manifest: {manifest}
    rows_per_shard: 2
download:
  network: {{allowed_networks: ["127.0.0.1/32"], any_port: true}}
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}}}
reshard: {{samples_per_shard: 4}}
execution: {{cluster: local, workers: 2}}
"""
    )
    recipe = load_recipe(recipe_path)
    assert work_ahead(recipe, ["reshard"]) == 3  # 5 rows in chunks of 2: three to fetch

    # Every chunk downloaded and validated (their ledgers are what marks them committed).
    from flows.preflight import prime_plans, take_primed

    storage = Storage(recipe.storage)
    prime_plans(recipe, storage)
    refs = [c for p in take_primed(recipe) for c in p.chunks]
    chash, vhash = download_config_hash(recipe), candidate_config_hash(recipe)
    for ref in refs:
        tar, ledger = shard_paths(recipe.dataset, ref, chash)
        storage.write_bytes(ledger, b"committed")
        storage.write_bytes(candidate_paths(recipe.dataset, ref.source, ref.index, tar, vhash)[1], b"committed")

    # 5 samples in shards of 4: two outputs, so two reshard tasks at most.
    assert work_ahead(recipe, ["reshard"]) == 2
    assert work_ahead(recipe, ["precache"]) == 2
    # Shards of 1000: one output, one worker.
    bigger = recipe.model_copy(update={"reshard": recipe.reshard.model_copy(update={"samples_per_shard": 1000})})
    assert work_ahead(bigger, ["reshard"]) == 1
    # Nothing after validation asked for, never run before: work, of a size it cannot tell.
    assert work_ahead(recipe, ["validate"]) is None
